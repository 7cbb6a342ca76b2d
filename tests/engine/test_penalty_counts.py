"""PenaltyCounts: the device-kept token counts of penalised sequences equal a fresh count of
their outputs (and prompts) at every step, rows are freed with their sequences and reused
zeroed, the tables grow up to their cap and then lend out the rows of sequences a step does
not sample, and a shortened output is counted again."""

from __future__ import annotations

import gc
import random

import torch

from cleave.engine.penalty_counts import PenaltyCounts
from cleave.engine.sampling_tensors import token_counts
from cleave.engine.sequence import Sequence
from cleave.generation.sampling_params import SamplingParams

VOCAB = 50
PLAIN = SamplingParams()
PENALISED = [SamplingParams(presence_penalty=0.5), SamplingParams(frequency_penalty=0.3),
             SamplingParams(repetition_penalty=1.2)]


def expected(seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
    """What counting every row afresh gives, zeros for rows without penalties."""
    keep = torch.tensor([seq.sampling_params.has_penalties for seq in seqs])[:, None]
    counts = token_counts([seq.output_token_ids for seq in seqs], VOCAB, "cpu") * keep
    prompts = token_counts([seq.prompt_token_ids for seq in seqs], VOCAB, "cpu") > 0
    repetition = torch.tensor([seq.sampling_params.repetition_penalty != 1.0 for seq in seqs])[:, None]
    return counts, prompts & repetition


def test_counts_follow_outputs_step_by_step_as_sequences_come_and_go():
    rng = random.Random(0)
    table = PenaltyCounts(VOCAB, "cpu", max_rows=8)
    live: list[Sequence] = []
    for step in range(60):
        if len(live) < 7 and rng.random() < 0.4:  # more penalised sequences than the first table holds
            params = rng.choice([PLAIN, *PENALISED])
            live.append(Sequence(f"r{step}", [rng.randrange(VOCAB) for _ in range(rng.randint(1, 9))],
                                 sampling_params=params))
        if live and rng.random() < 0.15:  # a sequence ends: the engine drops it
            live.pop(rng.randrange(len(live)))
            gc.collect()
        for seq in live:
            for _ in range(rng.choice([1, 1, 1, 3])):
                seq.append_token(rng.randrange(VOCAB))
        if not live:
            continue
        batch = rng.sample(live, rng.randint(1, len(live)))  # a step samples some of them, in any order
        counts, prompts = table.gather(batch, with_prompt=True)
        want_counts, want_prompts = expected(batch)
        assert torch.equal(counts, want_counts), step
        assert torch.equal(prompts, want_prompts), step
        assert table.gather(batch, with_prompt=False)[1] is None
    assert table.num_rows_held == sum(seq.sampling_params.has_penalties for seq in live)


def test_a_freed_row_is_reused_zeroed():
    table = PenaltyCounts(VOCAB, "cpu", max_rows=8)
    first = Sequence("a", [1, 2], sampling_params=PENALISED[2])
    for token in (3, 3, 4):
        first.append_token(token)
    counts, prompts = table.gather([first], with_prompt=True)
    assert counts[0, 3] == 2 and prompts[0, 1]
    del first
    gc.collect()
    second = Sequence("b", [5], sampling_params=PENALISED[2])
    second.append_token(6)
    counts, prompts = table.gather([second], with_prompt=True)
    assert table.num_rows_held == 1
    assert counts[0].nonzero().flatten().tolist() == [6] and prompts[0].nonzero().flatten().tolist() == [5]


def test_a_shortened_output_is_counted_again():
    table = PenaltyCounts(VOCAB, "cpu", max_rows=8)
    seq = Sequence("a", [1], sampling_params=PENALISED[0])
    for token in (7, 8, 9):
        seq.append_token(token)
    table.gather([seq], with_prompt=False)
    seq.all_token_ids.pop()  # a token the engine dropped
    seq.all_token_ids.pop()
    counts, _ = table.gather([seq], with_prompt=False)
    assert counts[0].nonzero().flatten().tolist() == [7]


def test_at_the_cap_a_step_takes_the_rows_of_sequences_it_does_not_sample():
    rng = random.Random(3)
    table = PenaltyCounts(VOCAB, "cpu", max_rows=2)
    seqs = [Sequence(f"r{i}", [rng.randrange(VOCAB) for _ in range(5)], sampling_params=PENALISED[i % 3])
            for i in range(5)]
    for step in range(40):
        batch = rng.sample(seqs, 2)  # five penalised sequences take turns in two rows
        for seq in batch:
            seq.append_token(rng.randrange(VOCAB))
        counts, prompts = table.gather(batch, with_prompt=True)
        want_counts, want_prompts = expected(batch)
        assert torch.equal(counts, want_counts) and torch.equal(prompts, want_prompts), step
        assert table.num_rows_held == 2
    counts, _ = table.gather(seqs[:4], with_prompt=False)  # a step past the cap grows the tables
    assert torch.equal(counts, expected(seqs[:4])[0]) and table.num_rows_held == 4
