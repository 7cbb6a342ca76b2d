"""Load an HF safetensors checkpoint into `CausalLM`.

The model is built on the meta device and materialised once in the target dtype/device, then
every checkpoint tensor is read straight onto that device and copied into its parameter (or
its rows of a fused `qkv_proj` / `gate_up_proj`), so peak memory is the model plus one tensor.
Every parameter row must be written exactly once: missing, unexpected and misshapen tensors
fail with the file and tensor named.

With a `TensorParallelGroup` each rank builds a `TensorParallelCausalLM` of its shard's shapes
and reads only its slice of every split tensor (`TensorParallelLayout.shard_of`) through
safetensors' lazy slices, so no rank holds the whole model at any point. In an MoE model a
rank reads only its own experts: Qwen3-MoE's tensors of other experts are skipped unread,
gpt-oss's stacked ones sliced along their expert dimension.

MoE experts are stacked per layer (`cleave.model.moe`): Qwen3-MoE's per-expert gate/up/down
tensors fill one expert's rows each; gpt-oss's stacked `gate_up_proj` [E, H, 2I] (gate and
up interleaved column by column) and `down_proj` [E, I, H] are de-interleaved and
transposed. gpt-oss's MXFP4 experts (`*_blocks` + `*_scales`) are dequantised as they load
(`cleave.kernels.mxfp4`), or kept packed with `packed_experts` (their rows rearranged alike).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from cleave.kernels.dispatch import Impl
from cleave.kernels.mxfp4 import dequantize_mxfp4
from cleave.model.config import ModelConfig
from cleave.model.llama import CausalLM
from cleave.parallel.group import TensorParallelGroup
from cleave.parallel.model import TensorParallelCausalLM
from cleave.parallel.sharding import TensorShard

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Tensors some checkpoints carry that the model recomputes instead of loading.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model: names the file and tensor at fault."""


@dataclass(frozen=True)
class _Target:
    """Where one HF tensor goes: a parameter, for stacked experts one expert's slice, for
    fused weights its row range; `layout` says how the HF tensor is rearranged first
    ("transposed": last two dims swapped; "interleaved": gate/up alternate along the last
    dim, de-interleaved to [gate | up]; "interleaved_transposed": both; "packed": MXFP4
    blocks or scales [E, rows, ...] flattened to [E, rows, -1]; "packed_interleaved": that,
    with gate/up rows de-interleaved)."""

    param_name: str
    row_start: int | None = None
    row_end: int | None = None
    expert: int | None = None
    layout: str | None = None

    @property
    def key(self) -> tuple[str, int | None, int | None]:
        return (self.param_name, self.expert, self.row_start)


def _fused_targets(config: ModelConfig) -> dict[str, tuple[str, int, int]]:
    """HF projection name -> (fused projection name, first row, end row)."""
    q, kv, inter = config.q_size, config.kv_size, config.intermediate_size
    return {
        "self_attn.q_proj": ("self_attn.qkv_proj", 0, q),
        "self_attn.k_proj": ("self_attn.qkv_proj", q, q + kv),
        "self_attn.v_proj": ("self_attn.qkv_proj", q + kv, q + 2 * kv),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0, inter),
        "mlp.up_proj": ("mlp.gate_up_proj", inter, 2 * inter),
    }


# gpt-oss's stacked expert tensors: HF name suffix -> (parameter, layout)
_GPT_OSS_EXPERTS = {
    "gate_up_proj": ("w13", "interleaved_transposed"),
    "gate_up_proj_bias": ("w13_bias", "interleaved"),
    "down_proj": ("w2", "transposed"),
    "down_proj_bias": ("w2_bias", None),
}
# the same experts kept MXFP4 (`ModelConfig.packed_experts`): blocks [E, out, G, 16], scales [E, out, G]
_GPT_OSS_PACKED_EXPERTS = {
    "gate_up_proj_blocks": ("w13_blocks", "packed_interleaved"),
    "gate_up_proj_scales": ("w13_scales", "packed_interleaved"),
    "down_proj_blocks": ("w2_blocks", "packed"),
    "down_proj_scales": ("w2_scales", "packed"),
}
_GPT_OSS_EXPERT_TENSORS = {**_GPT_OSS_EXPERTS, **_GPT_OSS_PACKED_EXPERTS}


