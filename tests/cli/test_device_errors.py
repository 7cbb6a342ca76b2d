"""A `--device` that cannot run here is one `error:` line and exit code 2, before anything loads
(not torch's AssertionError from deep in model loading, or a worker's log tail)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from cleave.cli._device import DeviceUnavailable, check_device

needs_cpu_only_torch = pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")


def _run(*argv: str, cwd) -> subprocess.CompletedProcess:  # type: ignore[no-untyped-def]
    return subprocess.run([sys.executable, "-m", "cleave.cli.main", *argv], capture_output=True, text=True,
                          timeout=120, cwd=cwd)


def _one_error_line(completed: subprocess.CompletedProcess) -> str:
    assert completed.returncode == 2, completed.stdout + completed.stderr
    assert "Traceback" not in completed.stderr, completed.stderr
    (line,) = completed.stderr.strip().splitlines()
    assert line.startswith("error: "), line
    return line


@needs_cpu_only_torch
def test_generate_on_cuda_without_cuda_is_one_line(tmp_path):
    line = _one_error_line(_run("generate", "--device", "cuda", "What is 1234 + 567?", cwd=tmp_path))
    assert line.startswith("error: --device cuda: ")
    assert "--device cpu" in line  # it says how to fix it


@needs_cpu_only_torch
def test_up_on_cuda_without_cuda_is_one_line_and_starts_nothing(tmp_path):
    completed = _run("up", "--device", "cuda", "--grpc-port", "0", "--http-port", "0", "--workdir", str(tmp_path),
                     cwd=tmp_path)
    line = _one_error_line(completed)
    assert line.startswith("error: --device cuda: ")
    assert not list(tmp_path.glob("*.log"))  # no service was started


def test_an_unknown_device_names_the_flag():
    with pytest.raises(DeviceUnavailable, match=r"^--device tpu9: not a torch device"):
        check_device("tpu9")


def test_cpu_is_always_usable():
    check_device("cpu")


@needs_cpu_only_torch
def test_a_cuda_index_on_cpu_only_torch_names_it():
    with pytest.raises(DeviceUnavailable, match=r"^--device cuda:1: .*without CUDA"):
        check_device("cuda:1")


def test_auto_is_cpu_without_a_driver_and_asks_torch_with_one(tmp_path, monkeypatch):
    import cleave.cli._device as device

    assert device.resolve_device("cuda:1") == "cuda:1" and device.resolve_device("cpu") == "cpu"  # given: as is
    monkeypatch.setattr(device, "NVIDIA_DRIVER", tmp_path / "absent")
    if sys.platform.startswith("linux"):
        assert device.resolve_device("auto") == "cpu"
    driver = tmp_path / "version"
    driver.write_text("NVRM version: 1.0\n")
    monkeypatch.setattr(device, "NVIDIA_DRIVER", driver)
    assert device.resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the driver check reads Linux's /proc")
def test_up_resolves_auto_without_importing_torch_on_a_host_without_the_driver(tmp_path):
    from cleave.cli._device import NVIDIA_DRIVER

    if NVIDIA_DRIVER.exists():
        pytest.skip("this host has the NVIDIA driver: auto asks torch")
    probe = ("import sys; from cleave.cli.main import build_parser; from cleave.cli.up import stack_spec; "
             "from pathlib import Path; args = build_parser().parse_args(['up']); "
             "print(stack_spec(args, Path('/models/tiny'), 'tiny').device, 'torch' in sys.modules)")
    completed = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert completed.stdout.split() == ["cpu", "False"], completed.stdout + completed.stderr
