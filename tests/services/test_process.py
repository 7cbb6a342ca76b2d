"""`python -m services.X` starts, reports healthy via `cleave health`, drains on SIGTERM, exits 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cleave.cli.main import main as cleave_main

SERVICES = {
    "gateway": "cleave.v1.Gateway",
    "prefill": "cleave.v1.Prefill",
    "decode": "cleave.v1.Decode",
    "kvstore": "cleave.v1.KVStore",
}


# Only a guard against a hang: a service is waited for until it writes its port file or
# exits, however long its imports take on a loaded machine.
HANG_S = 600


def wait_for_port(port_file: Path, process: subprocess.Popen, log: Path) -> int:
    """The port a service wrote once it listens (it writes the file atomically)."""
    deadline = time.monotonic() + HANG_S
    while not port_file.exists():
        if process.poll() is not None:
            raise AssertionError(f"exited early with {process.returncode}: {log.read_text(errors='replace')[-4000:]}")
        assert time.monotonic() < deadline, f"no port file after {HANG_S} s: {log.read_text(errors='replace')[-4000:]}"
        time.sleep(0.05)
    return int(port_file.read_text())


def wait_serving(address: str) -> None:
    """Block until the server's overall health is SERVING (a Watch stream's event)."""
    with grpc.insecure_channel(address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=HANG_S)
        try:
            for response in watch:
                if response.status == health_pb2.HealthCheckResponse.SERVING:
                    return
        finally:
            watch.cancel()


@pytest.fixture(scope="module")
def processes(tmp_path_factory):
    """All four services as processes, started in parallel (imports dominate start-up)."""
    tmp = tmp_path_factory.mktemp("services")
    # The workers load the shipped (tiny) reasoner on the CPU.
    env = {**os.environ, "CLEAVE_LOG_JSON": "true", "CLEAVE_HTTP_LISTEN": "", "CLEAVE_DEVICE": "cpu",
           "CLEAVE_NUM_KV_BLOCKS": "64"}
    started: dict[str, tuple[subprocess.Popen, Path, Path]] = {}

    def start(name: str, *extra: str) -> None:
        port_file, log = tmp / f"{name}.port", tmp / f"{name}.log"
        command = [sys.executable, "-m", f"services.{name}", "--listen", "127.0.0.1:0",
                   "--port-file", str(port_file), "--grace-seconds", "5", *extra]
        with open(log, "wb") as out:  # a file, not a pipe: a full pipe would block the service
            started[name] = (subprocess.Popen(command, env=env, stderr=out), port_file, log)

    try:  # whatever fails in setup, nothing started outlives the fixture
        for name in ("prefill", "decode", "kvstore"):
            start(name)
        ports = {name: wait_for_port(port_file, process, log) for name, (process, port_file, log) in started.items()}
        # The gateway needs a worker to route to: the decode worker, as a colocated one.
        start("gateway", "--mode", "colocated", "--decode", f"127.0.0.1:{ports['decode']}")
        ports["gateway"] = wait_for_port(started["gateway"][1], started["gateway"][0], started["gateway"][2])
        yield {name: (started[name][0], ports[name], started[name][2]) for name in SERVICES}
    finally:
        for process, _, _ in started.values():
            if process.poll() is None:
                process.kill()
            process.wait()


@pytest.mark.parametrize("name", list(SERVICES))
def test_service_process_is_healthy_and_drains_on_sigterm(processes, name, capsys):
    process, port, log = processes[name]
    address = f"127.0.0.1:{port}"
    wait_serving(address)
    assert cleave_main(["health", address, "--service", SERVICES[name]]) == 0
    assert f"{address} {SERVICES[name]}: SERVING" in capsys.readouterr().out

    with grpc.insecure_channel(address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=""), timeout=10
        )
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        process.send_signal(signal.SIGTERM)
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        watch.cancel()
    assert process.wait(timeout=HANG_S) == 0
    logs = log.read_text()
    assert '"signal": "SIGTERM"' in logs and '"event": "stopped"' in logs
    assert cleave_main(["health", address, "--timeout", "0.5"]) == 2


def test_health_cli_reports_not_serving_for_unknown_address(capsys):
    assert cleave_main(["health", "127.0.0.1:1", "--timeout", "0.5"]) == 2
    assert "UNAVAILABLE" in capsys.readouterr().out
