"""Sampler: greedy, truncation masks, seeded reproducibility, distribution, penalties."""

from __future__ import annotations

import math

import pytest
import torch

from cleave.engine.counter_rng import keys_to_tensor, uniform_from_keys
from cleave.engine.sampler import Sampler, apply_penalties
from cleave.engine.sampling_tensors import SamplingTensors
from cleave.generation.sampling_params import SamplingParams
from cleave.generation.seed_keys import row_key

# Chi-square critical values at p = 0.001, by degrees of freedom.
CHI2_P001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}
CHI2_7DOF_P001 = CHI2_P001[7]


def _state(params, vocab_size, outputs=None, **kwargs) -> SamplingTensors:
    outputs = outputs if outputs is not None else [[] for _ in params]
    return SamplingTensors.from_params(
        params, vocab_size=vocab_size, device="cpu", output_token_ids=outputs, **kwargs
    )


def _chi_square(token_ids: torch.Tensor, expected_probs: torch.Tensor) -> float:
    counts = torch.bincount(token_ids, minlength=expected_probs.numel()).double()
    expected = expected_probs.double() * token_ids.numel()
    assert torch.all(counts[expected == 0] == 0), "sampled a token of probability 0"
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_greedy_rows_take_argmax_exactly():
    logits = torch.randn(6, 97, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0, top_k=3, top_p=0.2) for _ in range(6)]
    out = Sampler(seed=0).sample(logits, _state(params, 97))
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.logprobs is None


def test_mixed_batch_greedy_rows_unaffected_by_sampled_rows():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=t) for t in (0.0, 1.5, 0.0, 0.8)]
    out = Sampler(seed=3).sample(logits, _state(params, 50))
    assert out.token_ids[0] == logits[0].argmax() and out.token_ids[2] == logits[2].argmax()


PROBS = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15])


@pytest.mark.parametrize(
    "options, kept",
    [
        (dict(top_k=2), [1, 3]),
        (dict(top_k=1), [1]),
        (dict(top_p=0.5), [1, 3]),
        (dict(top_p=0.75), [1, 3, 4]),
        (dict(top_p=0.3), [1]),
        (dict(min_p=0.3), [1, 3, 4]),  # threshold 0.12
        (dict(min_p=0.7), [1, 3]),  # threshold 0.28
        (dict(top_k=3, top_p=0.6), [1, 3]),  # nucleus over renormalized {.4, .3, .15}
        (dict(top_k=3, top_p=0.9), [1, 3, 4]),
        (dict(top_k=-1, top_p=1.0, min_p=0.0), [0, 1, 2, 3, 4]),
    ],
)
def test_truncation_masks_are_exact(options, kept):
    logits = PROBS.log()[None, :]
    probs = Sampler.probabilities(logits, _state([SamplingParams(**options)], 5))[0]
    expected = torch.zeros(5)
    expected[kept] = PROBS[kept] / PROBS[kept].sum()
    torch.testing.assert_close(probs, expected, rtol=1e-6, atol=1e-7)
    assert torch.equal(probs > 0, expected > 0)


def _seeded_run(seed: int, row: int, neighbors: list[SamplingParams], steps: int = 50):
    """Tokens of one seeded row sampled for `steps` steps at batch position `row`."""
    vocab = 64
    sampler = Sampler()
    target = SamplingParams(temperature=0.9, top_p=0.95, seed=seed)
    outputs: list[list[int]] = [[] for _ in range(len(neighbors) + 1)]
    for step in range(steps):
        params = list(neighbors)
        params.insert(row, target)
        # Each row gets logits that depend only on its own step, not on its position.
        logits = torch.stack(
            [torch.randn(vocab, generator=torch.Generator().manual_seed(step * 7 + i))
             for i in range(len(params))]
        )
        logits[row] = torch.randn(vocab, generator=torch.Generator().manual_seed(10_000 + step))
        out = sampler.sample(logits, _state(params, vocab, outputs))
        for i, token in enumerate(out.token_ids.tolist()):
            outputs[i].append(token)
    return outputs[row]


def test_seeded_sampling_independent_of_batch_composition():
    alone = _seeded_run(1234, 0, [])
    assert alone == _seeded_run(1234, 0, [])
    crowd = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0),
             SamplingParams(temperature=1.2, seed=7), SamplingParams(top_k=5)]
    assert _seeded_run(1234, 3, crowd) == alone
    assert _seeded_run(1234, 1, crowd[:2]) == alone
    other = _seeded_run(4321, 0, [])
    assert other != alone


