"""DeltaBuilder: engine delta outputs -> the step stream's RequestDeltas."""

from __future__ import annotations

from cleave.generation.outputs import CompletionOutput, RequestOutput, TokenLogprob
from cleave.rpc.types import TokenLogprob as WireLogprob
from cleave.rpc.types import TopLogprobs
from cleave.worker import DeltaBuilder


def step(request_id: str, *samples: CompletionOutput, prompt_logprobs=None) -> RequestOutput:
    output = RequestOutput(request_id, [], list(samples))
    output.prompt_logprobs = prompt_logprobs
    return output


def sample(index: int, token_ids: list[int], reasoning: int = 0, finish=None, logprobs=None) -> CompletionOutput:
    return CompletionOutput(index, "", token_ids, "", finish, None, logprobs, None, 0, reasoning)


def test_running_reasoning_totals_become_per_delta_counts_per_sample():
    builder = DeltaBuilder()
    counts = []
    for totals in [(0, 1), (2, 2), (3, 2), (3, 2)]:
        deltas = builder.build(step("r", sample(0, [7], reasoning=totals[0]), sample(1, [8], reasoning=totals[1])))
        counts.append([delta.num_reasoning_tokens for delta in deltas])
    assert counts == [[0, 1], [2, 1], [1, 0], [0, 0]]
    (last,) = builder.build(step("r", sample(0, [9], reasoning=5, finish="stop")))
    assert last.num_reasoning_tokens == 2 and last.finish_reason == "stop"
    # a finished sample's total is gone: the same key starts again from zero
    (again,) = builder.build(step("r", sample(0, [9], reasoning=1)))
    assert again.num_reasoning_tokens == 1


def test_forget_drops_a_requests_totals():
    builder = DeltaBuilder()
    builder.build(step("a", sample(0, [1], reasoning=4)))
    builder.build(step("b", sample(0, [1], reasoning=4)))
    builder.forget("a")
    assert builder.build(step("a", sample(0, [1], reasoning=4)))[0].num_reasoning_tokens == 4
    assert builder.build(step("b", sample(0, [1], reasoning=4)))[0].num_reasoning_tokens == 0


def test_samples_without_news_are_left_out_and_a_finish_alone_is_kept():
    builder = DeltaBuilder()
    deltas = builder.build(step("r", sample(0, []), sample(1, [], finish="length"), sample(2, [3, 4])))
    assert [(d.sample_index, d.token_ids, d.finish_reason) for d in deltas] == [(1, (), "length"), (2, (3, 4), None)]


def test_logprobs_follow_tokens_with_the_prefill_workers_first_one_in_front():
    builder = DeltaBuilder()
    leading = TopLogprobs(sampled=WireLogprob(token_id=5, logprob=-0.5, rank=1))
    engine = [TokenLogprob(6, -0.25, [6, 2], [-0.25, -2.0])]
    (delta,) = builder.build(step("r", sample(0, [5, 6], logprobs=engine)), leading_logprobs=[leading])
    assert delta.logprobs[0] == leading
    assert delta.logprobs[1].sampled == WireLogprob(token_id=6, logprob=-0.25, rank=1)
    assert [t.token_id for t in delta.logprobs[1].top] == [6, 2]
    # a count that does not match the tokens is dropped, never misaligned
    (short,) = builder.build(step("r", sample(0, [5, 6]), ), leading_logprobs=[leading])
    assert short.logprobs == ()


def test_prompt_logprobs_ride_on_the_first_delta_only_or_alone():
    builder = DeltaBuilder()
    prompt = [None, TokenLogprob(3, -1.0, [3], [-1.0])]
    first, second = builder.build(step("r", sample(0, [1]), sample(1, [2]), prompt_logprobs=prompt))
    assert len(first.prompt_logprobs) == 1 and second.prompt_logprobs == ()
    (alone,) = builder.build(step("q", prompt_logprobs=prompt))
    assert alone.token_ids == () and len(alone.prompt_logprobs) == 1


def test_a_prompt_tokens_rank_from_the_engine_is_kept_where_the_alternatives_miss_it():
    (delta,) = DeltaBuilder().build(step("r", prompt_logprobs=[None, TokenLogprob(3, -4.0, [8], [-0.5], rank=57)]))
    assert delta.prompt_logprobs[0].sampled == WireLogprob(token_id=3, logprob=-4.0, rank=57)
    assert delta.prompt_logprobs[0].top == (WireLogprob(token_id=8, logprob=-0.5, rank=1),)
