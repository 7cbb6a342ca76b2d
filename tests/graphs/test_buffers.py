"""Static decode buffers: real rows copied in place, every other row left as padding."""

import pytest
import torch

from cleave.graphs.buffers import StaticDecodeBuffers
from cleave.kv.metadata import PAD_SLOT_ID, AttentionMetadata

BLOCK_SIZE = 4


def decode_batch(seq_lens: list[int], tables: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    metadata = AttentionMetadata.build([1] * len(seq_lens), seq_lens, tables, BLOCK_SIZE)
    input_ids = torch.tensor([100 + i for i in range(len(seq_lens))])
    positions = torch.tensor([seq_len - 1 for seq_len in seq_lens])
    return input_ids, positions, metadata


IMPLS = pytest.mark.parametrize("impl", ["torch", "triton"])  # triton: one kernel, interpreted on CPU


@IMPLS
def test_fill_copies_real_rows_and_bucket_view_shows_padding(impl):
    buffers = StaticDecodeBuffers(max_batch_size=8, max_blocks_per_seq=4, block_size=BLOCK_SIZE, device="cpu")
    input_ids, positions, metadata = decode_batch([6, 3, 9], [[5, 2], [7], [1, 3, 8]])

    buffers.fill(input_ids, positions, metadata, impl)
    view = buffers.metadata(4)

    assert buffers.input_ids[:4].tolist() == [100, 101, 102, 0]
    assert buffers.positions[:4].tolist() == [5, 2, 8, 0]
    assert view.slot_mapping.tolist() == [2 * 4 + 1, 7 * 4 + 2, 8 * 4 + 0, PAD_SLOT_ID]
    assert view.seq_lens.tolist() == [6, 3, 9, 0]
    assert view.block_tables.tolist() == [[5, 2, 0, 0], [7, 0, 0, 0], [1, 3, 8, 0], [0, 0, 0, 0]]
    assert view.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert (view.max_query_len, view.max_seq_len) == (1, 16)


@IMPLS
def test_a_smaller_batch_resets_the_rows_and_columns_the_last_one_used(impl):
    buffers = StaticDecodeBuffers(max_batch_size=8, max_blocks_per_seq=4, block_size=BLOCK_SIZE, device="cpu")
    buffers.fill(*decode_batch([13, 10, 9, 16], [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10], [11, 12, 13, 14]]), impl)

    buffers.fill(*decode_batch([2, 7], [[3], [4, 6]]), impl)

    assert buffers.block_tables.tolist()[:5] == [[3, 0, 0, 0], [4, 6, 0, 0], [0] * 4, [0] * 4, [0] * 4]
    assert buffers.seq_lens.tolist() == [2, 7, 0, 0, 0, 0, 0, 0]
    assert buffers.slot_mapping.tolist() == [3 * 4 + 1, 6 * 4 + 2] + [PAD_SLOT_ID] * 6
    assert buffers.input_ids.tolist() == [100, 101] + [0] * 6
    assert buffers.positions.tolist() == [1, 6] + [0] * 6


def test_fill_rejects_batches_beyond_capacity():
    buffers = StaticDecodeBuffers(max_batch_size=2, max_blocks_per_seq=2, block_size=BLOCK_SIZE, device="cpu")
    with pytest.raises(ValueError, match="max_blocks_per_seq"):
        buffers.fill(*decode_batch([9], [[1, 2, 3]]))
    with pytest.raises(ValueError, match="capacity of 2"):
        buffers.fill(*decode_batch([1, 1, 1], [[1], [2], [3]]))


@IMPLS
def test_a_larger_wider_batch_after_a_small_one_and_strided_sources(impl):
    buffers = StaticDecodeBuffers(max_batch_size=4, max_blocks_per_seq=6, block_size=BLOCK_SIZE, device="cpu")
    buffers.fill(*decode_batch([5], [[9, 4]]), impl)
    packed = torch.arange(40, dtype=torch.int32).view(4, 10)  # a table whose rows are strided
    input_ids = torch.tensor([[7, 70], [8, 80], [9, 90]])[:, 0]  # a strided column
    positions = torch.tensor([20, 3, 11], dtype=torch.int32)  # cast to int64 on the way in
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor([33, 44, 55]),
        query_start_loc=torch.arange(4, dtype=torch.int32),
        seq_lens=torch.tensor([21, 4, 12], dtype=torch.int32),
        block_tables=packed[:3, 1:6],
        max_query_len=1,
        max_seq_len=24,
    )

    buffers.fill(input_ids, positions, metadata, impl)

    assert buffers.input_ids.tolist() == [7, 8, 9, 0]
    assert buffers.positions.tolist() == [20, 3, 11, 0] and buffers.positions.dtype == torch.int64
    assert buffers.slot_mapping.tolist() == [33, 44, 55, PAD_SLOT_ID]
    assert buffers.seq_lens.tolist() == [21, 4, 12, 0]
    assert buffers.block_tables.tolist() == [
        [1, 2, 3, 4, 5, 0], [11, 12, 13, 14, 15, 0], [21, 22, 23, 24, 25, 0], [0] * 6,
    ]


@IMPLS
def test_window_tables_fill_their_own_slots_and_tables(impl):
    """A paired cache's batch (cleave.kv.groups): the window tables' slots and tables go to
    buffers of their own, the bucket view's `window`; a smaller batch pads them again."""
    buffers = StaticDecodeBuffers(max_batch_size=4, max_blocks_per_seq=3, block_size=BLOCK_SIZE, device="cpu",
                                  window_tables=True)
    metadata = AttentionMetadata.build([1, 1], [6, 9], [[5, 2], [1, 3, 8]], BLOCK_SIZE,
                                       window_tables=[[0, 4], [0, 6, 7]])
    buffers.fill(torch.tensor([100, 101]), torch.tensor([5, 8]), metadata, impl)
    view = buffers.metadata(2)
    assert view.block_tables.tolist() == [[5, 2, 0], [1, 3, 8]]
    assert view.window.block_tables.tolist() == [[0, 4, 0], [0, 6, 7]]
    assert view.window.slot_mapping.tolist() == [4 * 4 + 1, 7 * 4 + 0]
    assert view.window.seq_lens is view.seq_lens and view.window.query_start_loc is view.query_start_loc

    buffers.fill(*decode_batch([2], [[9]])[:2], AttentionMetadata.build([1], [2], [[9]], BLOCK_SIZE,
                                                                       window_tables=[[10]]), impl)
    assert buffers.window.block_tables.tolist() == [[10, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert buffers.window.slot_mapping.tolist() == [10 * 4 + 1] + [PAD_SLOT_ID] * 3
    with pytest.raises(ValueError, match="window tables"):
        buffers.fill(*decode_batch([2], [[9]]), impl)
