"""The KV layout a worker's engine exposes to peers: which of the model's KV heads its cache
holds (all of them, or a tensor-parallel rank's slice) and the hash namespace of its blocks."""

from __future__ import annotations

from cleave.engine.llm_engine import LLMEngine
from cleave.parallel.model import TensorParallelCausalLM
from cleave.rpc.types import KVLayout
from cleave.transfer.layout import layout_of


def kv_layout_of(engine: LLMEngine, model_id: str) -> KVLayout:
    """The layout of the engine's KV cache; its hash namespace is the engine's prefix-hash
    namespace, so kvstore blocks and transfers only match the same weights and dtype. A
    tensor-parallel rank's names its heads (`kv_head_start`, `total_kv_heads`), so a sender
    holding every head sends it its slice (`cleave.transfer.layout.head_slice`)."""
    model = engine.model
    if isinstance(model, TensorParallelCausalLM):
        shard = model.layout
        return layout_of(engine.kv_cache, model_id, engine.kv.namespace.hex(), kv_head_start=shard.first_kv_head,
                         total_kv_heads=shard.config.num_key_value_heads)
    return layout_of(engine.kv_cache, model_id, engine.kv.namespace.hex())