def map_hf_name(hf_name: str, config: ModelConfig) -> _Target:
    """Where an HF tensor name goes in `CausalLM` (the parameter may not exist)."""
    name = hf_name.removeprefix("model.")
    match = re.fullmatch(r"(layers\.\d+)\.(self_attn\.[qkv]_proj|mlp\.(?:gate|up)_proj)\.(weight|bias)", name)
    if match:
        layer, projection, kind = match.groups()
        fused, start, end = _fused_targets(config)[projection]
        return _Target(f"{layer}.{fused}.{kind}", start, end)
    match = re.fullmatch(r"(layers\.\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight", name)
    if match:  # Qwen3-MoE, one expert's projection
        layer, expert, projection = match.groups()
        inter = config.moe_intermediate_size
        if projection == "down":
            return _Target(f"{layer}.mlp.experts.w2", expert=int(expert))
        start = 0 if projection == "gate" else inter
        return _Target(f"{layer}.mlp.experts.w13", start, start + inter, expert=int(expert))
    match = re.fullmatch(r"(layers\.\d+)\.mlp\.experts\.((?:gate_up|down)_proj(?:_bias|_blocks|_scales)?)", name)
    if match:
        layer, tensor = match.groups()
        if config.architecture == "GptOssForCausalLM":
            param, layout = _GPT_OSS_EXPERT_TENSORS[tensor]
            return _Target(f"{layer}.mlp.experts.{param}", layout=layout)
        # stacked like the model's (transformers' in-memory Qwen3-MoE layout)
        return _Target(f"{layer}.mlp.experts.{'w13' if tensor == 'gate_up_proj' else 'w2'}")
    match = re.fullmatch(r"(layers\.\d+)\.mlp\.gate\.weight", name)
    if match and config.is_moe:  # Qwen3-MoE's router
        return _Target(f"{match.group(1)}.mlp.router.weight")
    return _Target(name)


def _hf_name(param_name: str, config: ModelConfig) -> str:
    """The HF tensor that fills a whole (unsplit) parameter, for error messages."""
    if param_name == "lm_head.weight":
        return param_name
    match = re.fullmatch(r"(layers\.\d+)\.mlp\.(router|experts)\.(\w+)", param_name)
    if match:
        layer, part, leaf = match.groups()
        if part == "router":
            router = "router" if config.architecture == "GptOssForCausalLM" else "gate"
            return f"model.{layer}.mlp.{router}.{leaf}"
        hf_leaf = {param: suffix for suffix, (param, _) in _GPT_OSS_EXPERT_TENSORS.items()}[leaf]
        return f"model.{layer}.mlp.experts.{hf_leaf}"
    return f"model.{param_name}"


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors shards of a checkpoint directory (one file, or those in the index)."""
    index = path / INDEX_FILE
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        files = [path / name for name in sorted(set(weight_map.values()))]
    elif (path / SINGLE_FILE).is_file():
        files = [path / SINGLE_FILE]
    else:
        raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path}")
    for file in files:
        if not file.is_file():
            raise FileNotFoundError(f"checkpoint shard {file} named in {index} does not exist")
    return files


def empty_model(
    config: ModelConfig,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    impl: Impl = "auto",
    pdl: bool = True,
    tensor_parallel: TensorParallelGroup | None = None,
) -> CausalLM:
    """A `CausalLM` with uninitialised weights allocated once, in `dtype` on `device`; with
    `tensor_parallel`, this rank's `TensorParallelCausalLM` (only its shard is allocated)."""
    with torch.device("meta"):
        if tensor_parallel is None:
            model = CausalLM(config, impl=impl, pdl=pdl)
        else:
            model = TensorParallelCausalLM(config, tensor_parallel, impl=impl, pdl=pdl)
    model.to(dtype=dtype or config.dtype)
    return model.to_empty(device=device)


