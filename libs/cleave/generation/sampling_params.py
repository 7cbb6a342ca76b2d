"""Per-request sampling parameters and their validation.

`SamplingParams` is the typed form of a request's generation options as the gateway
receives them; `validate()` rejects bad values with `InvalidArgument` naming the field, so
a service answers INVALID_ARGUMENT before any work is scheduled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from cleave.errors import InvalidArgument
from cleave.generation.structured_output import StructuredOutput

# OpenAI caps top_logprobs at 20; larger values cost a [B, K] top-k per step for little use.
MAX_LOGPROBS = 20
# OpenAI's documented range for frequency and presence penalties.
MAX_ABS_ADDITIVE_PENALTY = 2.0
SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1
# Below this temperature a row is sampled greedily (argmax).
GREEDY_TEMPERATURE = 1e-5
# OpenAI's range for a logit bias (-100 bans a token, 100 all but forces it), and how many
# tokens one request may bias.
MAX_ABS_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_TOKENS = 1024
# Every stop string is searched for after every token of every sample (on the gateway's event
# loop, where thousands of them stalled every other stream); OpenAI takes 4. Output that could
# still become a stop string is held back and searched again with each token, so a stop
# string's length bounds that work too (`cleave.generation.stop`; bench/stop_strings.py times
# 64 stop strings of this length followed and then broken).
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
# Each hop converts and checks a request's stop token ids one by one (gateway, prefill and
# decode workers, each on its event loop): a 30 MB message of them held a worker's loop so long
# that its health checks went unanswered and the gateway dropped it. A vocabulary's special
# tokens number in the hundreds.
MAX_STOP_TOKEN_IDS = 1024
# A cache salt is hashed once per admission; 256 characters hold any random key (vLLM
# suggests 43 base64 characters, 256 bits) or a tenant's name and a key.
MAX_CACHE_SALT_CHARS = 256
# A priority travels as a protobuf int32.
PRIORITY_MIN = -(2**31)
PRIORITY_MAX = 2**31 - 1


@dataclass
class SamplingParams:
    """Generation options of one request (shared by its `n` samples).

    Attributes:
        max_tokens: most tokens to generate per sample; None fills the context window.
        temperature: softmax temperature; 0 means greedy (argmax).
        top_p: nucleus mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 or -1 disables it.
        min_p: drop tokens whose probability is below min_p * max probability; 0 disables it.
        seed: makes sampling reproducible, independent of batch composition; None: random.
        stop: strings that end generation (at most MAX_STOP_STRINGS, each at most
            MAX_STOP_STRING_CHARS characters); the matched string is
            not part of the output.
        stop_token_ids: token ids that end generation (their text is not part of the output;
            at most MAX_STOP_TOKEN_IDS).
        ignore_eos: keep generating past the model's end-of-sequence token.
        n: number of independent samples for the prompt (they share the prompt's KV).
        logprobs: return the chosen token's logprob and this many top alternatives (0..20);
            None returns no logprobs.
        prompt_logprobs: return each prompt token's logprob (the first has none) and this many
            top alternatives (0..20); None returns none. The prompt then runs through the
            model whole: it takes no prefix-cache hit.
        repetition_penalty: HF-style multiplicative penalty over prompt and output tokens;
            1 disables it.
        frequency_penalty: OpenAI-style, subtracted once per previous occurrence in the
            output; in [-2, 2].
        presence_penalty: OpenAI-style, subtracted once if the token occurred in the output;
            in [-2, 2].
        skip_special_tokens: leave special tokens out of the detokenized text.
        max_thinking_tokens: force the end-of-thinking tag after this many thinking tokens;
            None: unlimited.
        min_thinking_tokens: suppress the end-of-thinking tag until this many thinking tokens.
        include_reasoning: return the reasoning text beside the answer (else drop it).
        min_tokens: generate at least this many tokens per sample: eos and the stop token ids
            are not sampled before, and stop strings not matched; 0: no minimum.
        logit_bias: {token id: value in [-100, 100]} added to the token's logit before
            sampling (OpenAI's logit_bias; -100 bans it); None: no bias.
        structured_output: what the answer must look like (a JSON schema, a regex, ...);
            the engine masks each step's tokens to it once the thinking ended. None: free.
        cache_salt: the prompt's KV is cached, and cached prefixes are reused, only among
            requests with this same salt (at most MAX_CACHE_SALT_CHARS characters): another
            caller cannot tell from cached-token counts or first-token times whether it sent
            a prompt. "": the prefix cache shared by every unsalted request.
        priority: the scheduling order among waiting requests, lower first (vLLM's): a
            lower value is admitted before and preempted after a higher one; equal
            priorities are served in arrival order. An int32; 0 by default.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    skip_special_tokens: bool = True
    max_thinking_tokens: int | None = None
    min_thinking_tokens: int = 0
    include_reasoning: bool = True
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    structured_output: StructuredOutput | None = None
    cache_salt: str = ""
    priority: int = 0

    @property
    def is_greedy(self) -> bool:
        """True when the sample is the argmax token (temperature 0)."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        """True when sampling reads the sample's token counts (a repetition, frequency or
        presence penalty that is not neutral)."""
        return self.has_repetition_penalty or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def has_repetition_penalty(self) -> bool:
        """True when sampling also reads which tokens the prompt holds (a repetition penalty
        that is not neutral)."""
        return self.repetition_penalty != 1.0

    def max_new_tokens(self, max_model_len: int, prompt_len: int) -> int:
        """Tokens this request may generate per sample within a `max_model_len` context."""
        room = max_model_len - prompt_len
        return room if self.max_tokens is None else min(self.max_tokens, room)

    def validate(self, max_model_len: int | None = None, prompt_len: int | None = None,
                 vocab_size: int | None = None) -> None:
        """Raise `InvalidArgument` naming the first bad field; return None when all are valid.

        Args:
            max_model_len: the model's context window; enables the length check.
            prompt_len: tokens in the prompt; with max_model_len checks prompt + max_tokens.
            vocab_size: the model's vocabulary; logit_bias token ids must be below it.
        """
        self._validate_sampling()
        self._validate_penalties()
        self._validate_lists()
        self._validate_bias(vocab_size)
        self._validate_reasoning()
        self._validate_length(max_model_len, prompt_len)
        self._validate_cache_salt()
        self._validate_priority()
        if self.structured_output is not None:
            if not isinstance(self.structured_output, StructuredOutput):
                raise InvalidArgument("must be a StructuredOutput", field="structured_output")
            self.structured_output.validate()

    def _validate_sampling(self) -> None:
        _require_real("temperature", self.temperature)
        if self.temperature < 0:
            raise InvalidArgument(
                f"must be >= 0 (0 means greedy), got {self.temperature}", field="temperature"
            )
        _require_real("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise InvalidArgument(
                f"must be in (0, 1] (1 disables nucleus sampling), got {self.top_p}",
                field="top_p",
            )
        _require_int("top_k", self.top_k)
        if self.top_k < -1:
            raise InvalidArgument(
                f"must be >= 1, or 0 / -1 to disable it, got {self.top_k}", field="top_k"
            )
        _require_real("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise InvalidArgument(
                f"must be in [0, 1] (0 disables it), got {self.min_p}", field="min_p"
            )
        _require_int("n", self.n)
        if self.n < 1:
            raise InvalidArgument(f"must be >= 1, got {self.n}", field="n")
        if self.seed is not None:
            _require_int("seed", self.seed)
            if not SEED_MIN <= self.seed <= SEED_MAX:
                raise InvalidArgument(
                    f"must fit in 64 bits ({SEED_MIN}..{SEED_MAX}), got {self.seed}",
                    field="seed",
                )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _require_int(name, value)
                if not 0 <= value <= MAX_LOGPROBS:
                    raise InvalidArgument(
                        f"must be in [0, {MAX_LOGPROBS}] (or unset for none), got {value}", field=name
                    )

    def _validate_penalties(self) -> None:
        _require_real("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise InvalidArgument(
                f"must be > 0 (1 disables it), got {self.repetition_penalty}",
                field="repetition_penalty",
            )
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            _require_real(name, value)
            if abs(value) > MAX_ABS_ADDITIVE_PENALTY:
                raise InvalidArgument(
                    f"must be in [-{MAX_ABS_ADDITIVE_PENALTY}, {MAX_ABS_ADDITIVE_PENALTY}], "
                    f"got {value}",
                    field=name,
                )

    def _validate_cache_salt(self) -> None:
        salt = self.cache_salt
        if not isinstance(salt, str):
            raise InvalidArgument(f"must be a string, got {type(salt).__name__}", field="cache_salt")
        if len(salt) > MAX_CACHE_SALT_CHARS:
            raise InvalidArgument(f"holds {len(salt)} characters; at most {MAX_CACHE_SALT_CHARS}", field="cache_salt")
        try:
            salt.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidArgument("must be valid Unicode text (no lone surrogates)", field="cache_salt") from None

    def _validate_priority(self) -> None:
        priority = self.priority
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidArgument(f"must be an integer, got {type(priority).__name__}", field="priority")
        if not PRIORITY_MIN <= priority <= PRIORITY_MAX:
            raise InvalidArgument(f"must be in [{PRIORITY_MIN}, {PRIORITY_MAX}], got {priority}", field="priority")

    def _validate_lists(self) -> None:
        if isinstance(self.stop, str) or not all(isinstance(s, str) for s in self.stop):
            raise InvalidArgument("must be a list of strings", field="stop")
        if any(s == "" for s in self.stop):
            raise InvalidArgument("must not contain an empty string", field="stop")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidArgument(f"holds {len(self.stop)} strings; at most {MAX_STOP_STRINGS}", field="stop")
        longest = max(map(len, self.stop), default=0)
        if longest > MAX_STOP_STRING_CHARS:
            raise InvalidArgument(f"holds a string of {longest} characters; at most {MAX_STOP_STRING_CHARS} each",
                                  field="stop")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidArgument(f"holds {len(self.stop_token_ids)} token ids; at most {MAX_STOP_TOKEN_IDS}",
                                  field="stop_token_ids")
        for token_id in self.stop_token_ids:
            _require_int("stop_token_ids", token_id)
            if token_id < 0:
                raise InvalidArgument(
                    f"token ids must be >= 0, got {token_id}", field="stop_token_ids"
                )

    def _validate_bias(self, vocab_size: int | None) -> None:
        _require_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise InvalidArgument(f"must be >= 0, got {self.min_tokens}", field="min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidArgument(f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
                                  field="min_tokens")
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict):
            raise InvalidArgument("must map token ids to biases", field="logit_bias")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
            raise InvalidArgument(f"biases {len(self.logit_bias)} tokens; at most {MAX_LOGIT_BIAS_TOKENS}",
                                  field="logit_bias")
        for token_id, bias in self.logit_bias.items():
            _require_int("logit_bias", token_id)
            if token_id < 0 or (vocab_size is not None and token_id >= vocab_size):
                raise InvalidArgument(f"token id {token_id} is outside the vocabulary"
                                      + (f" [0, {vocab_size})" if vocab_size is not None else ""), field="logit_bias")
            _require_real(f"logit_bias.{token_id}", bias)
            if abs(bias) > MAX_ABS_LOGIT_BIAS:
                raise InvalidArgument(f"must be in [-{MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}], got {bias}",
                                      field=f"logit_bias.{token_id}")

    def _validate_reasoning(self) -> None:
        if self.max_thinking_tokens is not None:
            _require_int("max_thinking_tokens", self.max_thinking_tokens)
            if self.max_thinking_tokens < 0:
                raise InvalidArgument(
                    f"must be >= 0 (or unset for no limit), got {self.max_thinking_tokens}",
                    field="max_thinking_tokens",
                )
        _require_int("min_thinking_tokens", self.min_thinking_tokens)
        if self.min_thinking_tokens < 0:
            raise InvalidArgument(
                f"must be >= 0, got {self.min_thinking_tokens}", field="min_thinking_tokens"
            )
        if (
            self.max_thinking_tokens is not None
            and self.min_thinking_tokens > self.max_thinking_tokens
        ):
            raise InvalidArgument(
                f"({self.min_thinking_tokens}) must not exceed max_thinking_tokens "
                f"({self.max_thinking_tokens}); lower it or raise max_thinking_tokens",
                field="min_thinking_tokens",
            )

    def _validate_length(self, max_model_len: int | None, prompt_len: int | None) -> None:
        if self.max_tokens is not None:
            _require_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise InvalidArgument(f"must be >= 1, got {self.max_tokens}", field="max_tokens")
        if max_model_len is None or prompt_len is None:
            return
        check_prompt_fits(prompt_len, max_model_len)
        if self.max_tokens is not None and prompt_len + self.max_tokens > max_model_len:
            raise InvalidArgument(
                f"{self.max_tokens} plus the prompt's {prompt_len} tokens exceeds the "
                f"model's context of {max_model_len}; set it to at most "
                f"{max_model_len - prompt_len}",
                field="max_tokens",
            )
        if self.min_tokens > max_model_len - prompt_len:  # else the sample ends at the context, short of it
            raise InvalidArgument(
                f"{self.min_tokens} plus the prompt's {prompt_len} tokens exceeds the "
                f"model's context of {max_model_len}; set it to at most "
                f"{max_model_len - prompt_len}",
                field="min_tokens",
            )


def check_prompt_fits(prompt_len: int, max_model_len: int, field: str = "prompt") -> None:
    """Raise InvalidArgument naming `field` unless a prompt of `prompt_len` tokens leaves room
    for a generated token in a context of `max_model_len`."""
    if prompt_len >= max_model_len:
        raise InvalidArgument(
            f"has {prompt_len} tokens but the model's context is {max_model_len} tokens; "
            "shorten the prompt to leave room for at least one generated token",
            field=field,
        )


def _require_real(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidArgument(f"must be a finite number, got {value!r}", field=name)


def _require_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"must be an integer, got {value!r}", field=name)
