"""CachedLauncher's bookkeeping: what compiles, what reuses a launcher, what falls back.

The launcher only takes its cached path for CUDA tensors; here CPU tensors pose as CUDA ones
(a Tensor subclass with is_cuda True) and a recording stand-in plays the @triton.jit kernel,
so the keys and the calls can be checked without a GPU.
"""

from __future__ import annotations

import pytest
import torch

from cleave.kernels import dispatch
from cleave.kernels.dispatch import CachedLauncher


class CudaLike(torch.Tensor):
    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    def get_device(self) -> int:  # type: ignore[override]
        return 0


def cuda_like(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(*shape, dtype=dtype).as_subclass(CudaLike)


class Compiled:
    """A compiled kernel whose `run` has no known driver layout (so `_run_compiled` is used)."""

    def __init__(self, log: list) -> None:
        self.function, self.packed_metadata, self.log = object(), object(), log
        self.run = self._run

    def _run(self, grid_x, grid_y, grid_z, stream, function, metadata, launch_metadata, enter, exit_, *args):
        self.log.append(("cached", (grid_x, grid_y, grid_z), stream, args))


class Kernel:
    """Stands in for a @triton.jit kernel: `kernel[grid](*args, **options)` compiles and runs."""

    def __init__(self) -> None:
        self.log: list = []
        self.compiled: list[Compiled] = []

    def __getitem__(self, grid):
        def launch(*args, num_warps, **options):
            self.log.append(("triton", grid, args, num_warps, options))
            self.compiled.append(Compiled(self.log))
            return self.compiled[-1]
        return launch


@pytest.fixture
def kernel(monkeypatch):
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 7, raising=False)
    return Kernel()


def kinds(log: list) -> list[str]:
    return [entry[0] for entry in log]


def test_compiles_once_per_specialisation_and_reuses_it_for_other_values(kernel):
    launcher = CachedLauncher(kernel)
    x, out = cuda_like(4, 32), cuda_like(4, 32)
    launcher((4,), (x, out, 32, 1e-6), (True, 64), 4)  # compiles through triton
    launcher((4,), (x, out, 32, 1e-6), (True, 64), 4)  # same values: cached launcher
    launcher((2,), (x, out, 48, 1e-5), (True, 64), 4)  # other values, same specialisation
    launcher((2,), (x, out, 17, 1e-6), (True, 64), 4)  # 17 is not divisible by 16: compiles
    launcher((2,), (x, out, 1, 1e-6), (True, 64), 4)  # == 1 specialises: compiles
    launcher((2,), (x, out, 33, 1e-6), (True, 64), 4)  # same as 17
    assert kinds(kernel.log) == ["triton", "cached", "cached", "triton", "triton", "cached"]
    assert len(launcher._compiled) == 3
    _, grid, stream, args = kernel.log[2]
    assert grid == (2, 1, 1) and stream == 7
    assert args == (x.data_ptr(), out.data_ptr(), 48, 1e-5, True, 64)  # pointers as ints, then constexprs


def test_dtypes_constexprs_warps_and_options_are_part_of_the_key(kernel):
    launcher = CachedLauncher(kernel)
    x, out = cuda_like(4, 32), cuda_like(4, 32)
    launcher((4,), (x, out, 32), (True,), 4)
    launcher((4,), (x.to(torch.bfloat16).as_subclass(CudaLike), out, 32), (True,), 4)
    launcher((4,), (x, out, 32), (False,), 4)
    launcher((4,), (x, out, 32), (True,), 8)
    launcher((4,), (x, out, 32), (True,), 4, launch_pdl=True)
    launcher((4,), (x, out, 32), (True,), 4, launch_pdl=True)
    assert kinds(kernel.log) == ["triton"] * 5 + ["cached"]
    assert kernel.log[4][4] == {"launch_pdl": True}


def test_misaligned_pointers_take_tritons_own_path(kernel):
    launcher = CachedLauncher(kernel)
    x, out = cuda_like(64), cuda_like(64)
    launcher((1,), (x, out, 32), (True,), 4)
    launcher((1,), (x[1:], out, 32), (True,), 4)  # 4 bytes in: not 16-byte aligned
    launcher((1,), (x[1:], out, 32), (True,), 4)
    assert kinds(kernel.log) == ["triton", "triton", "triton"]


def test_raw_keys_are_bounded(kernel, monkeypatch):
    monkeypatch.setattr(CachedLauncher, "MAX_ENTRIES", 4)
    launcher = CachedLauncher(kernel)
    x, out = cuda_like(8), cuda_like(8)
    for rows in range(16, 16 * 10, 16):  # one specialisation, nine raw keys
        launcher((1,), (x, out, rows), (True,), 4)
    assert len(launcher._launches) <= 4
    assert kinds(kernel.log).count("triton") == 1


def test_cpu_tensors_always_take_tritons_path():
    calls = []

    class Plain:
        def __getitem__(self, grid):
            return lambda *args, num_warps, **options: calls.append(grid)

    launcher = CachedLauncher(Plain())
    launcher((3,), (torch.zeros(4), torch.zeros(4), 4), (True,), 4)
    launcher((3,), (torch.zeros(4), torch.zeros(4), 4), (True,), 4)
    assert calls == [(3,), (3,)]
    assert not dispatch.CachedLauncher(Plain())._launches


class Param:
    def __init__(self, do_not_specialize: bool) -> None:
        self.do_not_specialize = do_not_specialize


def test_unspecialised_scalars_share_one_compile_whatever_their_value(kernel):
    # x, out, rows (do_not_specialize), width: a count the kernel leaves unspecialised keys
    # nothing but its 64-bit range, so 17, 1 and 32 reuse the first compile; `width` still
    # specialises
    kernel.params = [Param(False), Param(False), Param(True), Param(False)]
    launcher = CachedLauncher(kernel)
    x, out = cuda_like(8), cuda_like(8)
    for rows in (17, 1, 32, 2**33):
        launcher((1,), (x, out, rows, 64), (True,), 4)
    launcher((1,), (x, out, 5, 3), (True,), 4)  # width 3 is not divisible by 16: compiles
    assert kinds(kernel.log) == ["triton", "cached", "cached", "triton", "triton"]
    assert len(launcher._compiled) == 3
