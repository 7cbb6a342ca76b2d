"""The decode-step and attention kernels compile for Hopper (sm_90) on a CPU-only machine.

The interpreter runs a kernel's Python, not its compilation, so a kernel that fails to
lower (a loop-carried value changing type, an unsupported op) would otherwise only show on
the GPU. Triton's NVIDIA backend (with its bundled ptxas) compiles without a device, with the
alignment a real launch specialises on, and each variant must fit in shared memory and spill
no registers.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("hopper_compile.py")


def _nvidia_backend_available() -> bool:
    spec = importlib.util.find_spec("triton.backends.nvidia")
    if spec is None or spec.origin is None:
        return False
    return (Path(spec.origin).parent / "bin" / "ptxas").exists()


@pytest.mark.skipif(not _nvidia_backend_available(), reason="triton's NVIDIA backend (ptxas) is not installed")
def test_decode_kernels_compile_for_sm90():
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    result = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("compiled") == 67
