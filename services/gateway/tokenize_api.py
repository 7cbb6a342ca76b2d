"""`POST /tokenize` and `POST /detokenize`: vLLM's extension routes, for clients (lm-eval's
harness, benchmark tools) that count or split tokens with the served tokenizer.

    POST /tokenize    {"model"?, "prompt": str, "add_special_tokens"?: true}
                      or {"model"?, "messages": [...], "add_generation_prompt"?: true}
                      -> {"count", "max_model_len", "tokens": [...], "token_strs": null}
    POST /detokenize  {"model"?, "tokens": [int, ...]} -> {"prompt": str}  (at most the context's length)

Tokenizing runs in a thread (a long prompt would hold the event loop); errors are the API's
OpenAI-shaped 400s naming the field.
"""

from __future__ import annotations

import asyncio
from typing import Any

from cleave.errors import InvalidArgument
from services.gateway.backend import Prompt
from services.gateway.model import ServedModel
from services.gateway.openai_request import chat_prompt, text_field

# the gRPC request's names that the model's checks give fields (`ServedModel`) -> the body's
PARAM_NAMES = {"text": "prompt", "chat.messages": "messages", "input": "messages"}


def tokenize_body(model: ServedModel, body: Any) -> dict[str, Any]:
    """The /tokenize answer for a parsed body (runs the tokenizer: call off the event loop)."""
    if not isinstance(body, dict):
        raise InvalidArgument("the request body must be a JSON object", field="body")
    if "messages" in body:
        prompt = chat_prompt(body)
        if body.get("add_generation_prompt", True) is not True:
            raise InvalidArgument("only true is supported (the chat template always adds it)",
                                  field="add_generation_prompt")
        model.check_prompt_size(prompt)
        token_ids = model.encode(prompt)
    else:
        text = text_field(body.get("prompt"), "prompt")
        add_special = body.get("add_special_tokens", True)
        if not isinstance(add_special, bool):
            raise InvalidArgument(f"must be true or false, got {add_special!r}", field="add_special_tokens")
        model.check_prompt_size(Prompt(text=text, raw=True))
        token_ids = model.tokenizer.encode(text, add_special_tokens=add_special)
    return {"count": len(token_ids), "max_model_len": model.max_model_len, "tokens": token_ids, "token_strs": None}


def detokenize_body(model: ServedModel, body: Any) -> dict[str, Any]:
    """The /detokenize answer for a parsed body."""
    tokens = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise InvalidArgument("must be a list of token ids", field="tokens")
    if len(tokens) > model.max_model_len:  # decoding millions of ids holds the GIL for seconds
        raise InvalidArgument(f"holds {len(tokens)} token ids, more than this model's context of "
                              f"{model.max_model_len} tokens", field="tokens")
    bad = next((t for t in tokens if not 0 <= t < model.vocab_size), None)
    if bad is not None:
        raise InvalidArgument(f"token id {bad} is outside this model's vocabulary [0, {model.vocab_size})",
                              field="tokens")
    return {"prompt": model.tokenizer.decode(tokens)}


async def tokenize(model: ServedModel, body: Any) -> dict[str, Any]:
    return await asyncio.to_thread(tokenize_body, model, body)


async def detokenize(model: ServedModel, body: Any) -> dict[str, Any]:
    return await asyncio.to_thread(detokenize_body, model, body)
