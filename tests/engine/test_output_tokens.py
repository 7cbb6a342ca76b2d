"""OutputTokens, the read-only view of a sequence's generated tokens that sampling and the
logits processors read: it reads as the list of those tokens, and a slice copies only what
it takes (a processor reads its new tokens every step of a long sample)."""

from __future__ import annotations

import random

from cleave.engine.input_batch import OutputTokens
from cleave.engine.sequence import Sequence


def test_reads_as_the_output_list():
    rng = random.Random(0)
    for _ in range(500):
        seq = Sequence("r", [1] * rng.randint(1, 5))
        for _ in range(rng.randint(0, 12)):
            seq.append_token(rng.randrange(100))
        view, outputs = OutputTokens(seq), seq.output_token_ids
        assert len(view) == len(outputs) and list(view) == outputs
        assert [view[i] for i in range(-len(outputs), len(outputs))] == outputs + outputs
        for _ in range(5):
            start, stop = rng.choice([None, *range(-15, 15)]), rng.choice([None, *range(-15, 15)])
            step = rng.choice([None, 1, 2, 3, -1, -2])
            assert view[start:stop:step] == outputs[start:stop:step], (start, stop, step, outputs)


def test_a_tail_slice_does_not_copy_the_whole_output(monkeypatch):
    seq = Sequence("r", [7, 8])
    for token in range(10):
        seq.append_token(token)
    copied: list[int] = []

    class Counting(list):
        def __getitem__(self, index):  # type: ignore[no-untyped-def]
            result = super().__getitem__(index)
            if isinstance(index, slice):
                copied.append(len(result))
            return result

    seq.all_token_ids = Counting(seq.all_token_ids)
    assert OutputTokens(seq)[8:] == [8, 9]
    assert copied == [2]
