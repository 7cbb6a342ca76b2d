"""The `--device` of a `cleave` command, checked before a model loads.

Without this check a CUDA device on a CPU-only torch fails deep inside model loading with
torch's `AssertionError: Torch not compiled with CUDA enabled` (under `cleave up`, as a
worker's log tail); the check turns it into one line naming the flag and the fix. A CPU
device needs no check, so `cleave up --device cpu` never imports torch in its own process;
nor does `--device auto` (`resolve_device`) on a host without an NVIDIA driver.
"""

from __future__ import annotations

import sys
from pathlib import Path

__all__ = ["DeviceUnavailable", "check_device", "resolve_device"]

NVIDIA_DRIVER = Path("/proc/driver/nvidia/version")  # Linux's NVIDIA kernel driver, when loaded


class DeviceUnavailable(ValueError):
    """The requested torch device cannot run here; the message is one line for the user."""


def check_device(device: str) -> None:
    """Raise DeviceUnavailable when `device` (`cpu`, `cuda`, `cuda:N`, ...) cannot be used."""
    if device == "cpu":
        return
    import torch

    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise DeviceUnavailable(f"--device {device}: not a torch device (use cpu, cuda or cuda:N)") from None
    if parsed.type != "cuda":
        return
    if torch.version.cuda is None and torch.version.hip is None:
        raise DeviceUnavailable(
            f"--device {device}: this torch ({torch.__version__}) was built without CUDA; "
            "install a CUDA build of torch or use --device cpu"
        )
    count = torch.cuda.device_count()
    if count == 0:
        raise DeviceUnavailable(f"--device {device}: no CUDA device is visible; check CUDA_VISIBLE_DEVICES "
                                "and the driver (nvidia-smi), or use --device cpu")
    if parsed.index is not None and parsed.index >= count:
        raise DeviceUnavailable(f"--device {device}: only {count} CUDA device(s) are visible (cuda:0..cuda:{count - 1})")


def resolve_device(device: str) -> str:
    """`device`, with `auto` made `cuda` where torch sees a CUDA device and `cpu` elsewhere
    (as `cleave generate` and the engine choose). On Linux a host without the NVIDIA driver
    is `cpu` at once, without importing torch."""
    if device != "auto":
        return device
    if sys.platform.startswith("linux") and not NVIDIA_DRIVER.exists():
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
