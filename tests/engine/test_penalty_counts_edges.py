"""PenaltyCounts edges: below the cap a new sequence gets a row of its own rather than taking
one of a sequence the step does not sample, and every sequence gone since the last step gives
its row back at once."""

from __future__ import annotations

import gc

import torch

from cleave.engine.penalty_counts import PenaltyCounts
from cleave.engine.sampling_tensors import token_counts
from cleave.engine.sequence import Sequence
from cleave.generation.sampling_params import SamplingParams

VOCAB = 50
PENALISED = SamplingParams(presence_penalty=0.5)


def penalised(request_id: str, outputs: list[int]) -> Sequence:
    seq = Sequence(request_id, [1, 2], sampling_params=PENALISED)
    for token in outputs:
        seq.append_token(token)
    return seq


def test_below_the_cap_a_new_sequence_gets_a_row_of_its_own():
    table = PenaltyCounts(VOCAB, "cpu", max_rows=4)
    seqs = [penalised(f"r{i}", [10 + i, 10 + i]) for i in range(5)]
    for held, seq in enumerate(seqs[:4], start=1):  # each alone in its step: the others keep their rows
        table.gather([seq], with_prompt=False)
        assert table.num_rows_held == held
    counts, _ = table.gather(seqs[4:], with_prompt=False)  # at the cap: a row is lent, none added
    assert table.num_rows_held == 4
    assert torch.equal(counts, token_counts([seqs[4].output_token_ids], VOCAB, "cpu"))


def test_every_sequence_gone_since_the_last_step_frees_its_row():
    table = PenaltyCounts(VOCAB, "cpu", max_rows=8)
    seqs = [penalised(f"r{i}", [7, i]) for i in range(3)]
    table.gather(seqs, with_prompt=False)
    assert table.num_rows_held == 3
    kept = seqs[0]
    del seqs  # two sequences end between steps
    gc.collect()
    counts, _ = table.gather([kept], with_prompt=False)
    assert table.num_rows_held == 1
    assert counts[0].nonzero().flatten().tolist() == [0, 7]
