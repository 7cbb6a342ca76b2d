"""Engine outputs -> stream deltas: what a decode worker puts on a gateway's step stream.

The engine reports, per step, one delta `RequestOutput` per request with news (new token
ids, text, running counts). The step stream carries token ids only — the gateway holds the
tokenizer and detokenizes for its clients — plus finish reasons, logprobs and how many of
the new tokens were thinking tokens (the engine's reasoning count is a running total; the
delta carries the difference), and a prompt's scores when the request asked for them.
"""

from __future__ import annotations

from collections.abc import Sequence

from cleave.generation.outputs import RequestOutput
from cleave.generation.outputs import TokenLogprob as EngineLogprob
from cleave.rpc.types import RequestDelta, TokenLogprob, TopLogprobs


def top_logprobs_from_engine(logprob: EngineLogprob) -> TopLogprobs:
    """The engine's logprob of one token as the wire's TopLogprobs (ranks are 1-based; the
    sampled token's rank is 0 when the engine did not rank it and it is not among the
    returned alternatives)."""
    top = tuple(
        TokenLogprob(token_id=token_id, logprob=value, rank=rank)
        for rank, (token_id, value) in enumerate(zip(logprob.top_token_ids, logprob.top_logprobs), start=1)
    )
    rank = logprob.rank or next((entry.rank for entry in top if entry.token_id == logprob.token_id), 0)
    return TopLogprobs(sampled=TokenLogprob(token_id=logprob.token_id, logprob=logprob.logprob, rank=rank), top=top)


class DeltaBuilder:
    """Converts engine delta outputs into RequestDeltas, tracking per-sample running counts."""

    def __init__(self) -> None:
        self._reasoning_totals: dict[tuple[str, int], int] = {}

    def build(self, output: RequestOutput, leading_logprobs: Sequence[TopLogprobs] = ()) -> list[RequestDelta]:
        """Deltas of one request's output (samples without new tokens or a finish are left
        out). `leading_logprobs` belong to tokens the engine did not sample itself: entry i
        is the logprob of sample i's first token, drawn by a prefill worker, and goes before
        the engine's own logprobs of that sample."""
        deltas: list[RequestDelta] = []
        prompt_logprobs = tuple(top_logprobs_from_engine(lp) for lp in output.prompt_logprobs or () if lp is not None)
        totals = self._reasoning_totals
        request_id = output.request_id
        for sample in output.outputs:
            token_ids, finish_reason, reasoning = sample.token_ids, sample.finish_reason, sample.num_reasoning_tokens
            if not token_ids and finish_reason is None:
                continue
            # Running reasoning totals are kept only while non-zero: most requests never think,
            # and this runs once per sample per step.
            key = (request_id, sample.index)
            previous = totals.pop(key, 0) if finish_reason is not None else totals.get(key, 0)
            if finish_reason is None and reasoning:
                totals[key] = reasoning
            logprobs: tuple[TopLogprobs, ...] = ()
            if sample.logprobs:
                logprobs = tuple(top_logprobs_from_engine(lp) for lp in sample.logprobs)
            if sample.index < len(leading_logprobs):
                logprobs = (leading_logprobs[sample.index], *logprobs)
            if logprobs and len(logprobs) != len(token_ids):
                logprobs = ()  # never misalign logprobs with tokens
            # Positional: RequestDelta's field order.
            deltas.append(RequestDelta(
                request_id, sample.index, tuple(token_ids), finish_reason, logprobs, None,
                reasoning - previous if reasoning > previous else 0,
                () if deltas else prompt_logprobs,  # on the request's first delta here
            ))
        if prompt_logprobs and not deltas:  # scores without tokens: a delta of their own
            deltas.append(RequestDelta(output.request_id, 0, (), prompt_logprobs=prompt_logprobs))
        return deltas

    def forget(self, request_id: str) -> None:
        """Drop the counts of a request that ended outside the engine."""
        for key in [key for key in self._reasoning_totals if key[0] == request_id]:
            del self._reasoning_totals[key]
