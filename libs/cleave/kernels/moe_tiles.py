"""Tile sizes of the fused MoE layer's grouped GEMMs (`cleave.kernels.fused_moe`).

Both GEMMs share BLOCK_M (the entries are aligned to it once); each has its own BLOCK_N,
BLOCK_K, warps and pipeline stages. Two sources:

- Tuned tables: a JSON file in `cleave/kernels/moe_tuned/` named for the experts' shape, the
  activation dtype and the device (`tuned_file_name`), written on that device by
  `bench/moe_tune.py`. It maps token counts to launches; a batch takes the entry whose token
  count is nearest its own (vLLM's tuned fused-MoE configs are looked up the same way).
- The built-in rule (`default_launch`) for every shape and device without a table: BLOCK_M
  follows the entries per expert, so a decode batch spread over many experts pads each
  group to 16 rows, not 64 (prefill).
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton

TUNED_DIR = Path(__file__).resolve().parent / "moe_tuned"
SHARED_MEMORY_BYTES = 227 * 1024  # per program on Hopper; `fits` keeps candidates under it


@dataclass(frozen=True)
class GemmTiles:
    """One grouped GEMM's tiles: BLOCK_N output features (per half when gated), BLOCK_K."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")
        if not 1 <= self.num_stages <= 8:
            raise ValueError(f"num_stages must be in 1..8, got {self.num_stages}")


@dataclass(frozen=True)
class MoELaunch:
    """The grouped GEMMs' launch: the alignment's BLOCK_M and each GEMM's tiles."""

    block_m: int
    gate_up: GemmTiles
    down: GemmTiles

    def __post_init__(self) -> None:
        if self.block_m < 16 or self.block_m & (self.block_m - 1):
            raise ValueError(f"block_m must be a power of two >= 16, got {self.block_m}")

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> MoELaunch:
        return cls(int(data["block_m"]), GemmTiles(**data["gate_up"]), GemmTiles(**data["down"]))


def fits(block_m: int, tiles: GemmTiles, gated: bool, element_bytes: int = 2) -> bool:
    """Whether a GEMM's pipelined A and B tiles fit in shared memory and its fp32
    accumulators in at most 128 registers a thread."""
    halves = 2 if gated else 1
    per_stage = (block_m * tiles.block_k + halves * tiles.block_k * tiles.block_n) * element_bytes
    accumulators = halves * block_m * tiles.block_n // (32 * tiles.num_warps)
    return per_stage * tiles.num_stages <= SHARED_MEMORY_BYTES and accumulators <= 128


def default_launch(num_entries: int, num_experts: int, inter: int, hidden: int) -> MoELaunch:
    """The built-in rule: BLOCK_M from the entries per expert, N and K tiles up to 64."""
    per_expert = num_entries / num_experts
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64
    warps = 4 if block_m <= 16 else 8

    def tiles(out_features: int, in_features: int) -> GemmTiles:
        return GemmTiles(max(16, min(64, triton.next_power_of_2(out_features))),
                         max(16, min(64, triton.next_power_of_2(in_features))), warps)

    return MoELaunch(block_m, tiles(inter, hidden), tiles(hidden, inter))


def tuned_file_name(num_experts: int, inter: int, hidden: int, dtype: torch.dtype, device_name: str,
                    mxfp4: bool = False) -> str:
    """`E=128,I=768,H=2048,dtype=bfloat16,device=NVIDIA_H200.json`: one table per expert shape,
    activation dtype and device (`,weights=mxfp4` before `.json` for MXFP4 experts)."""
    dtype_name = str(dtype).removeprefix("torch.")
    weights = ",weights=mxfp4" if mxfp4 else ""
    return f"E={num_experts},I={inter},H={hidden},dtype={dtype_name},device={device_name.replace(' ', '_')}{weights}.json"


@functools.lru_cache(maxsize=None)
def load_table(path: Path) -> dict[int, MoELaunch] | None:
    """A tuned table (token count -> launch), or None where there is no such file. A file
    that does not parse is an error naming it: a tuned table is never silently ignored."""
    if not path.is_file():
        return None
    try:
        launches = json.loads(path.read_text())["launches"]
        table = {int(tokens): MoELaunch.from_json(launch) for tokens, launch in launches.items()}
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"tuned MoE table {path} is malformed: {type(error).__name__}: {error}") from error
    if not table:
        raise ValueError(f"tuned MoE table {path} has no launches")
    return table


@functools.lru_cache(maxsize=None)
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def moe_launch(
    num_tokens: int,
    top_k: int,
    num_experts: int,
    inter: int,
    hidden: int,
    activations: torch.Tensor,  # the layer's input: its device and dtype pick the table
    tuned_dir: Path = TUNED_DIR,
    mxfp4: bool = False,  # the experts are MXFP4 (`cleave.kernels.mxfp4`): their own table
) -> MoELaunch:
    """The launch for `num_tokens` tokens: the tuned table's nearest entry on a CUDA device
    that has one, else `default_launch`."""
    if activations.is_cuda:
        name = tuned_file_name(num_experts, inter, hidden, activations.dtype, _device_name(activations.get_device()),
                               mxfp4)
        table = load_table(tuned_dir / name)
        if table:
            return nearest_launch(table, num_tokens)
    return default_launch(num_tokens * top_k, num_experts, inter, hidden)


def nearest_launch(table: dict[int, MoELaunch], num_tokens: int) -> MoELaunch:
    """The table's launch for the token count nearest `num_tokens` (the smaller on a tie)."""
    return table[min(table, key=lambda tokens: (abs(tokens - num_tokens), tokens))]