class HFWeightFiller:
    """Copies HF-named tensors into a `CausalLM`, checking that each slice is written once.

    `fill(name, tensor, source)` places one tensor (`source` names its file in errors);
    `finish(what)` raises if any parameter slice was never written. An MXFP4 pair
    (`X_blocks`, `X_scales`) is held until both halves have arrived, then dequantised into X;
    with `ModelConfig.packed_experts` each half fills its own uint8 parameter as it is.
    """

    def __init__(self, model: CausalLM) -> None:
        self.config = model.config
        self.params = dict(model.named_parameters())  # a tied lm_head appears once, as embed_tokens
        # a tensor-parallel rank's experts are a contiguous run of the model's, from first_expert
        self.layout = model.layout if isinstance(model, TensorParallelCausalLM) else None
        self.first_expert = self.layout.first_expert if self.layout is not None else 0
        self.pending = _expected_rows(model, self.config, self.first_expert)
        self.quantized_halves: dict[str, torch.Tensor] = {}  # "X_blocks" / "X_scales" awaiting the other

    def wants(self, hf_name: str) -> bool:
        """False for tensors the model recomputes or ignores (rotary tables, a tied head,
        another tensor-parallel rank's experts)."""
        if _IGNORED.fullmatch(hf_name) or (self.layout is not None and not self.layout.holds(hf_name)):
            return False
        # HF ties the head to the embeddings even when a copy is stored
        return not (self.config.tie_word_embeddings and map_hf_name(hf_name, self.config).param_name == "lm_head.weight")

    def fill(self, hf_name: str, tensor: torch.Tensor, source: str) -> None:
        packed = self.config.packed_experts  # then each half fills its own parameter below
        if hf_name.endswith(("_blocks", "_scales")) and self.config.quantization == "mxfp4" and not packed:
            base, half = hf_name.rsplit("_", 1)
            other = f"{base}_{'scales' if half == 'blocks' else 'blocks'}"
            if other not in self.quantized_halves:
                self.quantized_halves[hf_name] = tensor
                return
            pair = {half: tensor, other.rsplit("_", 1)[1]: self.quantized_halves.pop(other)}
            param = self.params.get(map_hf_name(base, self.config).param_name)
            dtype = param.dtype if param is not None else torch.bfloat16
            # [E, out, in] as stored; HF's stacked gpt-oss tensors are [E, in, out]
            tensor = dequantize_mxfp4(pair["blocks"], pair["scales"], dtype).transpose(-1, -2)
            hf_name = base
        target = map_hf_name(hf_name, self.config)
        if target.param_name not in self.params:
            raise CheckpointError(f"{source}: unexpected tensor {hf_name!r} for {self.config.architecture}")
        if target.key not in self.pending:
            raise CheckpointError(f"{source}: tensor {hf_name!r} appears more than once")
        _copy_tensor(tensor, self.params[target.param_name], target, hf_name, source, self.first_expert)
        self.pending.pop(target.key)

    def finish(self, what: str) -> None:
        if self.quantized_halves:
            raise CheckpointError(
                f"{what} has MXFP4 tensors without their other half: {', '.join(sorted(self.quantized_halves))}"
            )
        if self.pending:
            missing = sorted(self.pending.values())
            raise CheckpointError(
                f"{what} lacks {len(missing)} tensor(s) the model needs: {', '.join(missing[:8])}"
                + (" ..." if len(missing) > 8 else "")
            )


