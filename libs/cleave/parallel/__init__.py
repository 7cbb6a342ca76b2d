"""cleave.parallel: tensor parallelism for the Llama-family models, one process per rank;
mixture-of-experts layers are expert-parallel inside the same group.

    torch.distributed.init_process_group(...)                # in every rank's process
    group = TensorParallelGroup.from_process_group()          # or tensor_parallel_group(size)
    model = load_model(path, dtype, device, tensor_parallel=group)  # this rank's shard only
    kv_cache = allocate_kv_cache(model.config, ...)           # this rank's KV heads
    hidden = model(input_ids, positions, kv_cache, metadata)  # [T, H] on every rank
    logits = model.compute_logits(hidden)                     # [N, V] on every rank

`group.py` holds the ranks and their collectives, `sharding.py` which part of each weight a
rank holds, `layers.py` the row-parallel Linear and vocab-parallel embedding, `experts.py`
the expert-parallel MoE block (tokens sent to their experts' ranks by all-to-all and back),
`model.py` the split `CausalLM`. With tensor_parallel_size 1 none of this is used: the model is the
plain `CausalLM`, with no collective and no extra copy.
"""

from cleave.parallel.experts import ExpertParallelMoeBlock
from cleave.parallel.group import TensorParallelGroup, tensor_parallel_group
from cleave.parallel.layers import RowParallelLinear, VocabParallelEmbedding
from cleave.parallel.model import TensorParallelCausalLM
from cleave.parallel.sharding import TensorParallelLayout, TensorShard

__all__ = [
    "ExpertParallelMoeBlock",
    "RowParallelLinear",
    "TensorParallelCausalLM",
    "TensorParallelGroup",
    "TensorParallelLayout",
    "TensorShard",
    "VocabParallelEmbedding",
    "tensor_parallel_group",
]
