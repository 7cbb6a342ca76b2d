"""`TensorParallelGroup`: the ranks one model is split over, and the collectives the split
model needs: a sum and a concatenation across ranks, and an all-to-all exchange of rows
(expert parallelism's dispatch and combine, `cleave.parallel.experts`).

Every rank runs the same program in its own process (one per device), so every collective
below is called by all ranks in the same order; a rank that skips one hangs the others
until the process group's timeout. The group wraps a `torch.distributed` process group
(gloo on CPU, NCCL on GPUs) that the caller initialised; cleave never starts one itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallelGroup:
    """This process's place in a tensor-parallel group.

    Attributes:
        rank: this process's rank in the group, 0..world_size-1 (which shard it holds).
        world_size: how many ranks the model is split over.
        process_group: the torch.distributed group the collectives run on (None: the
            default group, the whole world).
    """

    rank: int
    world_size: int
    process_group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a tensor-parallel group of {self.world_size}")

    @classmethod
    def from_process_group(cls, process_group: dist.ProcessGroup | None = None) -> "TensorParallelGroup":
        """The group of an initialised torch.distributed process group (None: the default one)."""
        return cls(dist.get_rank(process_group), dist.get_world_size(process_group), process_group)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place; returns it (identical on every rank)."""
        dist.all_reduce(tensor, group=self.process_group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `tensor` (same shape on all ranks) concatenated along `dim`, in rank order."""
        # the list form runs on gloo and NCCL alike, on torch 2.11 and 2.13
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor, group=self.process_group)
        return torch.cat(parts, dim=dim)

    def all_to_all_single(
        self, tensor: torch.Tensor, send_counts: list[int] | None = None, recv_counts: list[int] | None = None
    ) -> torch.Tensor:
        """Exchange rows: the first send_counts[0] rows of `tensor` go to rank 0, the next
        send_counts[1] to rank 1, ...; returns the rows every rank sent here, in rank order
        (recv_counts[r] from rank r). With no counts every rank sends and receives
        len(tensor) / world_size rows per rank. Every rank's recv_counts[r] must be what
        rank r sends it (exchange the counts first, with equal splits)."""
        # torch's all_to_all_single runs on gloo (CPU) and NCCL alike, zero-row splits included
        tensor = tensor.contiguous()
        num_rows = tensor.shape[0] if recv_counts is None else sum(recv_counts)
        out = tensor.new_empty((num_rows, *tensor.shape[1:]))
        dist.all_to_all_single(out, tensor, recv_counts, send_counts, group=self.process_group)
        return out


def tensor_parallel_group(size: int) -> TensorParallelGroup | None:
    """The group for `EngineConfig.tensor_parallel_size`: None for 1 (the model is built
    whole, with no collective), else the default torch.distributed group, which must
    already hold exactly `size` ranks."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    if size == 1:
        return None
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"tensor_parallel_size={size} needs torch.distributed initialised in every rank's process before "
            f"the model loads: start {size} processes (e.g. torchrun --nproc-per-node {size}) and call "
            "torch.distributed.init_process_group in each"
        )
    world_size = dist.get_world_size()
    if world_size != size:
        raise ValueError(
            f"tensor_parallel_size={size} but the torch.distributed world has {world_size} ranks; "
            f"start exactly {size} processes or set tensor_parallel_size={world_size}"
        )
    return TensorParallelGroup.from_process_group()
