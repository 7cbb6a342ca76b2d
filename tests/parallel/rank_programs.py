"""What each tensor-parallel rank runs in the tests (module-level, so spawned ranks import it),
and a group that counts its collectives."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from cleave.kernels.moe_reference import route_reference
from cleave.model.config import ModelConfig
from cleave.model.loader import load_model
from cleave.model.moe import SparseMoeBlock
from cleave.parallel.experts import ExpertParallelMoeBlock
from cleave.parallel.group import TensorParallelGroup
from cleave.parallel.sharding import TensorParallelLayout
from tests.parallel.paged_batch import greedy_paged


@dataclass(frozen=True)
class CountingGroup(TensorParallelGroup):
    """A TensorParallelGroup that counts the collectives the model calls on it."""

    counts: dict[str, int] = field(
        default_factory=lambda: {"all_reduce": 0, "all_gather": 0, "all_to_all_single": 0}
    )

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self.counts["all_reduce"] += 1
        return super().all_reduce(tensor)

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        self.counts["all_gather"] += 1
        return super().all_gather(tensor, dim)

    def all_to_all_single(
        self, tensor: torch.Tensor, send_counts: list[int] | None = None, recv_counts: list[int] | None = None
    ) -> torch.Tensor:
        self.counts["all_to_all_single"] += 1
        return super().all_to_all_single(tensor, send_counts, recv_counts)


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


@torch.inference_mode()
def expert_parallel_block_rank(group: TensorParallelGroup, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per case: a whole `SparseMoeBlock` with seeded random weights on the torch references
    (the oracle), and this rank's `ExpertParallelMoeBlock` holding its experts of the same
    weights, both run on the same seeded hidden states. A case is a dict of `config`
    (ModelConfig fields), `num_tokens`, `seed`, `impl` and `favour_first_rank` (a router
    bias that sends every token to rank 0's experts)."""
    results = []
    for case in cases:
        config = ModelConfig(**case["config"])
        generator = torch.Generator().manual_seed(case["seed"])
        whole = SparseMoeBlock(config, impl="torch")
        for param in whole.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
        layout = TensorParallelLayout(config, group.rank, group.world_size)
        if case.get("favour_first_rank"):
            whole.router.bias[: layout.num_local_experts] += 50.0
        counting = CountingGroup(group.rank, group.world_size, group.process_group)
        block = ExpertParallelMoeBlock(config, layout, counting, impl=case["impl"])
        block.router.load_state_dict(whole.router.state_dict())
        held = slice(layout.first_expert, layout.first_expert + layout.num_local_experts)
        for name, param in block.experts.named_parameters():
            param.copy_(getattr(whole.experts, name)[held])
        hidden = torch.randn(case["num_tokens"], config.hidden_size, generator=generator)
        _, ids = route_reference(whole.router(hidden), config.num_experts_per_tok, config.norm_topk_prob)
        results.append({
            "expected": whole(hidden), "output": block(hidden), "collectives": dict(counting.counts),
            "expert_loads": torch.bincount(ids.reshape(-1).long(), minlength=config.num_experts).tolist(),
        })
    return results


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
        "enforce_eager": llm.engine.config.enforce_eager,
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
