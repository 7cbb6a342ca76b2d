"""The kvstore process stores bytes: it imports neither torch nor the GPU-side packages, so it
starts in well under a second and its memory is the blocks it holds."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch", "triton", "transformers", "cleave.transfer")


def test_the_kvstore_process_imports_no_gpu_side_package():
    code = ("import sys, services.kvstore.__main__; "
            f"print(sorted(name for name in {HEAVY!r} if name in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "[]", result.stdout
