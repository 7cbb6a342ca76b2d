"""Structured outputs on token ids: a request's `StructuredOutput` compiled into a grammar
over the model's vocabulary (xgrammar, the grammar engine vLLM and SGLang use), and each
sample's `GrammarConstraint`, which fills the next token's allowed-token bitmask every step.

The sampler applies the bitmasks of a whole batch in one kernel
(`cleave.kernels.token_bitmask`). Samples with a constraint run in the engine's host-bound
step loop (the mask of step N + 1 depends on the token of step N), as samples with other
logits processors do.

Reasoning models think unconstrained: the constraint follows the think tags by token id.
Before the block opens, the mask is the grammar's first tokens plus the start tag's next
token, so the model may open its thinking or answer at once; inside the block nothing is
masked; after the end tag the grammar takes every token until a stop token ends the sample.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import structlog

from cleave.errors import InvalidArgument
from cleave.generation.reasoning import Phase
from cleave.generation.structured_output import StructuredKind, StructuredOutput

if TYPE_CHECKING:
    import torch

    from cleave.model.tokenizer import Tokenizer

log = structlog.get_logger(__name__)


class GrammarCompiler:
    """Compiles requests' constraints for one model's vocabulary (cached per constraint).

    Args:
        tokenizer: the model's tokenizer.
        vocab_size: the logits' width (may exceed the tokenizer's ids: padding rows).
        stop_token_ids: the tokens that may end a constrained answer (the model's eos ids).
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._building = threading.Lock()  # compiles run on several threads (`AsyncEngine.prepare`)
        self._built: Any = None  # xgrammar.GrammarCompiler, built on first use

    @property
    def _compiler(self) -> Any:
        """xgrammar's compiler for the vocabulary: its tables take ~1 s at 128k tokens, built
        once, by the first compile, while any other waits."""
        with self._building:
            if self._built is None:
                import transformers
                import xgrammar

                fast = transformers.PreTrainedTokenizerFast(tokenizer_object=self._tokenizer.backend)
                info = xgrammar.TokenizerInfo.from_huggingface(
                    fast, vocab_size=self.vocab_size, stop_token_ids=self._stop_token_ids or None
                )
                self._built = xgrammar.GrammarCompiler(info, max_threads=1)
            return self._built

    def build_tables(self) -> None:
        """Build the vocabulary's tables now rather than on the first compile."""
        self._compiler  # noqa: B018 (the property builds them)

    def build_tables_in_background(self) -> threading.Thread:
        """Start building the tables on a thread of their own (a GPU engine does, beside its
        weights load and graph capture: `LLMEngine`); a failure is logged, and the first
        compile builds them again and reports it."""

        def build() -> None:
            try:
                self.build_tables()
            except Exception as error:
                log.warning("grammar_tables_not_built", error=str(error))

        thread = threading.Thread(target=build, name="grammar-tables", daemon=True)
        thread.start()
        return thread

    def compile(self, spec: StructuredOutput, field: str = "structured_output") -> Any:
        """The compiled grammar of `spec`; InvalidArgument naming `field` when it has none, or
        when no token of the vocabulary can start an answer it accepts (JSON for a vocabulary
        without "{", a schema whose recursion never ends: `{"allOf": [{"$ref": "#"}]}`): such a
        request could only end at once, empty. (xgrammar compiles `{"anyOf": []}` to the empty
        answer, which a stop token starts.)"""
        compiler = self._compiler
        try:
            if spec.kind is StructuredKind.JSON_SCHEMA:
                compiled = compiler.compile_json_schema(spec.spec, any_whitespace=False, strict_mode=True)
            elif spec.kind is StructuredKind.JSON_OBJECT:
                compiled = compiler.compile_json_schema(_ANY_OBJECT, any_whitespace=False)
            elif spec.kind is StructuredKind.REGEX:
                compiled = compiler.compile_regex(spec.spec)
            else:
                compiled = compiler.compile_grammar(spec.ebnf_of_choices() if spec.kind is StructuredKind.CHOICE
                                                    else spec.spec)
        except (RuntimeError, ValueError) as error:  # xgrammar's parse errors: the request's fault
            text = str(error).strip()
            message = _without_source(text.splitlines()[-1]) if text else type(error).__name__
            raise InvalidArgument(f"cannot compile the {spec.kind.value}: {message}", field=field) from None
        if not self._can_start(compiled):
            raise InvalidArgument(f"no answer this model can write satisfies the {spec.kind.value}: no token of its "
                                  "vocabulary can start one", field=field)
        return compiled

    def _can_start(self, compiled: Any) -> bool:
        """Whether some token (a stop token included, for a grammar that accepts nothing at
        all) may begin an answer `compiled` accepts."""
        import xgrammar

        bitmask = xgrammar.allocate_token_bitmask(1, self.vocab_size)
        xgrammar.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask, 0)
        return bool(bitmask.any())

    def constraint(
        self,
        compiled: Any,
        start_tag_ids: Sequence[int] = (),
        end_tag_ids: Sequence[int] = (),
        starts_in_reasoning: bool = False,
        request_id: str = "",
    ) -> GrammarConstraint:
        """A new sample's constraint (`compiled` from `compile`; the think tags of a reasoning
        model, empty for others)."""
        import xgrammar

        return GrammarConstraint(xgrammar.GrammarMatcher(compiled), start_tag_ids, end_tag_ids,
                                 starts_in_reasoning, request_id, self._stop_token_ids)


