"""Bucket sizes and bucket selection for CUDA-graph decode."""

import pytest

from cleave.graphs.buckets import batch_size_buckets, select_bucket


def test_buckets_follow_the_schedule_and_end_at_the_maximum():
    assert batch_size_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert batch_size_buckets(256)[-5:] == [128, 160, 192, 224, 256]
    assert batch_size_buckets(384)[-3:] == [256, 320, 384]
    assert batch_size_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_size_buckets(1) == [1]


def test_buckets_reject_a_non_positive_maximum():
    with pytest.raises(ValueError):
        batch_size_buckets(0)


@pytest.mark.parametrize(
    ("batch_size", "bucket"), [(1, 1), (3, 4), (8, 8), (9, 16), (17, 24), (33, 48), (64, 64), (65, None)]
)
def test_select_bucket_picks_the_smallest_that_fits(batch_size, bucket):
    assert select_bucket(batch_size_buckets(64), batch_size) == bucket
