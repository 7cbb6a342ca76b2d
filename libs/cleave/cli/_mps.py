"""NVIDIA MPS for workers that share one GPU.

Without MPS, the GPU runs one process's kernels at a time and switches between processes by
time slices, so a prefill worker's forward and a decode worker's step on the same device
wait for each other. Under an MPS control daemon the processes' kernels share the SMs at
once (`bench/results/disagg/disagg-20261203T183610Z.md` against `...183317Z.md`, one H200:
disaggregated TPOT p50 2.9 -> 2.7 ms and output tokens/s 12.9k -> 15.2k, run minutes apart
with the same code).

`cleave up` starts a daemon of its own (pipe and log directories under the stack's workdir,
so two stacks never share one) when more than one GPU worker shares the device, and stops
it after its children:

    mps = MpsDaemon.start(workdir / "mps")   # raises MpsUnavailable with the reason
    env = {**os.environ, **mps.env}          # every GPU child connects through it
    ...
    mps.stop()

A daemon the caller already runs (CUDA_MPS_PIPE_DIRECTORY set in the environment) is used
as it is and not stopped.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from cleave.errors import FailedPrecondition

CONTROL = "nvidia-cuda-mps-control"
PIPE_ENV, LOG_ENV = "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"
# a client's cap on the SMs its kernels may occupy, in percent (read by the CUDA driver)
ACTIVE_THREAD_PERCENTAGE_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
MpsSetting = Literal["auto", "on", "off"]
STOP_WAIT_S = 15.0  # how long stop() waits for a daemon told to quit to be gone
START_RETRY_S = 10.0  # how long start() retries a refused `-d` (a previous daemon still exiting)
RETRY_INTERVAL_S = 0.1


class MpsUnavailable(FailedPrecondition):
    """The MPS control daemon cannot be started here (no binary, or it refused)."""


def wants_mps(setting: MpsSetting, device: str, num_gpu_workers: int) -> bool:
    """Whether a stack should run its GPU workers under MPS: `on` always, `auto` when more
    than one worker shares a CUDA device, `off` never."""
    if setting == "off" or not device.startswith("cuda"):
        return False
    return setting == "on" or num_gpu_workers > 1


@dataclass
class MpsDaemon:
    """A running MPS control daemon and the environment its clients need.

    Attributes:
        env: variables that make a CUDA process a client of this daemon.
        owned: whether `stop()` shuts the daemon down (False for one the caller runs).
    """

    env: dict[str, str] = field(default_factory=dict)
    owned: bool = False

    @classmethod
    def start(cls, directory: Path, environ: dict[str, str] | None = None) -> "MpsDaemon":
        """Start a daemon whose pipe and log directories live under `directory`, or adopt
        the one `environ` already names."""
        if environ and environ.get(PIPE_ENV):
            return cls(env={}, owned=False)
        control = shutil.which(CONTROL)
        if control is None:
            raise MpsUnavailable(f"{CONTROL} is not on PATH (it ships with the NVIDIA driver); pass --mps off")
        pipe, log = directory / "pipe", directory / "log"
        pipe.mkdir(parents=True, exist_ok=True)
        log.mkdir(parents=True, exist_ok=True)
        env = {PIPE_ENV: str(pipe), LOG_ENV: str(log)}
        # A daemon that another stack just told to quit may still hold the device for a
        # moment (its server waits for its clients): a refusal is retried until it is gone.
        deadline = time.monotonic() + START_RETRY_S
        while True:
            done = subprocess.run([control, "-d"], env=_with(env), capture_output=True, text=True, timeout=30)
            if done.returncode == 0:
                return cls(env=env, owned=True)
            if time.monotonic() >= deadline:
                break
            time.sleep(RETRY_INTERVAL_S)
        reason = (done.stderr or done.stdout).strip() or f"exit code {done.returncode}"
        logged = _last_line(log / "control.log")
        raise MpsUnavailable(f"{CONTROL} -d failed: {reason}{f' ({logged})' if logged else ''}; pass --mps off")

    def stop(self) -> None:
        """Shut down an owned daemon (its clients have exited); idempotent."""
        if not self.owned:
            return
        self.owned = False
        control = shutil.which(CONTROL)
        if control is None:
            return
        env = _with(self.env)
        subprocess.run([control], input="quit\n", env=env, capture_output=True, text=True, timeout=30, check=False)
        # `quit` returns before the daemon and its server have exited; the next stack's
        # daemon cannot start until they have. The control program exits non-zero once no
        # daemon answers on this pipe directory.
        deadline = time.monotonic() + STOP_WAIT_S
        while time.monotonic() < deadline:
            alive = subprocess.run([control], input="get_server_list\n", env=env, capture_output=True, text=True,
                                   timeout=30, check=False)
            if alive.returncode != 0:
                return
            time.sleep(RETRY_INTERVAL_S)


def _with(env: dict[str, str]) -> dict[str, str]:
    return {**os.environ, **env}


def _last_line(path: Path) -> str:
    """The last non-empty line of the daemon's log (why it refused), or ""."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return next((line.strip() for line in reversed(lines) if line.strip()), "")
