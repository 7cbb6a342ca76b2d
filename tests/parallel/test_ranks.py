"""The rank launcher the tensor-parallel tests stand on: a rank's error reaches the test, and
ranks that hang are ended at the deadline, none left behind."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from torch.multiprocessing import ProcessRaisedException

from tests.parallel.rank_programs import fail_on_last_rank, hang
from tests.parallel.ranks import run_ranks


def test_hung_ranks_are_ended_at_the_deadline(tmp_path: Path) -> None:
    with pytest.raises(TimeoutError, match="still running 5 s after they joined"):
        run_ranks(hang, 2, str(tmp_path), timeout_s=5)
    pids = [int(file.read_text()) for file in sorted(tmp_path.glob("*.pid"))]
    assert len(pids) == 2
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_rank_that_raises_fails_the_run_with_its_error() -> None:
    # well before the deadline: the error ends the run, and the waiting rank with it
    with pytest.raises(ProcessRaisedException, match="rank 1 gives up"):
        run_ranks(fail_on_last_rank, 2, timeout_s=120)
