"""One launch that refills the CUDA-graph decode inputs for a step.

A graph replays fixed addresses, so each step's token ids, positions, slots, context
lengths and block tables are copied into capacity-sized static buffers, and the rows past
the batch (and the block-table columns past its width) that an earlier, larger step left
holding real data are reset to padding. As separate `copy_` and `fill_` calls that is five
to ten device operations, each with its own launch gap on the stream ahead of the graph.
Here one program per row writes the whole row: the real row's values, or padding past the
batch, and the block-table columns up to the wider of this and the last step's table. On an
H200 that took a batch-1 / 1k decode step from 812.6 to 801.5 us, and launching it with PDL
(overlapping the previous step's last kernel) to 797.1 us (bench/results/decode/ab/).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from cleave.kernels.dispatch import CachedLauncher, Impl, use_triton
from cleave.kernels.pdl import launch_options, pdl_enabled, release_dependents, wait_for_producer

MAX_TABLE_BLOCK = 1024  # block-table columns per program


@dataclass(frozen=True)
class DecodeInputs:
    """One token per sequence: the rows a decode step reads.

    Attributes:
        input_ids: [B] token ids.
        positions: [B] positions.
        slot_mapping: [B] KV slot of each new token.
        seq_lens: [B] context length including the new token.
        block_tables: [B, W] KV block ids (rows may be strided, columns contiguous).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor


@dataclass(frozen=True)
class InputPadding:
    """What a padding row holds (see cleave.graphs.buckets)."""

    token_id: int
    position: int
    slot: int
    seq_len: int
    block_id: int


@triton.jit(do_not_specialize=["stride_src_table", "batch_size", "width", "clear_width"])
def _fill_decode_inputs_kernel(
    src_ids_ptr,  # [B]
    src_positions_ptr,  # [B]
    src_slots_ptr,  # [B]
    src_seq_lens_ptr,  # [B]
    src_tables_ptr,  # [B, W]
    dst_ids_ptr,  # [capacity]
    dst_positions_ptr,  # [capacity]
    dst_slots_ptr,  # [capacity]
    dst_seq_lens_ptr,  # [capacity]
    dst_tables_ptr,  # [capacity, max_blocks]
    stride_src_ids,
    stride_src_positions,
    stride_src_slots,
    stride_src_seq_lens,
    stride_src_table,
    stride_dst_table,
    batch_size,
    width,  # columns of the source tables
    clear_width,  # columns written: max(width, columns the last step left real)
    PAD_TOKEN: tl.constexpr,
    PAD_POSITION: tl.constexpr,
    PAD_SLOT: tl.constexpr,
    PAD_SEQ_LEN: tl.constexpr,
    NULL_BLOCK: tl.constexpr,
    BLOCK_W: tl.constexpr,
    PDL: tl.constexpr,
):
    # Launched right after the previous step's graph, whose kernels read the buffers this
    # overwrites: wait for it (with PDL, only the launch overlaps its tail).
    release_dependents(PDL)
    wait_for_producer(PDL)
    row = tl.program_id(0)
    column_block = tl.program_id(1)
    real = row < batch_size
    row64 = row.to(tl.int64)
    if column_block == 0:
        if real:
            tl.store(dst_ids_ptr + row, tl.load(src_ids_ptr + row64 * stride_src_ids))
            tl.store(dst_positions_ptr + row, tl.load(src_positions_ptr + row64 * stride_src_positions))
            tl.store(dst_slots_ptr + row, tl.load(src_slots_ptr + row64 * stride_src_slots))
            tl.store(dst_seq_lens_ptr + row, tl.load(src_seq_lens_ptr + row64 * stride_src_seq_lens))
        else:
            tl.store(dst_ids_ptr + row, PAD_TOKEN)
            tl.store(dst_positions_ptr + row, PAD_POSITION)
            tl.store(dst_slots_ptr + row, PAD_SLOT)
            tl.store(dst_seq_lens_ptr + row, PAD_SEQ_LEN)
    columns = column_block * BLOCK_W + tl.arange(0, BLOCK_W)
    real_width = tl.where(real, width, 0)  # a padding row reads nothing
    blocks = tl.load(src_tables_ptr + row64 * stride_src_table + columns, mask=columns < real_width, other=NULL_BLOCK)
    tl.store(dst_tables_ptr + row64 * stride_dst_table + columns, blocks, mask=columns < clear_width)


