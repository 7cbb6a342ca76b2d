"""Streams arrive as they are produced: many Generate messages / SSE chunks per request, in
both modes and every reasoning mode, thinking before the answer."""

from __future__ import annotations

import threading

import openai
import pytest

from cleave.client import GatewayClient
from cleave.proto.cleave.v1 import common_pb2 as c, gateway_pb2 as g

pytestmark = pytest.mark.asyncio(loop_scope="module")
PROMPT = "The quick brown fox"
MAX_TOKENS = 40
THINKING = 20  # then the end tag, then the answer
MIN_MESSAGES = 15  # of 40 tokens (steps the gateway fell behind on may share a message)
LEAD = 2  # tokens the decode engine may make ahead of what the client has received (`Pace`)
PACE_TIMEOUT_S = 60.0  # a guard against a hang: a token the client never gets fails the test


class Pace:
    """Lets the decode worker's engine take a step only while the client has received all
    but `LEAD` of the tokens it made. A message held back until later steps would stall
    the request (the step waits for the client, which waits for that message: the guard
    fails the test), and however busy the machine, the gateway cannot fall further behind
    than that and merge the steps it missed into one message."""

    def __init__(self, engine) -> None:  # type: ignore[no-untyped-def]
        self._step = engine.step
        self._changed = threading.Condition()
        self.made = 0  # the request's tokens, as the engine counts them (the first included)
        self.seen = 0

    def step(self):  # type: ignore[no-untyped-def]
        with self._changed:
            if not self._changed.wait_for(lambda: self.made - self.seen < LEAD, PACE_TIMEOUT_S):
                raise TimeoutError(f"the client got {self.seen} of {self.made} tokens and no more")
        outputs = self._step()
        with self._changed:
            self.made = max([self.made] + [output.usage.completion_tokens for output in outputs])
        return outputs

    def saw(self, num_tokens: int) -> None:
        with self._changed:
            self.seen += num_tokens
            self._changed.notify_all()


@pytest.mark.parametrize("mode", [c.REASONING_MODE_SEPARATE, c.REASONING_MODE_HIDDEN, c.REASONING_MODE_INLINE])
async def test_generate_streams_tokens_as_they_come(stack, mode, monkeypatch):
    engine = stack.decode[0].engine
    pace = Pace(engine)
    monkeypatch.setattr(engine, "step", pace.step)
    messages = []
    async with GatewayClient(stack.gateway_address) as client:
        async for response in client.generate(
            PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, stream=g.StreamOptions(include_token_ids=True),
            reasoning=c.ReasoningOptions(mode=mode, max_thinking_tokens=THINKING),
        ):
            messages.extend(response.samples)  # the last response carries only the usage
            pace.saw(sum(len(sample.token_ids) for sample in response.samples))
    assert sum(len(m.token_ids) for m in messages) == MAX_TOKENS
    with_tokens = [m for m in messages[:-1] if m.token_ids]
    assert len(with_tokens) >= MIN_MESSAGES, [len(m.token_ids) for m in messages]
    # never the bulk of the request at once
    assert max(len(m.token_ids) for m in messages) <= MAX_TOKENS // 4
    thinking = [i for i, m in enumerate(messages) if m.reasoning_text]
    answer = [i for i, m in enumerate(messages) if m.text]
    if mode == c.REASONING_MODE_SEPARATE:
        assert len(thinking) >= 5 and len(answer) >= 3
        # thinking streamed first, then the answer; a busy gateway may merge the step that
        # closes the thinking with the first answer tokens into one message
        assert max(thinking) <= min(answer)
    elif mode == c.REASONING_MODE_HIDDEN:
        assert not thinking and len(answer) >= 3
    else:
        assert not thinking and len(answer) >= 8


async def test_chat_sse_streams_reasoning_then_content(stack):
    client = stack.openai()
    stream = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=MAX_TOKENS, temperature=0.0,
        stream=True, extra_body={"max_thinking_tokens": THINKING, "ignore_eos": True},
    )
    kinds = []
    async for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            if getattr(delta, "reasoning_content", None):
                kinds.append("reasoning")
            if delta.content:
                kinds.append("content")
    # several chunks, thinking first; how many of each depends on how many decode steps a busy
    # gateway merged into one chunk (a stalled client may get the whole answer in one)
    assert len(kinds) >= 4 and kinds.count("reasoning") >= 2 and kinds.count("content") >= 1, kinds
    assert kinds == sorted(kinds, key=lambda kind: kind == "content")  # all thinking, then the answer
