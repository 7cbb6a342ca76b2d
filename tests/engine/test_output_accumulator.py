"""OutputAccumulator folds a request's delta outputs into the whole: text, reasoning, token
ids, logprobs and prompt logprobs in order, the last delta's finish and counts."""

from __future__ import annotations

from cleave.engine.request import OutputAccumulator
from cleave.generation.outputs import CompletionOutput, FinishReason, RequestOutput, TokenLogprob


def logprob(token_id: int) -> TokenLogprob:
    return TokenLogprob(token_id, -0.5 * token_id, [token_id], [-0.5 * token_id])


def delta(index: int, token_ids: list[int], text: str, finish: FinishReason | None = None, **request) -> RequestOutput:
    piece = CompletionOutput(index=index, text=text, reasoning_text=text.upper(), token_ids=list(token_ids),
                             logprobs=[logprob(t) for t in token_ids], finish_reason=finish,
                             num_tokens=token_ids[-1] if token_ids else 0)
    request.setdefault("prompt_token_ids", [])
    return RequestOutput(request_id="r", outputs=[piece], finished=finish is not None, **request)


def test_deltas_fold_into_the_whole_output_in_order():
    accumulator = OutputAccumulator("r")
    accumulator.add(delta(0, [1, 2], "ab", prompt_token_ids=[9, 8], prompt_logprobs=[None, logprob(8)]))
    accumulator.add(delta(1, [5], "x"))
    accumulator.add(delta(0, [3], "c", prompt_logprobs=[logprob(7)]))
    accumulator.add(delta(1, [6, 7], "yz", FinishReason.LENGTH))
    accumulator.add(delta(0, [4], "d", FinishReason.STOP))
    result = accumulator.result()
    first, second = result.outputs
    assert (first.text, first.reasoning_text, first.token_ids) == ("abcd", "ABCD", [1, 2, 3, 4])
    assert [entry.token_id for entry in first.logprobs] == [1, 2, 3, 4]
    assert (second.text, second.token_ids, second.finish_reason) == ("xyz", [5, 6, 7], FinishReason.LENGTH)
    assert [entry.token_id for entry in second.logprobs] == [5, 6, 7]
    assert (first.finish_reason, first.num_tokens, result.finished) == (FinishReason.STOP, 4, True)
    assert result.prompt_token_ids == [9, 8]
    assert result.prompt_logprobs == [None, logprob(8), logprob(7)]
