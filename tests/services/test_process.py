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


def wait_for_port(port_file: Path, process: subprocess.Popen, timeout_s: float = 30) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if port_file.exists():
            return int(port_file.read_text())
        if process.poll() is not None:
            raise AssertionError(f"exited early: {process.stderr.read().decode()}")
        time.sleep(0.05)
    raise AssertionError("the service never wrote its port file")


@pytest.fixture(scope="module")
def processes(tmp_path_factory):
    """All four services as processes, started in parallel (imports dominate start-up)."""
    tmp = tmp_path_factory.mktemp("services")
    # The workers load the shipped (tiny) reasoner on the CPU.
    env = {**os.environ, "CLEAVE_LOG_JSON": "true", "CLEAVE_HTTP_LISTEN": "", "CLEAVE_DEVICE": "cpu",
           "CLEAVE_NUM_KV_BLOCKS": "64"}
    started = {}

    def start(name: str, *extra: str) -> None:
        port_file = tmp / f"{name}.port"
        command = [sys.executable, "-m", f"services.{name}", "--listen", "127.0.0.1:0",
                   "--port-file", str(port_file), "--grace-seconds", "5", *extra]
        started[name] = (subprocess.Popen(command, env=env, stderr=subprocess.PIPE), port_file)

    for name in ("prefill", "decode", "kvstore"):
        start(name)
    ports = {name: wait_for_port(port_file, process) for name, (process, port_file) in started.items()}
    # The gateway needs a worker to route to: the decode worker, as a colocated one.
    start("gateway", "--mode", "colocated", "--decode", f"127.0.0.1:{ports['decode']}")
    ports["gateway"] = wait_for_port(started["gateway"][1], started["gateway"][0])
    yield {name: (started[name][0], ports[name]) for name in SERVICES}
    for process, _ in started.values():
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.parametrize("name", list(SERVICES))
def test_service_process_is_healthy_and_drains_on_sigterm(processes, name, capsys):
    process, port = processes[name]
    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 10
    while cleave_main(["health", address, "--service", SERVICES[name]]) != 0:
        assert time.monotonic() < deadline, "never became SERVING"
        time.sleep(0.1)
    assert f"{address} {SERVICES[name]}: SERVING" in capsys.readouterr().out

    with grpc.insecure_channel(address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=""), timeout=10
        )
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        process.send_signal(signal.SIGTERM)
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        watch.cancel()
    assert process.wait(timeout=10) == 0
    logs = process.stderr.read().decode()
    assert '"signal": "SIGTERM"' in logs and '"event": "stopped"' in logs
    assert cleave_main(["health", address, "--timeout", "0.5"]) == 2


def test_health_cli_reports_not_serving_for_unknown_address(capsys):
    assert cleave_main(["health", "127.0.0.1:1", "--timeout", "0.5"]) == 2
    assert "UNAVAILABLE" in capsys.readouterr().out