def load_model(
    path: str | Path,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    impl: Impl = "auto",
    pdl: bool = True,
    tensor_parallel: TensorParallelGroup | None = None,
    packed_experts: bool = False,
) -> CausalLM:
    """Load `path` (an HF checkpoint directory) into a `CausalLM` in eval mode.

    dtype defaults to the config's; `impl` and `pdl` are the model's kernel options (`CausalLM`).
    With `tensor_parallel` (every rank calls this with its group) the result is this rank's
    `TensorParallelCausalLM`, filled from its slices of the checkpoint. `packed_experts`
    keeps a checkpoint's MXFP4 experts packed in memory (`ModelConfig.packed_experts`);
    other checkpoints load as without it. Raises FileNotFoundError for missing files and
    CheckpointError for missing, unexpected or misshapen tensors.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    config = ModelConfig.from_pretrained(path)
    if packed_experts and config.quantization == "mxfp4":
        config = replace(config, packed_experts=True)
    files = checkpoint_files(path)
    model = empty_model(config, dtype, device, impl, pdl, tensor_parallel)
    parallel_layout = model.layout if isinstance(model, TensorParallelCausalLM) else None
    filler = HFWeightFiller(model)
    for file in files:
        with safe_open(str(file), framework="pt", device=str(device)) as shard:
            for hf_name in shard.keys():
                if not filler.wants(hf_name):
                    continue
                part = parallel_layout.shard_of(hf_name) if parallel_layout is not None else None
                tensor = shard.get_tensor(hf_name) if part is None else _read_shard(shard, hf_name, part, file.name)
                filler.fill(hf_name, tensor, file.name)
    filler.finish(f"checkpoint {path}")
    return model.eval()


def load_hf_state_dict(model: CausalLM, state_dict: Mapping[str, torch.Tensor]) -> CausalLM:
    """Fill `model` from an in-memory HF state dict (e.g. a transformers model's `state_dict()`)."""
    filler = HFWeightFiller(model)
    for hf_name, tensor in state_dict.items():
        if filler.wants(hf_name):
            filler.fill(hf_name, tensor, "state_dict")
    filler.finish("state_dict")
    return model.eval()


def _expected_rows(
    model: CausalLM, config: ModelConfig, first_expert: int = 0
) -> dict[tuple[str, int | None, int | None], str]:
    """(parameter, expert, first row) -> HF tensor name, for every slice the checkpoint must
    supply (Qwen3-MoE's experts one expert's gate, up and down at a time, by global expert
    id: the model's experts are first_expert onwards)."""
    fused = _fused_targets(config)
    expected: dict[tuple[str, int | None, int | None], str] = {}
    per_expert = config.architecture == "Qwen3MoeForCausalLM"
    for name, tensor in model.named_parameters():
        experts = re.fullmatch(r"(layers\.\d+)\.mlp\.experts\.(w13|w2)", name)
        if experts is not None and per_expert:
            layer, param = experts.groups()
            for expert in range(first_expert, first_expert + tensor.shape[0]):
                prefix = f"model.{layer}.mlp.experts.{expert}"
                if param == "w2":
                    expected[(name, expert, None)] = f"{prefix}.down_proj.weight"
                else:
                    expected[(name, expert, 0)] = f"{prefix}.gate_proj.weight"
                    expected[(name, expert, config.moe_intermediate_size)] = f"{prefix}.up_proj.weight"
            continue
        parts = re.fullmatch(r"(layers\.\d+)\.(self_attn\.qkv_proj|mlp\.gate_up_proj)\.(weight|bias)", name)
        if parts is None:
            expected[(name, None, None)] = _hf_name(name, config)
            continue
        layer, fused_name, kind = parts.groups()
        for hf_projection, (target, start, _) in fused.items():
            if target == fused_name:
                expected[(name, None, start)] = f"model.{layer}.{hf_projection}.{kind}"
    return expected


def _read_shard(shard: Any, hf_name: str, part: TensorShard, source: str) -> torch.Tensor:
    """Read only `part` of tensor `hf_name` from an open safetensors file (`safe_open`),
    zero-padded to the shard's size (the vocabulary's last shard)."""
    lazy = shard.get_slice(hf_name)
    shape = tuple(lazy.get_shape())
    if len(shape) <= part.dim or shape[part.dim] != part.full_size:
        raise CheckpointError(
            f"{source}: tensor {hf_name!r} has shape {shape}, the model expects {part.full_size} "
            f"along dim {part.dim} to split it across tensor-parallel ranks"
        )
    tensor = lazy[(slice(None),) * part.dim + (slice(part.start, part.end),)]
    if part.num_padding:
        padding = list(tensor.shape)
        padding[part.dim] = part.num_padding
        tensor = torch.cat((tensor, tensor.new_zeros(padding)), dim=part.dim)
    return tensor


def _rearranged(tensor: torch.Tensor, layout: str | None) -> torch.Tensor:
    """An HF expert tensor in the model's layout (see `_Target`)."""
    if layout in ("packed", "packed_interleaved"):
        tensor = tensor.flatten(2)  # blocks [E, out, G, 16] -> [E, out, G * 16]; scales stay [E, out, G]
        return torch.cat((tensor[:, 0::2], tensor[:, 1::2]), dim=1) if layout == "packed_interleaved" else tensor
    if layout in ("transposed", "interleaved_transposed"):
        tensor = tensor.transpose(-1, -2)  # [E, in, out] -> [E, out, in]
    if layout == "interleaved_transposed":
        return torch.cat((tensor[:, 0::2], tensor[:, 1::2]), dim=1)  # rows: gate, up, gate, ... -> [gate | up]
    if layout == "interleaved":
        return torch.cat((tensor[..., 0::2], tensor[..., 1::2]), dim=-1)
    return tensor


def _copy_tensor(
    tensor: torch.Tensor, param: torch.Tensor, target: _Target, hf_name: str, source: str, first_expert: int = 0
) -> None:
    tensor = _rearranged(tensor, target.layout)
    destination = param if target.expert is None else param[target.expert - first_expert]
    if target.row_start is not None:
        destination = destination[target.row_start : target.row_end]
    if tensor.shape != destination.shape:
        raise CheckpointError(
            f"{source}: tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
            f"the model expects {tuple(destination.shape)}"
        )
    with torch.no_grad():
        destination.copy_(tensor)
