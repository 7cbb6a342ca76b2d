"""Per-request engine state: each sample's detokenizer, stop checker and reasoning parser.

Token ids come from the scheduler; text is made here. Per generated token a sample runs
`StopChecker.process` (which drives its `IncrementalDetokenizer`), then its
`ReasoningParser` splits the new text into thinking and answer (the tags' special tokens,
which the detokenizer skips, put back for it). An engine that makes no
text (`detokenize` off) gives samples no detokenizer: a token then runs through the
token-id stops only, and a `ReasoningTokenCounter` counts thinking tokens. What a sample produced
since the last report accumulates in its pending delta until `RequestState.take_output`
turns the request's news into one `RequestOutput`.

`OutputAccumulator` folds a stream of delta outputs back into one complete output (what
the offline `LLM.generate` returns).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from cleave.engine.reasoning_tokens import ReasoningTokenCounter
from cleave.engine.sampling_tensors import LogitsProcessor
from cleave.engine.sequence import Sequence, SequenceStatus
from cleave.generation.detokenizer import IncrementalDetokenizer
from cleave.generation.outputs import CompletionOutput, FinishReason, RequestOutput, TokenLogprob, Usage
from cleave.generation.reasoning import ReasoningParser
from cleave.generation.sampling_params import SamplingParams
from cleave.generation.stop import StopChecker, TokenStop

_STATUS_OF_REASON = {
    FinishReason.STOP: SequenceStatus.FINISHED_STOPPED,
    FinishReason.LENGTH: SequenceStatus.FINISHED_LENGTH,
    FinishReason.ABORT: SequenceStatus.FINISHED_ABORTED,
}
_REASON_OF_STATUS = {
    SequenceStatus.FINISHED_STOPPED: FinishReason.STOP,
    SequenceStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    SequenceStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


@dataclass(eq=False)
class SampleState:
    """Text-side state of one sample and what it produced since the last report.

    `detokenizer` None means token ids only: no text, stop strings or reasoning split;
    `reasoning_counter` then counts thinking tokens by id.
    """

    index: int
    seq: Sequence
    detokenizer: IncrementalDetokenizer | None
    stop_checker: StopChecker
    reasoning: ReasoningParser | None
    include_reasoning: bool
    logits_processors: list[LogitsProcessor] = field(default_factory=list)
    reasoning_counter: ReasoningTokenCounter | None = None
    # The reasoning tags' special tokens, by id, with their text: skipped by the detokenizer,
    # put back for the parser (`special_tag_tokens`; empty unless special tokens are skipped).
    tag_tokens: Mapping[int, str] = field(default_factory=dict)
    # With a detokenizer and no stop strings, stopping depends on token ids alone, so text
    # can be made later (while the device runs the next step): `deferred` holds ids not yet
    # detokenized.
    defer_text: bool = False
    deferred: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    cumulative_logprob: float | None = None
    num_tokens: int = 0
    # pending delta
    text: list[str] = field(default_factory=list)
    reasoning_text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    has_news: bool = False
    # Text with nothing to split (no reasoning parser) or search (no stop strings): it goes
    # straight to the delta.
    plain_text: bool = field(init=False)

    def __post_init__(self) -> None:
        self.plain_text = (
            self.detokenizer is not None and self.reasoning is None and not self.stop_checker.has_stop_strings
        )

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def process_token(self, token_id: int, logprob: TokenLogprob | None = None) -> SequenceStatus | None:
        """Run one generated token through stop checks, detokenizer and reasoning parser.

        Returns the FINISHED_* status the sequence should take, or None to continue.
        """
        self.num_tokens += 1
        self.token_ids.append(token_id)
        self.has_news = True
        if logprob is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.append(logprob)
            self.cumulative_logprob = (self.cumulative_logprob or 0.0) + logprob.logprob
        if self.defer_text:  # the common case first: one id check, text later
            token_stop = self.stop_checker.check_token(token_id)
            if token_stop is None:
                self.deferred.append(token_id)
                return None
            return self._finish_deferred(token_id, token_stop)
        if self.detokenizer is None:
            return self._process_token_id(token_id)
        update = self.stop_checker.process(token_id, self.detokenizer)
        self._add_text(update.text + self.tag_tokens.get(token_id, ""))
        if update.finish_reason is None:
            return None
        self._finish(update.finish_reason, update.stop_reason)
        return _STATUS_OF_REASON[update.finish_reason]

    def _finish_deferred(self, token_id: int, token_stop: TokenStop) -> SequenceStatus:
        """A deferred-text sample's last token: its text (if it belongs to the output), then the end."""
        detokenizer = self.detokenizer
        assert detokenizer is not None  # defer_text implies a detokenizer
        self.flush_text()
        text = detokenizer.push(token_id) if token_stop.include_token_text else ""
        update = self.stop_checker.append_text(text + detokenizer.finish(), final=True)
        self._add_text(update.text + (self.tag_tokens.get(token_id, "") if token_stop.include_token_text else ""))
        if update.finish_reason is None:
            update.finish_reason, update.stop_reason = token_stop.finish_reason, token_stop.stop_reason
        self._finish(update.finish_reason, update.stop_reason)
        return _STATUS_OF_REASON[update.finish_reason]

    def _process_token_id(self, token_id: int) -> SequenceStatus | None:
        """Token-only path: count thinking tokens, apply the stops decided by the id."""
        if self.reasoning_counter is not None:
            self.reasoning_counter.feed(token_id)
        token_stop = self.stop_checker.check_token(token_id)
        if token_stop is None:
            return None
        self._finish(token_stop.finish_reason, token_stop.stop_reason)
        return _STATUS_OF_REASON[token_stop.finish_reason]

    def flush_text(self) -> None:
        """Detokenize the deferred token ids (their text joins the pending delta)."""
        deferred = self.deferred
        if not deferred:
            return
        detokenizer = self.detokenizer
        if self.plain_text:  # the text goes straight to the delta, joined
            text = detokenizer.push(deferred[0]) if len(deferred) == 1 else detokenizer.push_many(deferred)
            if text:
                self.text.append(text)
        else:
            stop_checker, tags = self.stop_checker, self.tag_tokens
            for token_id in deferred:
                self._add_text(stop_checker.append_text(detokenizer.push(token_id)).text + tags.get(token_id, ""))
        deferred.clear()
        self.has_news = True

    def end(self, status: SequenceStatus) -> None:
        """The scheduler ended the sequence (context full, abort): flush and record why."""
        if self.finished:
            return
        self.flush_text()
        if status is not SequenceStatus.FINISHED_ABORTED and self.detokenizer is not None:
            self._add_text(self.stop_checker.append_text(self.detokenizer.finish(), final=True).text)
        self._finish(_REASON_OF_STATUS.get(status, FinishReason.ERROR), None)

    def _add_text(self, text: str) -> None:
        if self.reasoning is None:
            if text:
                self.text.append(text)
            return
        delta = self.reasoning.feed(text)
        if delta.content:
            self.text.append(delta.content)
        if delta.reasoning and self.include_reasoning:
            self.reasoning_text.append(delta.reasoning)

    def _finish(self, reason: FinishReason, stop_reason: str | int | None) -> None:
        if self.reasoning is not None:
            delta = self.reasoning.finish()
            if delta.content:
                self.text.append(delta.content)
            if delta.reasoning and self.include_reasoning:
                self.reasoning_text.append(delta.reasoning)
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.has_news = True

    def take_delta(self) -> CompletionOutput:
        """What this sample produced since the previous call (running counts are totals)."""
        text, reasoning_text = self.text, self.reasoning_text
        # Positional: this runs once per sample per step.
        output = CompletionOutput(
            self.index,
            text[0] if len(text) == 1 else "".join(text),
            self.token_ids,
            "".join(reasoning_text) if reasoning_text else "",
            self.finish_reason,
            self.stop_reason,
            self.logprobs,
            self.cumulative_logprob,
            self.num_tokens,
            self.num_reasoning_tokens,
        )
        # The pieces are joined above, so the lists are reused (the token id list is handed out).
        if text:
            text.clear()
        if reasoning_text:
            reasoning_text.clear()
        self.token_ids = []
        if self.logprobs is not None:
            self.logprobs = []
        self.has_news = False
        return output

    @property
    def num_reasoning_tokens(self) -> int:
        if self.reasoning is not None:
            return self.reasoning.num_reasoning_tokens
        if self.reasoning_counter is not None:
            return self.reasoning_counter.num_reasoning_tokens
        return 0


