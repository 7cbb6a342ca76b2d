"""vLLM's `truncate_prompt_tokens`: a prompt longer than asked keeps its last tokens.

The HTTP API reads the field (`openai_request`), and the gRPC API its
`GenerateRequest.truncate_prompt_tokens` (`servicer`), into a `PromptTruncation` on the
request's `GenerateSpec`; the router applies it to the prompt's token ids right after tokenizing (for
chat, to the chat template's whole rendering) and before the context check, so a prompt too
long for the context fits, and the workers, `usage.prompt_tokens`, `prompt_token_ids` and the
prompt's logprobs all see the kept tokens alone. vLLM truncates a generating model's prompt
on the left (its tokenizers are loaded with `truncation_side="left"`): the end of a prompt,
nearest the answer, is what stays. `-1` keeps as many as the context holds beside the answer.

Two things stay as they were. Completions' `echo` returns the prompt as sent, as vLLM's does
(only the kept tokens are scored). The byte bound on prompt text
(`ServedModel.check_prompt_size`) still refuses text over it before tokenizing; vLLM skips
its own such bound when truncating, but here it keeps a client from holding the tokenizer
threads for seconds on text that would mostly be dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

from cleave.errors import InvalidArgument
from cleave.generation.sampling_params import SamplingParams
from services.gateway.openai_tools import json_type

FIELD = "truncate_prompt_tokens"
FIT_CONTEXT = -1  # as many tokens as the context holds beside the answer


@dataclass(frozen=True)
class PromptTruncation:
    """Keep a prompt's last `num_tokens` tokens (`FIT_CONTEXT`: as many as fit), dropping
    those before them; a prompt no longer than that is left whole."""

    num_tokens: int

    @classmethod
    def checked(cls, value: object) -> PromptTruncation:
        """The truncation a JSON value asks for: an integer >= 1, or -1 (vLLM's range; 0
        would keep an empty prompt, which nothing can answer)."""
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidArgument(f"must be an integer >= 1, or -1, got {json_type(value)}", field=FIELD)
        if value < 1 and value != FIT_CONTEXT:
            raise InvalidArgument(f"must be an integer >= 1, or -1 (as many as the context holds), got {value}",
                                  field=FIELD)
        return cls(value)

    def apply(self, prompt_ids: list[int], max_model_len: int, sampling: SamplingParams) -> list[int]:
        """The tokens of `prompt_ids` to run. A count over what the context holds beside the
        answer is refused naming the field, whatever the prompt's length, as vLLM refuses it."""
        answer = _answer_room(sampling)
        limit = max_model_len - answer
        if limit < 1:
            return prompt_ids  # the answer alone fills the context: the length check names its field
        if self.num_tokens > limit:
            raise InvalidArgument(
                f"keeps {self.num_tokens} prompt tokens, but this model's context of {max_model_len} tokens "
                f"holds at most {limit} beside the answer's {answer} (max_tokens, or min_tokens if more); "
                f"set it to at most {limit}, or -1 to keep as many as fit",
                field=FIELD,
            )
        keep = limit if self.num_tokens == FIT_CONTEXT else self.num_tokens
        return prompt_ids[-keep:] if len(prompt_ids) > keep else prompt_ids


def _answer_room(sampling: SamplingParams) -> int:
    """The context a sample's answer may need: `max_tokens` (unset: one token, the least an
    answer takes), or `min_tokens` where that asks for more."""
    return max(sampling.max_tokens or 1, sampling.min_tokens)