def test_seeded_samples_of_one_request_differ_by_sample_index():
    logits = torch.zeros(2, 1000)
    params = [SamplingParams(seed=5), SamplingParams(seed=5)]
    state = _state(params, 1000, sample_indices=[0, 1])
    tokens = Sampler().sample(logits, state).token_ids.tolist()
    same = Sampler().sample(logits, _state(params, 1000, sample_indices=[0, 0])).token_ids
    assert tokens[0] == same[0] == same[1] and tokens[0] != tokens[1]


def test_temperature_sampling_matches_softmax_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    temperature = 0.7
    num_samples = 20_000
    params = [SamplingParams(temperature=temperature)] * num_samples
    batch = logits.expand(num_samples, -1).contiguous()  # [20000, 8]
    tokens = Sampler(seed=11).sample(batch, _state(params, 8)).token_ids
    reference = torch.softmax(logits / temperature, dim=-1)
    assert _chi_square(tokens, reference) < CHI2_7DOF_P001
    # The test has power: the untempered distribution is rejected.
    assert _chi_square(tokens, torch.softmax(logits, dim=-1)) > 10 * CHI2_7DOF_P001


def test_seeded_top_p_sampling_matches_renormalized_nucleus():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    temperature, top_p = 1.3, 0.8
    num_samples = 20_000
    # Every row seeded differently: the counter-based noise must be uniform across seeds.
    params = [SamplingParams(temperature=temperature, top_p=top_p, seed=s) for s in range(num_samples)]
    batch = logits.expand(num_samples, -1).contiguous()
    tokens = Sampler().sample(batch, _state(params, 8)).token_ids
    probs = torch.softmax(logits / temperature, dim=-1)
    order = probs.argsort(descending=True)
    mass_before = probs[order].cumsum(0) - probs[order]
    nucleus = order[mass_before < top_p]
    reference = torch.zeros(8)
    reference[nucleus] = probs[nucleus] / probs[nucleus].sum()
    assert 0 < (reference == 0).sum() < 8
    assert _chi_square(tokens, reference) < CHI2_P001[int((reference > 0).sum()) - 1]


def test_penalties_match_hand_computed_values():
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0, 3.0]])
    params = [SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)]
    state = _state(params, 5, outputs=[[1, 1, 2]], prompt_token_ids=[[0, 0]])
    penalized = apply_penalties(logits, state)
    # token 0: prompt only -> 2/2; token 1: twice in output -> -1*2 - 0.5*2 - 0.25;
    # token 2: once -> 0.5/2 - 0.5 - 0.25; tokens 3, 4 untouched.
    expected = torch.tensor([[1.0, -3.25, -0.5, 0.0, 3.0]])
    torch.testing.assert_close(penalized, expected, rtol=0, atol=0)


def test_penalties_only_on_rows_that_ask_and_greedy_sees_them():
    logits = torch.tensor([[3.0, 2.9, 0.0], [3.0, 2.9, 0.0]])
    params = [SamplingParams(temperature=0.0, presence_penalty=0.5), SamplingParams(temperature=0.0)]
    out = Sampler().sample(logits, _state(params, 3, outputs=[[0], [0]]))
    assert out.token_ids.tolist() == [1, 0]


def test_logprobs_are_log_softmax_of_raw_logits():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0.5, logprobs=3, repetition_penalty=1.5),
              SamplingParams(temperature=0.0, logprobs=5),
              SamplingParams(top_k=4)]
    out = Sampler(seed=1).sample(logits, _state(params, 40, outputs=[[1, 2], [], [3]]))
    reference = torch.log_softmax(logits, dim=-1)
    assert out.logprobs.top_token_ids.shape == (3, 5)
    top_values, top_ids = reference.topk(5, dim=-1)
    assert torch.equal(out.logprobs.top_token_ids, top_ids)
    torch.testing.assert_close(out.logprobs.top_logprobs, top_values)
    torch.testing.assert_close(
        out.logprobs.sampled_logprobs, reference.gather(-1, out.token_ids[:, None]).squeeze(-1)
    )


def test_logits_processor_forces_a_token_and_input_is_not_modified():
    logits = torch.zeros(2, 10)
    logits[:, 3] = 5.0
    original = logits.clone()

    def force_seven(token_ids, row):
        assert list(token_ids) == [4, 4]
        forced = torch.full_like(row, -math.inf)
        forced[7] = 0.0
        return forced

    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=2)]
    state = _state(params, 10, outputs=[[4, 4], [4, 4]], logits_processors=[[force_seven], [force_seven]])
    assert Sampler().sample(logits, state).token_ids.tolist() == [7, 7]
    assert torch.equal(logits, original)


def _mix32_reference(value: int) -> int:
    mask = 0xFFFFFFFF
    value ^= value >> 16
    value = (value * 0x21F0AAAD) & mask
    value ^= value >> 15
    value = (value * 0x735A2D97) & mask
    return value ^ (value >> 15)