@dataclass(eq=False)
class RequestState:
    """One request inside the engine: its prompt, parameters and samples."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[SampleState]
    prefill_only: bool = False
    prefill_done: bool = False  # every sample of a prefill-only request drew its first token
    reported_prompt: bool = False
    report_phase: int = 0  # with staggered reports: reports when (step + report_phase) % interval == 0
    # with params.prompt_logprobs: scores of the prompt tokens so far ([None] for the first)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    num_prompt_logprobs_reported: int = 0

    # Loops rather than all()/any()/sum() over generators: these run once per request per step.

    @property
    def finished(self) -> bool:
        for sample in self.samples:
            if sample.finish_reason is None:
                return False
        return True

    @property
    def has_news(self) -> bool:
        for sample in self.samples:
            if sample.has_news:
                return True
        return False

    def usage(self) -> Usage:
        num_prompt = len(self.prompt_token_ids)
        completion = reasoning = 0
        for sample in self.samples:
            completion += sample.num_tokens
            reasoning += sample.num_reasoning_tokens
        return Usage(
            prompt_tokens=num_prompt,
            completion_tokens=completion,
            reasoning_tokens=reasoning,
            cached_prompt_tokens=min(self.samples[0].seq.num_cached_tokens, num_prompt),
        )

    def add_prompt_logprobs(self, first_position: int, entries: list[TokenLogprob]) -> bool:
        """Scores of the prompt tokens from `first_position` on; False (and nothing kept)
        when they are not the next ones (a preempted request re-running its prompt)."""
        if not self.prompt_logprobs:
            self.prompt_logprobs.append(None)  # the first prompt token has no score
        if first_position != len(self.prompt_logprobs):
            return False
        self.prompt_logprobs.extend(entries)
        return True

    def _take_prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        if self.params.prompt_logprobs is None:
            return None
        if not self.prompt_logprobs and len(self.prompt_token_ids) == 1:
            self.prompt_logprobs.append(None)  # a one-token prompt has nothing to score
        new = self.prompt_logprobs[self.num_prompt_logprobs_reported :]
        self.num_prompt_logprobs_reported = len(self.prompt_logprobs)
        return new

    def take_output(self) -> RequestOutput:
        """A delta RequestOutput of every sample with news (the prompt on the first one)."""
        samples = self.samples
        if self.reported_prompt:
            prompt = []
        else:
            prompt = self.prompt_token_ids
            self.reported_prompt = True
        if len(samples) == 1:  # the common case, without the loops of `usage` and `finished`
            sample = samples[0]
            if sample.has_news:
                delta = sample.take_delta()
                outputs = [delta]
                num_reasoning = delta.num_reasoning_tokens
            else:
                outputs = []
                num_reasoning = sample.num_reasoning_tokens
            num_prompt = len(self.prompt_token_ids)
            num_cached = sample.seq.num_cached_tokens
            usage = Usage(num_prompt, sample.num_tokens, num_reasoning, num_cached if num_cached < num_prompt else num_prompt)
            output = RequestOutput(self.request_id, prompt, outputs, sample.finish_reason is not None, usage, True)
        else:
            outputs = [sample.take_delta() for sample in samples if sample.has_news]
            output = RequestOutput(self.request_id, prompt, outputs, self.finished, self.usage(), True)
        if self.params.prompt_logprobs is not None:
            output.prompt_logprobs = self._take_prompt_logprobs()
        return output


class OutputAccumulator:
    """Folds delta `RequestOutput`s of one request into a complete (non-delta) one."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.prompt_token_ids: list[int] = []
        self._samples: dict[int, CompletionOutput] = {}
        self._text: dict[int, list[str]] = {}
        self._reasoning: dict[int, list[str]] = {}
        self.finished = False
        self.usage = Usage()
        self.prompt_logprobs: list[TokenLogprob | None] | None = None

    def add(self, delta: RequestOutput) -> None:
        if delta.prompt_token_ids:
            self.prompt_token_ids = list(delta.prompt_token_ids)
        self.finished = delta.finished
        self.usage = delta.usage
        if delta.prompt_logprobs is not None:  # extended in place: a long output is not copied per delta
            if self.prompt_logprobs is None:
                self.prompt_logprobs = []
            self.prompt_logprobs.extend(delta.prompt_logprobs)
        for piece in delta.outputs:
            sample = self._samples.get(piece.index)
            if sample is None:
                sample = self._samples[piece.index] = CompletionOutput(index=piece.index)
                self._text[piece.index], self._reasoning[piece.index] = [], []
            self._text[piece.index].append(piece.text)
            self._reasoning[piece.index].append(piece.reasoning_text)
            sample.token_ids.extend(piece.token_ids)
            if piece.logprobs is not None:
                if sample.logprobs is None:
                    sample.logprobs = []
                sample.logprobs.extend(piece.logprobs)
            sample.finish_reason = piece.finish_reason
            sample.stop_reason = piece.stop_reason
            sample.cumulative_logprob = piece.cumulative_logprob
            sample.num_tokens = piece.num_tokens
            sample.num_reasoning_tokens = piece.num_reasoning_tokens

    def result(self) -> RequestOutput:
        outputs = []
        for index in sorted(self._samples):
            sample = self._samples[index]
            sample.text = "".join(self._text[index])
            sample.reasoning_text = "".join(self._reasoning[index])
            outputs.append(sample)
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=self.finished,
            usage=self.usage,
            delta=False,
            prompt_logprobs=self.prompt_logprobs,
        )

