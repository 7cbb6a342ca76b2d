"""Load an HF safetensors checkpoint into `CausalLM`.

The model is built on the meta device and materialised once in the target dtype/device, then
every checkpoint tensor is read straight onto that device and copied into its parameter (or
its rows of a fused `qkv_proj` / `gate_up_proj`), so peak memory is the model plus one tensor.
Every parameter row must be written exactly once: missing, unexpected and misshapen tensors
fail with the file and tensor named.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from cleave.kernels.dispatch import Impl
from cleave.model.config import ModelConfig
from cleave.model.llama import CausalLM

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Tensors some checkpoints carry that the model recomputes instead of loading.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model: names the file and tensor at fault."""


@dataclass(frozen=True)
class _Target:
    """Where one HF tensor goes: a parameter, and for fused weights its row range."""

    param_name: str
    row_start: int | None = None
    row_end: int | None = None


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


def map_hf_name(hf_name: str, config: ModelConfig) -> _Target:
    """Where an HF tensor name goes in `CausalLM` (the parameter may not exist)."""
    name = hf_name.removeprefix("model.")
    match = re.fullmatch(r"(layers\.\d+)\.(self_attn\.[qkv]_proj|mlp\.(?:gate|up)_proj)\.(weight|bias)", name)
    if match:
        layer, projection, kind = match.groups()
        fused, start, end = _fused_targets(config)[projection]
        return _Target(f"{layer}.{fused}.{kind}", start, end)
    return _Target(name)


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
) -> CausalLM:
    """A `CausalLM` with uninitialised weights allocated once, in `dtype` on `device`."""
    with torch.device("meta"):
        model = CausalLM(config, impl=impl)
    model.to(dtype=dtype or config.dtype)
    return model.to_empty(device=device)


class HFWeightFiller:
    """Copies HF-named tensors into a `CausalLM`, checking that each slice is written once.

    `fill(name, tensor, source)` places one tensor (`source` names its file in errors);
    `finish(what)` raises if any parameter slice was never written.
    """

    def __init__(self, model: CausalLM) -> None:
        self.config = model.config
        self.params = dict(model.named_parameters())  # a tied lm_head appears once, as embed_tokens
        self.pending = _expected_rows(model, self.config)

    def wants(self, hf_name: str) -> bool:
        """False for tensors the model recomputes or ignores (rotary tables, a tied head)."""
        if _IGNORED.fullmatch(hf_name):
            return False
        # HF ties the head to the embeddings even when a copy is stored
        return not (self.config.tie_word_embeddings and map_hf_name(hf_name, self.config).param_name == "lm_head.weight")

    def fill(self, hf_name: str, tensor: torch.Tensor, source: str) -> None:
        target = map_hf_name(hf_name, self.config)
        if target.param_name not in self.params:
            raise CheckpointError(f"{source}: unexpected tensor {hf_name!r} for {self.config.architecture}")
        key = (target.param_name, target.row_start)
        if key not in self.pending:
            raise CheckpointError(f"{source}: tensor {hf_name!r} appears more than once")
        _copy_tensor(tensor, self.params[target.param_name], target, hf_name, source)
        self.pending.pop(key)

    def finish(self, what: str) -> None:
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
) -> CausalLM:
    """Load `path` (an HF checkpoint directory) into a `CausalLM` in eval mode.

    dtype defaults to the config's. Raises FileNotFoundError for missing files and
    CheckpointError for missing, unexpected or misshapen tensors.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    config = ModelConfig.from_pretrained(path)
    files = checkpoint_files(path)
    model = empty_model(config, dtype, device, impl)
    filler = HFWeightFiller(model)
    for file in files:
        with safe_open(str(file), framework="pt", device=str(device)) as shard:
            for hf_name in shard.keys():
                if filler.wants(hf_name):
                    filler.fill(hf_name, shard.get_tensor(hf_name), file.name)
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


def _expected_rows(model: CausalLM, config: ModelConfig) -> dict[tuple[str, int | None], str]:
    """(parameter, first row) -> HF tensor name, for every slice the checkpoint must supply."""
    fused = _fused_targets(config)
    expected: dict[tuple[str, int | None], str] = {}
    for name, _ in model.named_parameters():
        parts = re.fullmatch(r"(layers\.\d+)\.(self_attn\.qkv_proj|mlp\.gate_up_proj)\.(weight|bias)", name)
        if parts is None:
            expected[(name, None)] = f"model.{name}" if name != "lm_head.weight" else name
            continue
        layer, fused_name, kind = parts.groups()
        for hf_projection, (target, start, _) in fused.items():
            if target == fused_name:
                expected[(name, start)] = f"model.{layer}.{hf_projection}.{kind}"
    return expected


def _copy_tensor(tensor: torch.Tensor, param: torch.Tensor, target: _Target, hf_name: str, source: str) -> None:
    destination = param if target.row_start is None else param[target.row_start : target.row_end]
    if tensor.shape != destination.shape:
        raise CheckpointError(
            f"{source}: tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
            f"the model expects {tuple(destination.shape)}"
        )
    with torch.no_grad():
        destination.copy_(tensor)
