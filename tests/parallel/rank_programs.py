"""What each tensor-parallel rank runs in the tests (module-level, so spawned ranks import it),
and a group that counts its collectives."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from cleave.model.loader import load_model
from cleave.parallel.group import TensorParallelGroup
from tests.parallel.paged_batch import greedy_paged


@dataclass(frozen=True)
class CountingGroup(TensorParallelGroup):
    """A TensorParallelGroup that counts the collectives the model calls on it."""

    counts: dict[str, int] = field(default_factory=lambda: {"all_reduce": 0, "all_gather": 0})

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self.counts["all_reduce"] += 1
        return super().all_reduce(tensor)

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        self.counts["all_gather"] += 1
        return super().all_gather(tensor, dim)


def model_rank(
    group: TensorParallelGroup, checkpoint: str, prompts: list[list[int]], max_new_tokens: int, device: str = "cpu"
) -> dict:
    """This rank's shard loaded and run by `greedy_paged`, with the collectives counted
    (after loading, and after the whole run) and the shard's first KV head."""
    counting = CountingGroup(group.rank, group.world_size, group.process_group)
    model = load_model(checkpoint, device=device, tensor_parallel=counting)
    after_load = dict(counting.counts)
    result = greedy_paged(model, prompts, max_new_tokens, device)
    result.update(
        collectives_after_load=after_load, collectives=dict(counting.counts),
        first_kv_head=model.layout.first_kv_head, num_layers=len(model.layers),
        parameter_shapes={name: tuple(param.shape) for name, param in model.named_parameters()},
    )
    return result


def engine_rank(
    group: TensorParallelGroup, checkpoint: str, prompts: list[list[int]], params: list[Any], engine_kwargs: dict
) -> dict:
    """`LLM.generate` on this rank with tensor_parallel_size = the group's size (the engine
    loads its shard through `tensor_parallel_group`, the default process group)."""
    from cleave.engine.llm import LLM

    llm = LLM(checkpoint, tensor_parallel_size=group.world_size, **engine_kwargs)
    outputs = llm.generate(prompts, params)
    return {
        "tokens": [[sample.token_ids for sample in output.outputs] for output in outputs],
        "kv_cache_shape": tuple(llm.engine.kv_cache.shape),
        "model_type": type(llm.engine.model).__name__,
    }


def hang(group: TensorParallelGroup, pid_dir: str) -> None:
    """Record this rank's pid, then wait forever (a rank stuck in a collective)."""
    import os
    import threading
    from pathlib import Path

    (Path(pid_dir) / f"{group.rank}.pid").write_text(str(os.getpid()))
    threading.Event().wait()


def fail_on_last_rank(group: TensorParallelGroup) -> None:
    """Rank world_size-1 raises; the others wait forever for it."""
    import threading

    if group.rank == group.world_size - 1:
        raise ValueError(f"rank {group.rank} gives up")
    threading.Event().wait()
