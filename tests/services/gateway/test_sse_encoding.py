"""The streamed OpenAI events are encoded with each request's fixed fields once
(`_Shaper.sse`): the bytes equal a whole `json.dumps` of every event, for chat and
completions, several samples, reasoning, logprobs, finish reasons, non-ASCII text and vLLM's
`return_token_ids` fields."""

from __future__ import annotations

import json

import pytest

from cleave.generation.outputs import FinishReason
from cleave.rpc.types import TokenLogprob, TopLogprobs
from services.gateway.backend import GenerateChunk, SampleOutput
from services.gateway.http_api import _Shaper
from services.gateway.openai_request import generate_spec

LOGPROB = TopLogprobs(TokenLogprob(7, -0.25), (TokenLogprob(7, -0.25), TokenLogprob(9, -1.5)))
CHUNKS = [
    GenerateChunk(samples=(SampleOutput(0, text="Hé \"quoted\"\n", token_ids=(7,), logprobs=(LOGPROB,)),
                           SampleOutput(1, reasoning_text="思考", token_ids=(9,), logprobs=(LOGPROB,))),
                  prompt_token_ids=(1, 5)),
    GenerateChunk(samples=()),
    GenerateChunk(samples=(SampleOutput(1, text="</x>", token_ids=(3,), logprobs=(LOGPROB,),
                                        finish_reason=FinishReason.STOP),)),
    GenerateChunk(samples=(SampleOutput(0, token_ids=(4,), logprobs=(LOGPROB,), finish_reason=FinishReason.LENGTH),)),
]


def whole_events(shaper: _Shaper, chunk: GenerateChunk) -> bytes:
    """Each sample's event encoded in one piece, as `json.dumps` writes the dict."""
    shaper._take_prompt(chunk)
    events = []
    for sample in chunk.samples:
        choice, after = shaper._streamed(sample)
        events.append(b"data: " + json.dumps({**shaper._event([choice]), **after}, ensure_ascii=False).encode() + b"\n\n")
    return b"".join(events)


@pytest.mark.parametrize("return_token_ids", [False, True])
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_streamed_events_equal_whole_encodings(chat, return_token_ids):
    body = {"model": "m", "n": 2, "stream": True, "return_token_ids": return_token_ids,
            **({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2} if chat
               else {"prompt": "hi", "logprobs": 2})}
    spec, stream = generate_spec(body, "req-1", "m", chat)
    assert stream
    token_text = {3: "</x>", 4: "", 7: "H", 9: "思"}.get
    fast, whole = (_Shaper(spec, chat, token_text, include_usage=False) for _ in range(2))
    whole.created = fast.created
    for chunk in CHUNKS:
        encoded = fast.sse(chunk)
        assert encoded == whole_events(whole, chunk)
        for event in filter(None, encoded.split(b"\n\n")):
            decoded = json.loads(event.removeprefix(b"data: "))  # every event parses alone
            assert decoded["id"] == "req-1" and len(decoded["choices"]) == 1
            if return_token_ids:  # every event carries its new ids; the prompt's go with a choice's first
                assert decoded["choices"][0]["token_ids"]
                prompt_ids = decoded["choices"][0]["prompt_token_ids"] if not chat else decoded.get("prompt_token_ids")
                assert prompt_ids == ([1, 5] if chunk is CHUNKS[0] else None)
    assert fast.sse(GenerateChunk()) == b""
