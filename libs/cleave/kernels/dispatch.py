"""How a kernel op picks its implementation.

Every op's public function takes `impl: Impl = "auto"`: "auto" runs the Triton kernel when
the inputs live on a CUDA device and the torch reference otherwise; "triton" and "torch"
force one side. CPU tests force "triton" under TRITON_INTERPRET=1 (set by tests/conftest.py
before triton is imported, since `triton.jit` reads it at decoration time).

It also holds what the ops share about launching: launch shapes for row-wise and elementwise
kernels, and `CachedLauncher`, which keeps per-call host overhead low on CUDA.
"""

from __future__ import annotations

import functools
import inspect
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import triton

Impl = Literal["auto", "triton", "torch"]


def use_triton(tensor: torch.Tensor, impl: Impl = "auto") -> bool:
    """Whether an op called on `tensor` with `impl` should run its Triton kernel."""
    if impl == "triton":
        return True
    if impl == "torch":
        return False
    if impl != "auto":
        raise ValueError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")
    return tensor.is_cuda


def outside_compiled_graphs(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, which `torch.compile` calls eagerly between its graphs (as `torch.compiler.disable`
    does); torch._dynamo is imported only when a compile traces a call, not when the module
    defining `fn` is imported (1.4 s of a worker's start)."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return torch.compiler.disable(fn)(*args, **kwargs)
        return fn(*args, **kwargs)

    return call


MAX_ROW_BLOCK = 65536  # widest row a row-wise kernel holds in registers at once


@dataclass(frozen=True)
class RowLaunch:
    """Launch shape of a row-wise kernel: `rows` rows of `block` columns per program."""

    grid: tuple[int]
    rows: int
    block: int
    num_warps: int


@functools.lru_cache(maxsize=4096)
def row_launch(num_rows: int, hidden: int) -> RowLaunch:
    """Pick rows per program, block width and warps for a row reduction over `hidden`.

    The whole row sits in registers (one HBM read); narrow rows are packed several to a
    program so each program still moves a few KiB.
    """
    block = triton.next_power_of_2(hidden)
    if block > MAX_ROW_BLOCK:
        raise ValueError(f"hidden size {hidden} exceeds the widest supported row ({MAX_ROW_BLOCK})")
    rows = max(1, min(16, 2048 // block, triton.next_power_of_2(num_rows)))
    elements = rows * block
    if elements >= 32768:
        num_warps = 32
    elif elements >= 8192:
        num_warps = 16
    elif elements >= 2048:
        num_warps = 8
    else:
        num_warps = 4
    return RowLaunch(grid=(triton.cdiv(num_rows, rows),), rows=rows, block=block, num_warps=num_warps)


def as_rows(x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., H] and the residual stream [..., H] as [T, H] row views for a row-wise kernel
    (x copied only if its rows are strided; the residual, updated in place, must not be).
    Without a residual the second view is x itself."""
    hidden = x.shape[-1]
    rows = x if x.dim() == 2 else x.reshape(-1, hidden)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if residual is None:
        return rows, rows
    res_rows = residual if residual.dim() == 2 else residual.view(-1, hidden)
    if res_rows.stride(-1) != 1:
        raise ValueError("residual must be contiguous in its last dimension (it is updated in place)")
    return rows, res_rows


@dataclass(frozen=True)
class TileLaunch:
    """Launch shape of an elementwise kernel over [rows, width]: one row x `block` columns."""

    grid: tuple[int, int]
    block: int
    num_warps: int


@functools.lru_cache(maxsize=4096)
def tile_launch(num_rows: int, width: int) -> TileLaunch:
    """Pick the column block and warps for an elementwise op over a [num_rows, width] grid.

    Rows go on grid axis 0 (no 65535 limit); 16-byte vectors per thread for 16-bit dtypes.
    Many wide rows take 4096-column blocks of 16 warps: SiLU-and-mul at 16384 x 4096 outputs
    94.0 us vs 96.0 us with 2048 columns of 8 warps, as fast as torch.compile (H200,
    bench/results/kernels/launch_sweep_silu_and_mul*.md).
    """
    block = min(triton.next_power_of_2(width), 4096 if num_rows >= 1024 else 1024)
    num_warps = max(1, min(16, block // 256))
    return TileLaunch(grid=(num_rows, triton.cdiv(width, block)), block=block, num_warps=num_warps)


def _scalar_key(arg: Any, specialised: bool = True) -> Any:
    # what triton specialises a scalar argument on: ==1, divisibility by 16 and 64-bit range
    # of an int (only the range where the kernel says `do_not_specialize`); the value of a
    # bool; nothing for a float
    if isinstance(arg, bool):
        return arg
    if isinstance(arg, int):
        return (arg == 1, arg % 16 == 0, arg > 0x7FFFFFFF) if specialised else arg > 0x7FFFFFFF
    return None


def unspecialised_params(kernel: Any) -> frozenset[int]:
    """Positions of a jit kernel's parameters marked `do_not_specialize` (none where the
    kernel object does not say: the interpreter's, or another triton's layout)."""
    params = getattr(kernel, "params", None) or ()
    return frozenset(i for i, param in enumerate(params) if getattr(param, "do_not_specialize", False))


def _direct_launch(compiled: Any) -> Callable[..., None] | None:
    """`launch(grid_x, grid_y, grid_z, stream, args)` straight into a compiled kernel's
    driver-level launcher, or None where its layout is not the one known here.

    `compiled.run` (triton's `CudaLauncher`) wraps the C launcher in Python that allocates
    scratch buffers and passes profiler hooks on every call; kernels that need no scratch
    memory can skip it. Known layout (triton 3.6, checked on the H200): `__call__(gridX,
    gridY, gridZ, stream, function, *args)` forwarding to `launch(gridX, gridY, gridZ,
    stream, function, cooperative, pdl, global_scratch, profile_scratch, metadata,
    launch_metadata, enter_hook, exit_hook, *kernel_args)`.
    """
    run = compiled.run
    launch = getattr(run, "launch", None)
    if launch is None or any(getattr(run, name, None) != 0 for name in ("global_scratch_size", "profile_scratch_size")):
        return None
    try:
        parameters = list(inspect.signature(type(run).__call__).parameters.values())
    except (TypeError, ValueError):
        return None
    names = [parameter.name for parameter in parameters]
    if names[:6] != ["self", "gridX", "gridY", "gridZ", "stream", "function"] or len(parameters) != 7 \
            or parameters[6].kind is not inspect.Parameter.VAR_POSITIONAL or hasattr(run, "arg_annotations"):
        return None
    function, metadata = compiled.function, compiled.packed_metadata
    cooperative, pdl = run.launch_cooperative_grid, run.launch_pdl

    def direct(grid_x: int, grid_y: int, grid_z: int, stream: int, args: list) -> None:
        launch(grid_x, grid_y, grid_z, stream, function, cooperative, pdl, None, None, metadata, None, None, None, *args)

    return direct


class CachedLauncher:
    """Launches one @triton.jit kernel, reusing its compiled form without triton's binder.

    `kernel[grid](...)` re-derives the specialisation of every argument on every call (about
    10 us of Python on the serving hosts, more than the kernels themselves at decode sizes).
    This keeps the driver-level launchers (`_direct_launch`; `compiled.run` where its layout
    is not the known one) in a dict keyed by the call's device, warps, constexprs, tensor
    dtypes, launch options and raw scalar values, and calls them with the tensors' device
    pointers as integers (the launcher then makes no Python call and no driver query per
    tensor). Keying on the raw scalars costs one tuple per call instead of working out
    triton's specialisation of each (==1, divisible by 16, 64-bit); a new set of values
    works that out once and shares the compiled kernel with every set that specialises the
    same way. The first call of each specialisation compiles through triton, and so does
    any call with a pointer that is not 16-byte aligned.

    Kernels take their tensor arguments first, then scalars, then constexprs. Launch hooks
    (profilers) are not invoked on the cached path. CPU tensors (TRITON_INTERPRET=1) always
    take triton's own path.
    """

    MAX_ENTRIES = 4096  # raw-scalar keys kept (prefill token counts vary call to call)

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self._launches: dict[tuple, Callable[..., None]] = {}  # raw scalars -> launcher
        self._compiled: dict[tuple, Callable[..., None]] = {}  # triton's specialisation -> launcher
        self._num_tensors: int | None = None  # leading tensor arguments (fixed per kernel)
        self._unspecialised = unspecialised_params(kernel)

    def __call__(self, grid: tuple[int, ...], args: tuple, constexprs: tuple, num_warps: int, **options: Any) -> None:
        first = args[0]
        if not first.is_cuda:
            self.kernel[grid](*args, *constexprs, num_warps=num_warps, **options)
            return
        num_tensors = self._num_tensors
        if num_tensors is None:
            num_tensors = self._num_tensors = next(
                (i for i, arg in enumerate(args) if not isinstance(arg, torch.Tensor)), len(args))
        tensors = args[:num_tensors]
        pointers = [tensor.data_ptr() for tensor in tensors]
        if functools.reduce(operator.or_, pointers) & 15:  # triton's own path specialises on it
            self.kernel[grid](*args, *constexprs, num_warps=num_warps, **options)
            return
        scalars = args[num_tensors:]
        device = first.get_device()
        key = (device, num_warps, constexprs, scalars, *[tensor.dtype for tensor in tensors])
        if options:
            key += tuple(options.items())
        launch = self._launches.get(key)
        if launch is None:
            launch = self._specialised(key, grid, args, constexprs, num_warps, options)
            if launch is None:
                return  # launched while compiling
        launch(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
               torch._C._cuda_getCurrentRawStream(device), [*pointers, *scalars, *constexprs])

    def _specialised(
        self, key: tuple, grid: tuple[int, ...], args: tuple, constexprs: tuple, num_warps: int, options: dict
    ) -> Callable[..., None] | None:
        """The launcher for a new raw-scalar key: the one of its specialisation if compiled,
        else None after compiling (and launching) through triton."""
        first_scalar, unspecialised = len(args) - len(key[3]), self._unspecialised
        scalars = (_scalar_key(arg, first_scalar + i not in unspecialised) for i, arg in enumerate(key[3]))
        spec = (*key[:3], *scalars, *key[4:])
        launch = self._compiled.get(spec)
        launched = launch is None
        if launched:
            compiled = self.kernel[grid](*args, *constexprs, num_warps=num_warps, **options)
            launch = self._compiled[spec] = _direct_launch(compiled) or functools.partial(_run_compiled, compiled)
        if len(self._launches) >= self.MAX_ENTRIES:
            self._launches.clear()
        self._launches[key] = launch
        return None if launched else launch


def _run_compiled(compiled: Any, grid_x: int, grid_y: int, grid_z: int, stream: int, args: list) -> None:
    """Launch through the compiled kernel's own launcher (any triton layout)."""
    compiled.run(grid_x, grid_y, grid_z, stream, compiled.function, compiled.packed_metadata,
                 None, None, None, *args)