_fill_launcher = CachedLauncher(_fill_decode_inputs_kernel)


def fill_decode_inputs(
    src: DecodeInputs,
    dst: DecodeInputs,
    padding: InputPadding,
    dirty_rows: int,
    dirty_width: int,
    impl: Impl = "auto",
    pdl: bool = True,
) -> None:
    """Copy `src` (B rows, W table columns) into rows [0, B) of the capacity-sized `dst`,
    and reset to `padding` rows [B, dirty_rows) and table columns [W, dirty_width): the
    extent of real data the previous fill left (columns past it already hold padding).
    With `pdl` (where the device has it) the launch may overlap the previous kernel's tail.
    """
    batch_size = src.input_ids.shape[0]
    width = src.block_tables.shape[1]
    if not use_triton(dst.input_ids, impl):
        _fill_torch(src, dst, padding, dirty_rows, dirty_width)
        return
    rows = max(batch_size, dirty_rows)
    clear_width = max(width, dirty_width)
    device = dst.input_ids.device
    if rows == 0 or (width > 1 and src.block_tables.stride(-1) != 1) or any(
        tensor.device != device for tensor in (src.input_ids, src.positions, src.slot_mapping, src.seq_lens, src.block_tables)
    ):
        _fill_torch(src, dst, padding, dirty_rows, dirty_width)
        return
    # Tile width from the capacity, not this step's width: one compiled variant for every
    # step (a width that grows past a power of two would otherwise compile mid-run)
    block_w = min(MAX_TABLE_BLOCK, triton.next_power_of_2(max(dst.block_tables.shape[1], 1)))
    pdl = pdl_enabled(dst.input_ids, pdl)
    _fill_launcher(
        (rows, triton.cdiv(max(clear_width, 1), block_w)),
        (src.input_ids, src.positions, src.slot_mapping, src.seq_lens, src.block_tables,
         dst.input_ids, dst.positions, dst.slot_mapping, dst.seq_lens, dst.block_tables,
         src.input_ids.stride(0), src.positions.stride(0), src.slot_mapping.stride(0), src.seq_lens.stride(0),
         src.block_tables.stride(0), dst.block_tables.stride(0), batch_size, width, clear_width),
        (padding.token_id, padding.position, padding.slot, padding.seq_len, padding.block_id, block_w, pdl),
        max(1, min(4, block_w // 128)),
        **launch_options(pdl),
    )


def _fill_torch(src: DecodeInputs, dst: DecodeInputs, padding: InputPadding, dirty_rows: int, dirty_width: int) -> None:
    batch_size = src.input_ids.shape[0]
    width = src.block_tables.shape[1]
    dst.input_ids[:batch_size].copy_(src.input_ids, non_blocking=True)
    dst.positions[:batch_size].copy_(src.positions, non_blocking=True)
    dst.slot_mapping[:batch_size].copy_(src.slot_mapping, non_blocking=True)
    dst.seq_lens[:batch_size].copy_(src.seq_lens, non_blocking=True)
    dst.block_tables[:batch_size, :width].copy_(src.block_tables, non_blocking=True)
    if dirty_width > width:
        dst.block_tables[: min(batch_size, dirty_rows), width:dirty_width].fill_(padding.block_id)
    if dirty_rows > batch_size:
        dst.input_ids[batch_size:dirty_rows].fill_(padding.token_id)
        dst.positions[batch_size:dirty_rows].fill_(padding.position)
        dst.slot_mapping[batch_size:dirty_rows].fill_(padding.slot)
        dst.seq_lens[batch_size:dirty_rows].fill_(padding.seq_len)
        dst.block_tables[batch_size:dirty_rows, :dirty_width].fill_(padding.block_id)
