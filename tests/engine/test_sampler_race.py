"""The sampler's one-kernel race (`Sampler(impl="triton")`, the Triton interpreter here)
against its torch path: seeded and greedy rows draw the same tokens after every processing
stage, unseeded rows draw from the tempered softmax, and batches that truncate their
distribution keep the torch path."""

from __future__ import annotations

import torch

from cleave.engine import sampler as sampler_module
from cleave.engine.sampler import Sampler
from cleave.engine.sampling_tensors import SamplingTensors
from cleave.generation.sampling_params import SamplingParams

from tests.kernels.test_race_sample import reference_race


def state_of(params, vocab_size, outputs=None, **kwargs) -> SamplingTensors:  # noqa: ANN001
    outputs = outputs if outputs is not None else [[3, 4] for _ in params]
    return SamplingTensors.from_params(params, vocab_size=vocab_size, device="cpu", output_token_ids=outputs, **kwargs)


def races(monkeypatch) -> list[int]:  # noqa: ANN001
    """Rows of every one-kernel race the sampler launches from now on."""
    launched: list[int] = []
    original = sampler_module.race_sample

    def counting(logits, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        launched.append(logits.shape[0])
        return original(logits, *args, **kwargs)

    monkeypatch.setattr(sampler_module, "race_sample", counting)
    return launched


def test_seeded_and_greedy_rows_draw_the_torch_paths_tokens(monkeypatch):
    """Temperatures, a greedy row, a logit bias, penalties and min_tokens, each row seeded:
    the kernel's tokens are the torch path's, step after step."""
    launched = races(monkeypatch)
    vocab = 300
    params = [SamplingParams(temperature=0.7, seed=1), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.3, seed=2, logit_bias={5: 4.0}),
              SamplingParams(temperature=1.0, seed=3, frequency_penalty=0.5, presence_penalty=0.2),
              SamplingParams(temperature=0.9, seed=4, min_tokens=8, stop_token_ids=[9])]
    outputs = [[] for _ in params]
    fused, plain = Sampler(seed=0, impl="triton"), Sampler(seed=0, impl="torch")
    for step in range(6):
        logits = 2.0 * torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(step))
        state = state_of(params, vocab, outputs, eos_token_ids=(2,))
        tokens = fused.sample(logits, state).token_ids.tolist()
        assert tokens == plain.sample(logits, state).token_ids.tolist()
        for row, token in enumerate(tokens):
            outputs[row].append(token)
    assert launched == [len(params)] * 6
    assert len({tuple(row) for row in outputs}) == len(params)


def test_unseeded_rows_race_on_random_keys_from_the_samplers_generator(monkeypatch):
    """Unseeded rows hash their noise from 64 random bits a row (the race itself is the
    reference's exact sampler over those keys, tests/kernels/test_race_sample.py; the hash's
    uniforms are tested in tests/engine/test_sampler.py): distinct per row and per step, and
    the same again from a sampler with the same seed."""
    keys_seen: list[torch.Tensor] = []
    original = sampler_module.race_sample

    def recording(logits, temperatures, is_greedy, keys, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        keys_seen.append(keys.clone())
        tokens = original(logits, temperatures, is_greedy, keys, *args, **kwargs)
        assert torch.equal(tokens, reference_race(logits, temperatures, is_greedy, keys))
        return tokens

    monkeypatch.setattr(sampler_module, "race_sample", recording)
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2]).expand(32, -1).contiguous()
    params = [SamplingParams(temperature=0.7)] * 32
    first = Sampler(seed=11, impl="triton")
    tokens = [first.sample(logits, state_of(params, 8)).token_ids for _ in range(2)]
    again = Sampler(seed=11, impl="triton").sample(logits, state_of(params, 8)).token_ids
    other = Sampler(seed=12, impl="triton").sample(logits, state_of(params, 8)).token_ids
    assert torch.equal(again, tokens[0]) and len(set(tokens[0].tolist())) > 2
    assert torch.equal(keys_seen[2], keys_seen[0]) and not torch.equal(keys_seen[3], keys_seen[0])
    step_keys = torch.cat(keys_seen[:2])  # two steps of 32 rows
    assert len({tuple(key) for key in step_keys.tolist()}) == 64
    assert ((step_keys >= 0) & (step_keys < 2**32)).all()


def test_a_truncating_row_keeps_the_batch_on_the_torch_path(monkeypatch):
    launched = races(monkeypatch)
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(seed=1), SamplingParams(seed=2, top_p=0.5), SamplingParams(seed=3)]
    state = state_of(params, 50)
    tokens = Sampler(impl="triton").sample(logits, state).token_ids
    assert launched == [] and torch.equal(tokens, Sampler(impl="torch").sample(logits, state).token_ids)


def test_warming_the_race_launches_it_once_and_draws_nothing_from_the_generator(monkeypatch):
    launched = races(monkeypatch)
    warmed, fresh = Sampler(seed=5, impl="triton"), Sampler(seed=5, impl="triton")
    warmed.warm(300, torch.device("cpu"))
    assert launched == [2]
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(1))
    state = state_of([SamplingParams(temperature=0.9)] * 3, 300)
    assert torch.equal(warmed.sample(logits, state).token_ids, fresh.sample(logits, state).token_ids)
    Sampler(seed=5, impl="torch").warm(300, torch.device("cpu"))  # the torch path has nothing to compile
    assert launched == [2, 3, 3]