_ANY_OBJECT = json.dumps({"type": "object"})


def _without_source(message: str) -> str:
    """xgrammar's messages open with "[time] /path/file.cc:line: "; keep what follows."""
    head, separator, rest = message.partition(": ")
    return rest if separator and (".cc:" in head or ".h:" in head) else message


class GrammarConstraint:
    """One sample's grammar state, fed the sample's tokens as they come.

    `fill_bitmask` is called once per step before sampling with the sample's output tokens
    so far; it returns False when the step is unconstrained (thinking, or the grammar gave
    up on a token it did not allow: a token the sample was given, not one it sampled).
    """

    def __init__(
        self,
        matcher: Any,  # xgrammar.GrammarMatcher
        start_tag_ids: Sequence[int],
        end_tag_ids: Sequence[int],
        starts_in_reasoning: bool,
        request_id: str = "",
        stop_token_ids: Sequence[int] = (),
    ) -> None:
        self._matcher = matcher
        self._stop_token_ids = list(stop_token_ids)
        self._start = list(start_tag_ids)
        self._end = list(end_tag_ids)
        if not self._end:
            self.phase = Phase.ANSWER
        elif starts_in_reasoning or not self._start:
            self.phase = Phase.REASONING
        else:
            self.phase = Phase.BEFORE
        self._tag_matched = 0  # tokens of the tag being read (start before, end during)
        self._num_seen = 0
        self._request_id = request_id
        self.failed = False

    @property
    def is_terminated(self) -> bool:
        """The answer is complete (the grammar accepted a stop token)."""
        return self._matcher.is_terminated()

    def fill_bitmask(self, output_token_ids: Sequence[int], bitmask: torch.Tensor, index: int) -> bool:
        """Write the allowed next tokens into row `index` of `bitmask` ([R, W] int32, host);
        False (row untouched) when the next token is free."""
        for token_id in output_token_ids[self._num_seen:]:
            self._feed(token_id)
        self._num_seen = len(output_token_ids)
        if self.failed or self.phase is Phase.REASONING or self._matcher.is_terminated():
            return False
        if self.phase is Phase.BEFORE and self._tag_matched:  # inside the start tag: finish it
            bitmask[index].zero_()
            _allow(bitmask, index, self._start[self._tag_matched])
            return True
        self._matcher.fill_next_token_bitmask(bitmask, index)
        if not bool(bitmask[index].any()):  # a constraint nothing satisfies ({"anyOf": []}): end the sample
            log.warning("grammar_allows_nothing", request_id=self._request_id)
            for token_id in self._stop_token_ids:
                _allow(bitmask, index, token_id)
            self.failed = True
        if self.phase is Phase.BEFORE:
            _allow(bitmask, index, self._start[0])
        return True

    def _feed(self, token_id: int) -> None:
        if self.failed:
            return
        if self.phase is Phase.REASONING:
            if token_id == self._end[self._tag_matched]:
                self._tag_matched += 1
            else:
                self._tag_matched = 1 if token_id == self._end[0] else 0
            if self._tag_matched == len(self._end):
                self.phase, self._tag_matched = Phase.ANSWER, 0
            return
        if self.phase is Phase.BEFORE:
            if token_id == self._start[self._tag_matched]:
                self._tag_matched += 1
                if self._tag_matched == len(self._start):
                    self.phase, self._tag_matched = Phase.REASONING, 0
                return
            self.phase = Phase.ANSWER
        if not self._matcher.is_terminated() and not self._matcher.accept_token(token_id):
            self.failed = True
            log.warning("grammar_gave_up", request_id=self._request_id, token_id=token_id,
                        reason="a token the grammar does not allow was given to the sample")


def _allow(bitmask: torch.Tensor, index: int, token_id: int) -> None:
    word, bit = divmod(token_id, 32)
    value = int(bitmask[index, word]) & 0xFFFFFFFF | (1 << bit)
    bitmask[index, word] = value - (1 << 32) if value >= 1 << 31 else value
