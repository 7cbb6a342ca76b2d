"""Requests from prompts: tokenize, validate and build a `RequestState` with its samples.

`RequestBuilder` holds what building needs (tokenizer, reasoning tags, limits) and touches
no engine state, so `LLMEngine.prepare_request` may run it on any thread. Each sample gets
its stop checker, a detokenizer (engines that make text) or a reasoning token counter
(engines that do not), a thinking-budget logits processor when the request asks for one,
and its grammar's constraint when the request has a structured output.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from typing import Any, Union

from cleave.engine.grammar import GrammarCompiler
from cleave.engine.reasoning_tokens import ReasoningTokenCounter
from cleave.engine.request import RequestState, SampleState
from cleave.engine.sampling_tensors import LogitsProcessor
from cleave.engine.sequence import Sequence
from cleave.engine.thinking_budget import ThinkingBudget
from cleave.errors import InvalidArgument
from cleave.generation.detokenizer import IncrementalDetokenizer
from cleave.generation.reasoning import ReasoningConfig, ReasoningParser
from cleave.generation.reasoning_formats import special_tag_tokens
from cleave.generation.sampling_params import SamplingParams
from cleave.generation.stop import StopChecker
from cleave.generation.token_pieces import TokenPieces
from cleave.kv.prefix_hash import salt_root
from cleave.model.tokenizer import Tokenizer

Message = dict[str, Any]
Prompt = Union[str, Seq[int], Seq[Message]]


class RequestBuilder:
    """Builds validated request states for one model and engine configuration.

    Args:
        tokenizer: the model's tokenizer.
        vocab_size: token ids in prompts must be below it.
        reasoning: the model's thinking tags, or None for a model without them.
        eos_token_ids: tokens that end a sample (unless its params ignore eos).
        max_model_len: context limit (prompt plus output tokens).
        max_num_seqs: the most samples one request may ask for.
        detokenize: whether samples make text (else token ids only).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        reasoning: ReasoningConfig | None,
        eos_token_ids: frozenset[int],
        max_model_len: int,
        max_num_seqs: int,
        detokenize: bool,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.reasoning = reasoning
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.detokenize = detokenize
        # One piece table for every detokenizer of this engine (None: the tokenizer's
        # text depends on neighbouring tokens, every token is decoded).
        self._pieces = TokenPieces.for_tokenizer(tokenizer) if detokenize else None
        self._end_tag_ids: list[int] = []
        self._start_tag_ids: list[int] = []
        self._answer_prefix_ids: list[int] = []
        self._end_opens_with_marker = False  # min_thinking_tokens forbids the tag's first token
        if reasoning is not None:
            self._end_tag_ids = tokenizer.encode(reasoning.end_tag, add_special_tokens=False)
            self._start_tag_ids = tokenizer.encode(reasoning.start_tag, add_special_tokens=False)
            self._answer_prefix_ids = tokenizer.encode(reasoning.answer_prefix, add_special_tokens=False)
            self._end_opens_with_marker = bool(self._end_tag_ids) and tokenizer.is_special(self._end_tag_ids[0])
        self._tag_tokens = special_tag_tokens(tokenizer, reasoning) if detokenize else {}
        self.grammars = GrammarCompiler(tokenizer, vocab_size, sorted(eos_token_ids))

    def encode_prompt(self, prompt: Prompt, raw: bool = False) -> list[int]:
        """Token ids of a prompt: text (chat template for chat models unless `raw`), a
        message list (always templated) or token ids (checked against the vocabulary)."""
        if not prompt:
            raise InvalidArgument("is empty; send text, messages or at least one token id", field="prompt")
        if isinstance(prompt, str):
            if raw or self.tokenizer.chat_template is None:
                return self.tokenizer.encode(prompt)
            prompt = [{"role": "user", "content": prompt}]
        first = prompt[0]
        if isinstance(first, dict):
            text = self.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True)  # type: ignore[arg-type]
            return self.tokenizer.encode(text, add_special_tokens=False)
        token_ids = list(prompt)
        vocab_size = self.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
            raise InvalidArgument("must be a string, a list of messages or a list of token ids", field="prompt")
        if min(token_ids) < 0 or max(token_ids) >= vocab_size:
            raise InvalidArgument(f"token ids must be in [0, {vocab_size}) for this model", field="prompt")
        return token_ids

    def build(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        priority: int | None = None,
        arrival_time: float | None = None,
        *,
        raw: bool = False,
        prefill_only: bool = False,
    ) -> RequestState:
        """Tokenize and validate a request and build its state. Raises InvalidArgument
        naming the bad field. `priority` None: the params' (lower is scheduled first)."""
        if not isinstance(request_id, str) or not request_id or "/" in request_id:
            raise InvalidArgument("must be a non-empty string without '/'", field="request_id")
        params = SamplingParams() if params is None else params
        prompt_ids = self.encode_prompt(prompt, raw)
        params.validate(self.max_model_len, len(prompt_ids), self.vocab_size)
        max_num_seqs = self.max_num_seqs
        if params.n > max_num_seqs:  # the samples run at once: more could never be admitted
            raise InvalidArgument(f"must be at most max_num_seqs ({max_num_seqs}) on this engine", field="n")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        priority = params.priority if priority is None else priority
        root = salt_root(params.cache_salt)
        seqs = [Sequence(request_id, prompt_ids, i, params, priority, arrival, hash_root=root) for i in range(params.n)]
        max_new = params.max_new_tokens(self.max_model_len, len(prompt_ids))
        for seq in seqs:  # a prefill-only request ends on its first token
            seq.limit_output_tokens(1 if prefill_only else max_new)
        grammar = None if params.structured_output is None else self.grammars.compile(params.structured_output)
        samples = [self._new_sample(seq, params, prompt_ids, max_new, grammar) for seq in seqs]
        return RequestState(request_id, prompt_ids, params, samples, prefill_only=prefill_only)

    def _new_sample(
        self, seq: Sequence, params: SamplingParams, prompt_ids: list[int], max_new: int, grammar: Any = None
    ) -> SampleState:
        reasoning = None
        counter = None
        processors: list[LogitsProcessor] = []
        detokenize = self.detokenize
        if self.reasoning is not None:
            if detokenize:
                reasoning = ReasoningParser.for_config(self.reasoning)
            elif self._end_tag_ids and (self._start_tag_ids or self.reasoning.starts_in_reasoning):
                counter = ReasoningTokenCounter(
                    self._start_tag_ids, self._end_tag_ids, self.reasoning.starts_in_reasoning, self._is_blank_token
                )
            budget = ThinkingBudget.from_params(
                params, self._end_tag_ids, self._start_tag_ids, self.reasoning.starts_in_reasoning,
                () if grammar is not None else self._answer_prefix_ids,  # the grammar opens the answer
                self._end_opens_with_marker,
            )
            if budget is not None:
                processors.append(budget)
        if grammar is not None:
            starts_in_reasoning = self.reasoning is not None and self.reasoning.starts_in_reasoning
            processors.append(self.grammars.constraint(
                grammar, self._start_tag_ids, self._end_tag_ids, starts_in_reasoning, seq.request_id))
        return SampleState(
            index=seq.sample_index,
            seq=seq,
            detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens, self._pieces)
            if detokenize
            else None,
            stop_checker=StopChecker(params, self.eos_token_ids, max_new),
            reasoning=reasoning,
            include_reasoning=params.include_reasoning,
            logits_processors=processors,
            defer_text=detokenize and not params.stop,
            reasoning_counter=counter,
            tag_tokens=self._tag_tokens if reasoning is not None and params.skip_special_tokens else {},
        )

    def _is_blank_token(self, token_id: int) -> bool:
        """Whether a token's text is whitespace only (blank tokens may precede a think tag)."""
        return not self.tokenizer.decode([token_id], skip_special_tokens=True).strip()
