"""The cleave stack as local processes: kvstore, prefill worker(s), decode worker(s), gateway.

Each service is `python -m services.<name>` on an ephemeral port it reports through
`--port-file`; a service counts as up once `grpc.health.v1` says SERVING. Workers start in
parallel after the kvstore, the gateway last (it routes only to healthy workers). `stop()`
sends SIGTERM to every child (gateway first), waits for them to drain and kills stragglers.
Each child's output goes to `<workdir>/<name>.log`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Literal

from cleave.cli.health import EXIT_SERVING, check

DEFAULT_CPU_KV_BLOCKS = 1024


@dataclass(frozen=True)
class StackSpec:
    """What to start."""

    model: Path
    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    num_prefill: int = 1
    num_decode: int = 1
    grpc_port: int = 50051  # 0: any free port
    http_port: int | None = 8000  # 0: any free port; None: no HTTP API
    device: str = "cpu"
    num_kv_blocks: int = 0  # 0: DEFAULT_CPU_KV_BLOCKS on CPU, from free memory on GPUs
    served_model_name: str = ""
    host: str = "127.0.0.1"
    log_level: str = "INFO"
    worker_args: tuple[str, ...] = ()  # extra flags for prefill and decode workers
    store_to_kvstore: bool = True  # prefill workers put new prompt blocks into the kvstore


@dataclass
class Child:
    """One started service process."""

    name: str
    process: subprocess.Popen
    port_file: Path
    log_path: Path
    log: IO[bytes]
    address: str = ""

    def log_tail(self, num_lines: int = 20) -> str:
        self.log.flush()
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-num_lines:])


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (for the gateway's HTTP listener)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass
class ProcessStack:
    """Starts and stops the stack described by a StackSpec.

    Args:
        spec: the stack.
        workdir: port files and logs go here.
    """

    spec: StackSpec
    workdir: Path
    children: list[Child] = field(default_factory=list)
    http_port: int | None = None

    @property
    def gateway(self) -> Child:
        return next(child for child in self.children if child.name == "gateway")

    @property
    def gateway_address(self) -> str:
        return self.gateway.address

    @property
    def http_url(self) -> str | None:
        return None if self.http_port is None else f"http://{self.spec.host}:{self.http_port}/v1"

    def _spawn(self, name: str, module: str, args: list[str]) -> Child:
        port_file = self.workdir / f"{name}.port"
        port_file.unlink(missing_ok=True)
        log_path = self.workdir / f"{name}.log"
        log = open(log_path, "wb")
        command = [sys.executable, "-m", module, "--port-file", str(port_file),
                   "--log-level", self.spec.log_level, "--no-log-json", *args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # own session: a terminal's Ctrl-C reaches only `cleave up`, which stops the children in order
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        child = Child(name, process, port_file, log_path, log)
        self.children.append(child)
        return child

    def _wait_healthy(self, children: list[Child], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pending = list(children)
        while pending:
            for child in list(pending):
                if child.process.poll() is not None:
                    raise RuntimeError(
                        f"{child.name} exited with code {child.process.returncode}; its log "
                        f"({child.log_path}) ends with:\n{child.log_tail()}"
                    )
                if not child.address and child.port_file.is_file():
                    text = child.port_file.read_text().strip()
                    if text:
                        child.address = f"{self.spec.host}:{int(text)}"
                if child.address and check(child.address, timeout_s=1.0)[0] == EXIT_SERVING:
                    pending.remove(child)
            if pending and time.monotonic() > deadline:
                names = ", ".join(child.name for child in pending)
                raise TimeoutError(f"{names} did not become healthy in {timeout_s:g} s; see logs in {self.workdir}")
            if pending:
                time.sleep(0.1)

    def _worker_args(self, worker_id: str, kvstore: str) -> list[str]:
        spec = self.spec
        blocks = spec.num_kv_blocks or (DEFAULT_CPU_KV_BLOCKS if spec.device == "cpu" else 0)
        args = ["--listen", f"{spec.host}:0", "--model", str(spec.model), "--worker-id", worker_id,
                "--device", spec.device, "--kvstore", kvstore, "--num-kv-blocks", str(blocks),
                "--kv-listen", f"{spec.host}:0", "--grace-seconds", "5"]
        if spec.served_model_name:
            args += ["--served-model-name", spec.served_model_name]
        if spec.device == "cpu":
            args.append("--enforce-eager")
        return args + list(spec.worker_args)

    def _gateway_args(self, workers: list[Child]) -> list[str]:
        spec = self.spec
        args = ["--listen", f"{spec.host}:{spec.grpc_port}", "--model", str(spec.model), "--mode", spec.mode,
                "--http-listen", f"{spec.host}:{self.http_port}" if self.http_port is not None else "",
                "--grace-seconds", "5", "--store-to-kvstore" if spec.store_to_kvstore else "--no-store-to-kvstore"]
        if spec.served_model_name:
            args += ["--served-model-name", spec.served_model_name]
        for worker in workers:
            args += ["--prefill" if worker.name.startswith("prefill") else "--decode", worker.address]
        return args

    def start(self, timeout_s: float = 120.0) -> None:
        """Start everything and return once the gateway is SERVING (stops all on failure)."""
        spec = self.spec
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            kvstore = self._spawn("kvstore", "services.kvstore", [
                "--listen", f"{spec.host}:0", "--ram-bytes", str(1024**3), "--grace-seconds", "2"])
            self._wait_healthy([kvstore], timeout_s)
            workers = []
            num_prefill = spec.num_prefill if spec.mode == "disaggregated" else 0
            for index in range(num_prefill):
                workers.append(self._spawn(f"prefill-{index}", "services.prefill",
                                           self._worker_args(f"prefill-{index}", kvstore.address)))
            for index in range(spec.num_decode):
                workers.append(self._spawn(f"decode-{index}", "services.decode",
                                           self._worker_args(f"decode-{index}", kvstore.address)))
            self._wait_healthy(workers, timeout_s)
            if spec.http_port is not None:
                self.http_port = spec.http_port or free_port(spec.host)
            gateway = self._spawn("gateway", "services.gateway", self._gateway_args(workers))
            self._wait_healthy([gateway], timeout_s)
        except BaseException:
            self.stop()
            raise

    def exited(self) -> list[Child]:
        """Children that are no longer running."""
        return [child for child in self.children if child.process.poll() is not None]

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM every child (gateway first, kvstore last), wait, SIGKILL stragglers."""
        for child in reversed(self.children):
            if child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in reversed(self.children):
            try:
                child.process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait()
            child.log.close()