def test_counter_hash_matches_exact_integer_reference():
    keys = [row_key(2**64 - 1, 3, 100), row_key(-5, 0, 0)]
    uniforms = uniform_from_keys(keys_to_tensor(keys, "cpu"), 300)
    for row, key in enumerate(keys):
        for token in (0, 1, 17, 299):
            low, high = key & 0xFFFFFFFF, key >> 32
            hashed = _mix32_reference(((_mix32_reference(token ^ low)) + high) & 0xFFFFFFFF)
            assert uniforms[row, token].item() == ((hashed >> 9) + 0.5) / 2**23


def test_logit_bias_shifts_and_bans_only_the_rows_that_ask():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(5))
    top = logits.argmax(-1)
    params = [SamplingParams(temperature=0.0, logit_bias={int(top[0]): -100.0}),  # the argmax banned
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, logit_bias={7: 100.0, 9: -3.0})]  # 7 all but forced
    before = logits.clone()
    out = Sampler(seed=0).sample(logits, _state(params, 40))
    expected_first = logits[0].clone()
    expected_first[top[0]] -= 100.0
    assert out.token_ids.tolist() == [int(expected_first.argmax()), int(top[1]), 7]
    assert torch.equal(logits, before)  # the caller's logits are not modified
    state = _state(params, 40)
    assert state.bias_index.tolist() == [[0, 2, 2], [int(top[0]), 7, 9]] and not state.bias_depends_on_outputs


def test_min_tokens_keeps_eos_and_stop_ids_out_until_reached():
    logits = torch.zeros(4, 10)
    logits[:, 2] = 5.0  # eos is every row's argmax
    logits[:, 3] = 4.0  # then the stop token id
    params = [SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3]),  # short: neither
              SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3]),  # reached: eos again
              SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True),  # eos is just a token
              SamplingParams(temperature=0.0)]
    outputs = [[5], [5, 6], [], []]
    state = _state(params, 10, outputs, eos_token_ids=(2,))
    out = Sampler(seed=0).sample(logits, state)
    assert out.token_ids.tolist() == [0, 2, 2, 2]  # row 0: eos and 3 at -inf, the first zero logit wins
    assert state.bias_depends_on_outputs
    assert not _state(params[1:], 10, outputs[1:], eos_token_ids=(2,)).bias_depends_on_outputs
    # a stop id beyond the vocabulary (legal: it never comes) is nothing to mask
    beyond = _state([SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3, 2**31 - 1])], 10, [[]])
    assert beyond.bias_index.tolist() == [[0], [3]]
    assert Sampler(seed=0).sample(logits[:1], beyond).token_ids.tolist() == [2]


def _fields(state):  # noqa: ANN001, ANN202
    from dataclasses import fields

    return {field.name: getattr(state, field.name) for field in fields(state)}


@pytest.mark.parametrize("options", [
    dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.7, top_p=0.9), dict(temperature=1.3, top_k=5),
    dict(temperature=0.5, min_p=0.1), dict(temperature=0.8, top_k=10_000),
])
def test_rows_of_one_plain_setting_build_what_the_row_by_row_path_builds(options):
    from cleave.engine import sampling_tensors

    params = [SamplingParams(max_tokens=9, **options) for _ in range(5)]  # equal, distinct objects
    assert sampling_tensors.uniform_plain(params)
    uniform = SamplingTensors.uniform(params[0], 5, 300, "cpu")
    by_row = SamplingTensors.from_params(params, vocab_size=300, device="cpu", output_token_ids=[[1]] * 5)
    expected = _fields(by_row)
    for name, value in _fields(uniform).items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, expected[name]) and value.dtype == expected[name].dtype, name
        else:
            assert value == expected[name], name


@pytest.mark.parametrize("other", [dict(temperature=0.6), dict(top_p=0.5), dict(top_k=3)])
def test_a_row_of_another_setting_takes_the_row_by_row_path(other):
    from cleave.engine import sampling_tensors

    rows = [SamplingParams(temperature=0.7) for _ in range(3)]
    assert not sampling_tensors.uniform_plain([*rows, SamplingParams(**{"temperature": 0.7, **other})])


@pytest.mark.parametrize("per_row", [
    dict(seed=3), dict(frequency_penalty=0.5), dict(presence_penalty=0.5), dict(repetition_penalty=1.2),
    dict(logit_bias={4: 1.0}), dict(min_tokens=2), dict(logprobs=2),
])
def test_options_with_per_row_state_take_the_row_by_row_path_even_when_every_row_shares_them(per_row):
    from cleave.engine import sampling_tensors

    assert not sampling_tensors.uniform_plain([SamplingParams(temperature=0.7, **per_row) for _ in range(3)])
