"""cleave.v1.Gateway servicer: protobuf <-> `services.gateway.backend` types, nothing else."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Any

import grpc
import structlog

from cleave.api_keys import ApiKeys
from cleave.config import ModelConfig
from cleave.errors import InvalidArgument, Unauthenticated
from cleave.generation.tool_calls import ForcedCall
from cleave.proto.cleave.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from cleave.rpc import current_request_id
from cleave.rpc.auth import AUTHORIZATION_KEY
from cleave.rpc.convert import (
    abort_target,
    MAX_SAMPLES,
    finish_reason_to_proto,
    reasoning_from_proto,
    require_request_id,
    sampling_from_proto,
    token_ids_from_proto,
    top_logprobs_to_proto,
    usage_to_proto,
)
from cleave.rpc.types import ReasoningOptions
from cleave.scaling.code_verifier import MAX_CODE_TESTS
from cleave.scaling.sandbox import MAX_WALL_TIMEOUT_S
from cleave.tracing import mark
from cleave.scaling.code_verifier import CodeTest
from cleave.scaling.strategies import Strategy
from services.gateway.backend import (
    ChatMessage,
    GatewayBackend,
    GenerateChunk,
    GenerateSpec,
    Prompt,
    Scaling,
    StreamShape,
    VerifierKind,
    VerifierSpec,
)
from services.gateway.openai_tools import MAX_TOOLS, json_object, new_call_id
from services.gateway.prompt_bounds import token_ids_to_read, within_context
from services.gateway.prompt_truncation import PromptTruncation
from services.gateway.request_names import chat_role, context_length, resolve_model
from services.gateway.structured_request import forced_call_output
from services.gateway.tenants import for_tenant, scoped_request_id

DEADLINE_MARGIN_S = 0.05
_STRATEGIES = {
    gateway_pb2.TestTimeScaling.STRATEGY_UNSPECIFIED: Strategy.NONE,
    gateway_pb2.TestTimeScaling.STRATEGY_NONE: Strategy.NONE,
    gateway_pb2.TestTimeScaling.STRATEGY_MAJORITY_VOTE: Strategy.MAJORITY_VOTE,
    gateway_pb2.TestTimeScaling.STRATEGY_BEST_OF_N: Strategy.BEST_OF_N,
    gateway_pb2.TestTimeScaling.STRATEGY_GROUP_ROLLOUT: Strategy.GROUP_ROLLOUT,
}
_TOOL_CHOICES = (gateway_pb2.TOOL_CHOICE_UNSPECIFIED, gateway_pb2.TOOL_CHOICE_AUTO, gateway_pb2.TOOL_CHOICE_NONE,
                 gateway_pb2.TOOL_CHOICE_REQUIRED)
_VERIFIERS = {
    gateway_pb2.Verifier.KIND_MATH: VerifierKind.MATH,
    gateway_pb2.Verifier.KIND_CODE: VerifierKind.CODE,
}


def prompt_from_proto(request: gateway_pb2.GenerateRequest, max_context_length: int = 0) -> Prompt:
    """The request's prompt. Its token ids, turns and earlier tool calls each take a token of
    the context at least, so more than `max_context_length` (the model's; 0: unknown) of them
    are refused before they are converted: a message may hold millions, and converting them
    one by one held the event loop (every other stream) for up to 35 s. With
    `truncate_prompt_tokens` the token ids are read from their end alone (`prompt_bounds`)."""
    which = request.WhichOneof("input")
    if which is None:
        raise InvalidArgument("set one of text, token_ids or chat", field="input")
    if request.raw_prompt and which != "text":
        raise InvalidArgument("raw_prompt applies to text input only", field="raw_prompt")
    if which == "text":
        if not request.text:
            raise InvalidArgument("must not be empty", field="text")
        return Prompt(text=request.text, raw=request.raw_prompt)
    if which == "token_ids":
        ids = request.token_ids.ids
        read = token_ids_to_read(ids, max_context_length, request.HasField("truncate_prompt_tokens"), "input")
        return Prompt(token_ids=token_ids_from_proto(read, "token_ids.ids", first_position=len(ids) - len(read)))
    if not request.chat.messages:
        raise InvalidArgument("must contain at least one message", field="chat.messages")
    within_context(len(request.chat.messages), max_context_length, "chat.messages",
                   "messages, each a prompt token at least")
    messages = []
    num_calls = 0
    for position, message in enumerate(request.chat.messages):
        field = f"chat.messages[{position}]"
        num_calls += len(message.tool_calls)
        within_context(num_calls, max_context_length, f"{field}.tool_calls",
                       "tool calls in the turns up to this one, each a prompt token at least")
        role = chat_role(message.role, f"{field}.role")
        if message.tool_calls and role != "assistant":
            raise InvalidArgument("only an assistant turn holds tool calls", field=f"{field}.tool_calls")
        if bool(message.tool_call_id) != (role == "tool"):
            raise InvalidArgument("a tool turn needs the id of the call it answers, and only a tool turn has one",
                                  field=f"{field}.tool_call_id")
        calls = tuple(
            {"id": call.id, "type": "function",
             "function": {"name": _name(call.name, f"{field}.tool_calls[{index}].name"),
                          "arguments": json_object(call.arguments_json or "{}",
                                                    f"{field}.tool_calls[{index}].arguments_json")}}
            for index, call in enumerate(message.tool_calls)
        )
        messages.append(ChatMessage(role, message.content, message.reasoning_content, message.name, calls,
                                    message.tool_call_id))
    return Prompt(chat=tuple(messages))


def truncation_from_proto(request: gateway_pb2.GenerateRequest) -> PromptTruncation | None:
    """`truncate_prompt_tokens`, checked as the HTTP API checks it (unset: the prompt runs whole)."""
    if not request.HasField("truncate_prompt_tokens"):
        return None
    return PromptTruncation.checked(request.truncate_prompt_tokens)


def tools_from_proto(tools: Sequence[gateway_pb2.Tool]) -> tuple[dict[str, Any], ...]:
    """The request's tools as chat templates read them (OpenAI's function tools)."""
    if len(tools) > MAX_TOOLS:
        raise InvalidArgument(f"holds {len(tools)} tools; at most {MAX_TOOLS}", field="tools")
    checked = []
    for position, tool in enumerate(tools):
        function: dict[str, Any] = {"name": _name(tool.name, f"tools[{position}].name")}
        if tool.description:
            function["description"] = tool.description
        if tool.parameters_json:
            function["parameters"] = json_object(tool.parameters_json, f"tools[{position}].parameters_json")
        checked.append({"type": "function", "function": function})
    return tuple(checked)


def _name(value: str, field: str) -> str:
    if not value:
        raise InvalidArgument("must not be empty", field=field)
    return value


def with_tools(request: gateway_pb2.GenerateRequest, prompt: Prompt) -> tuple[Prompt, bool, ForcedCall | None]:
    """(the prompt with the request's tools, whether the answers' calls are parsed out of
    their text in the model's format: tools given and TOOL_CHOICE_AUTO, the call a choice
    forces: REQUIRED or a named function). Tools need a prompt the chat template renders."""
    if request.tool_choice not in _TOOL_CHOICES:
        raise InvalidArgument(f"unknown tool choice {request.tool_choice}", field="tool_choice")
    tools = tools_from_proto(request.tools)
    if tools and (prompt.token_ids is not None or prompt.raw):
        raise InvalidArgument("tools are described by the chat template: give text or chat input, not raw", field="tools")
    forced = None
    if request.tool_choice_function:
        forced = ForcedCall(request.tool_choice_function)
    elif request.tool_choice == gateway_pb2.TOOL_CHOICE_REQUIRED:
        forced = ForcedCall()
    parse = bool(tools) and forced is None and request.tool_choice != gateway_pb2.TOOL_CHOICE_NONE
    return replace(prompt, tools=tools), parse, forced


def scaling_from_proto(message: gateway_pb2.TestTimeScaling, num_samples: int) -> Scaling:
    if message.strategy not in _STRATEGIES:
        raise InvalidArgument(f"unknown strategy {message.strategy}", field="scaling.strategy")
    strategy = _STRATEGIES[message.strategy]
    if message.num_samples > MAX_SAMPLES:
        raise InvalidArgument(f"at most {MAX_SAMPLES}", field="scaling.num_samples")
    verifier = None
    if message.HasField("verifier"):
        proto = message.verifier
        if proto.kind not in _VERIFIERS:
            raise InvalidArgument("set kind to MATH or CODE", field="scaling.verifier.kind")
        kind = _VERIFIERS[proto.kind]
        if kind is VerifierKind.MATH and not proto.expected_answer:
            raise InvalidArgument("a math verifier needs it", field="scaling.verifier.expected_answer")
        if kind is VerifierKind.CODE and not proto.tests:
            raise InvalidArgument("a code verifier needs tests", field="scaling.verifier.tests")
        if len(proto.tests) > MAX_CODE_TESTS:
            raise InvalidArgument(f"at most {MAX_CODE_TESTS} tests, got {len(proto.tests)}",
                                  field="scaling.verifier.tests")
        timeout_s = proto.timeout.ToNanoseconds() / 1e9 if proto.HasField("timeout") else None
        if timeout_s is not None and not 0 < timeout_s <= MAX_WALL_TIMEOUT_S:
            raise InvalidArgument(f"must be positive and at most {MAX_WALL_TIMEOUT_S:g}s per test, got {timeout_s:g}s",
                                  field="scaling.verifier.timeout")
        verifier = VerifierSpec(
            kind=kind,
            expected_answer=proto.expected_answer,
            tests=tuple(CodeTest(t.stdin, t.expected_stdout) for t in proto.tests),
            timeout_s=timeout_s,
        )
    needs_verifier = strategy in (Strategy.BEST_OF_N, Strategy.GROUP_ROLLOUT)
    if needs_verifier and verifier is None:
        raise InvalidArgument(f"{strategy.name} needs a verifier", field="scaling.verifier")
    return Scaling(
        strategy=strategy,
        num_samples=message.num_samples or num_samples,
        verifier=verifier,
        return_all_samples=message.return_all_samples,
    )


def chunk_to_proto(
    chunk: GenerateChunk, request_id: str, model: str
) -> gateway_pb2.GenerateResponse:
    """The chunk as a response message. Once a token per request: only the fields a chunk
    sets are written (a field set to its default costs as much as any other)."""
    response = gateway_pb2.GenerateResponse(request_id=request_id, model=model)
    if chunk.prompt_logprobs:
        response.prompt_logprobs.extend(top_logprobs_to_proto(chunk.prompt_logprobs))
    if chunk.prompt_token_ids:
        response.prompt_token_ids.extend(chunk.prompt_token_ids)
    for sample in chunk.samples:
        delta = response.samples.add(index=sample.index, text=sample.text)
        if sample.token_ids:
            delta.token_ids.extend(sample.token_ids)
        if sample.reasoning_text:
            delta.reasoning_text = sample.reasoning_text
        if sample.finish_reason is not None:
            delta.finish_reason = finish_reason_to_proto(sample.finish_reason)
        if sample.logprobs:
            delta.logprobs.extend(top_logprobs_to_proto(sample.logprobs))
        if sample.reward is not None:
            delta.reward = sample.reward
        if sample.advantage is not None:
            delta.advantage = sample.advantage
        if sample.answer is not None:
            delta.answer = sample.answer
        for call in sample.tool_calls:
            delta.tool_calls.add(id=new_call_id(), name=call.name, arguments_json=call.arguments)
    if chunk.usage is not None:
        response.usage.CopyFrom(usage_to_proto(chunk.usage))
    if chunk.selected_index is not None:
        response.selected_index = chunk.selected_index
    for votes in chunk.votes:
        response.votes.answers.add(
            answer=votes.answer, num_votes=votes.num_votes, sample_indices=votes.sample_indices
        )
    return response


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """Validates requests, hands them to a GatewayBackend, streams the results back.

    `Abort` reaches only the requests the calling connection started: request ids may be
    the client's own choice, so another client could know one, and a caller that is not the
    request's gets `found: false`, as for an id that is not running. With several API keys
    (`api_keys`, checked by the server's interceptor before a call gets here) a request
    runs as the tenant of the key it sent (`services.gateway.tenants`), its id in that
    tenant's own scope (`scoped_request_id`).
    """

    def __init__(self, backend: GatewayBackend, models: Sequence[ModelConfig], api_keys: ApiKeys | None = None) -> None:
        if not models:
            raise ValueError("a gateway serves at least one model")
        self.backend = backend
        self.models = tuple(models)
        self.api_keys = api_keys
        self._callers: dict[str, str] = {}  # running request id -> the connection (peer) that started it

    def _tenant(self, context: grpc.aio.ServicerContext) -> str | None:
        """The tenant of the caller's key, with several keys (None: one key or none)."""
        if self.api_keys is None or not self.api_keys.isolates:
            return None
        sent = next((value for key, value in context.invocation_metadata() or () if key == AUTHORIZATION_KEY), None)
        tenant = self.api_keys.tenant(sent if isinstance(sent, str) else None)
        if tenant is None:  # the interceptor let no such call through; refuse rather than share a cache
            raise Unauthenticated("send 'authorization: Bearer <key>' with one of the gateway's API keys")
        return tenant

    def generate_spec(self, request: gateway_pb2.GenerateRequest) -> GenerateSpec:
        request_id = request.request_id or current_request_id() or ""
        reasoning = (
            reasoning_from_proto(request.reasoning) if request.HasField("reasoning") else ReasoningOptions()
        )
        # an unset message is all defaults, so both cases go through the same validation
        sampling = sampling_from_proto(request.sampling, reasoning=reasoning)
        model = resolve_model(self.models, request.model)
        truncation = truncation_from_proto(request)  # named before a prompt it lets run long is read
        prompt = prompt_from_proto(request, context_length(self.models, model))
        prompt, parse_tool_calls, forced = with_tools(request, prompt)
        if forced is not None:
            parallel = not request.HasField("parallel_tool_calls") or request.parallel_tool_calls
            constraint = forced_call_output(forced, prompt.tools, parallel, "tool_choice", "tool_choice_function")
            if sampling.structured_output is not None:
                raise InvalidArgument("a forced tool call constrains the answer already; leave it unset",
                                      field="sampling.structured_output")
            sampling.structured_output = constraint
        return GenerateSpec(
            request_id=require_request_id(request_id),
            model=model,
            prompt=prompt,
            sampling=sampling,
            reasoning=reasoning,
            scaling=scaling_from_proto(request.scaling, sampling.n),
            stream=StreamShape(
                aggregate=request.stream.aggregate,
                include_token_ids=request.stream.include_token_ids,
                continuous_usage=request.stream.continuous_usage,
            ),
            parse_tool_calls=parse_tool_calls,
            parallel_tool_calls=not request.HasField("parallel_tool_calls") or request.parallel_tool_calls,
            forced_call=forced,
            include_stop_str=request.sampling.include_stop_str_in_output,
            truncation=truncation,
        )

    async def Generate(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        tenant = self._tenant(context)
        floor = None if tenant is None or self.api_keys is None else self.api_keys.priority_floor(tenant)
        spec = for_tenant(self.generate_spec(request), tenant, floor)
        client_request_id = spec.request_id  # what the caller sees; it runs under its tenant's scope
        spec = replace(spec, request_id=scoped_request_id(tenant, client_request_id))
        if spec.tenant:  # the call's log lines, its "rpc" line included, name the tenant (its task's alone)
            structlog.contextvars.bind_contextvars(tenant=spec.tenant)
        remaining = context.time_remaining()
        if remaining is not None:
            # end a little before the client's deadline, so it gets our DEADLINE_EXCEEDED
            deadline = asyncio.get_running_loop().time() + max(remaining - DEADLINE_MARGIN_S, 0.0)
            spec = replace(spec, deadline=deadline)
        callers = self._callers
        owns = spec.request_id not in callers  # a running id keeps its caller (a second start of it fails)
        if owns:
            callers[spec.request_id] = context.peer()
        try:
            # aclosing: a cancelled call closes the backend's stream at once, which aborts the
            # request on its worker instead of leaving that to garbage collection
            async with contextlib.aclosing(self.backend.generate(spec)) as chunks:
                sent_tokens = False
                async for chunk in chunks:
                    if not sent_tokens and chunk.samples:  # samples carry tokens
                        sent_tokens = True
                        mark("gateway.first_byte", request_id=spec.request_id)
                    yield chunk_to_proto(chunk, client_request_id, spec.model)
        finally:
            if owns:
                del callers[spec.request_id]

    async def Abort(
        self, request: common_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.AbortResponse:
        request_id, sample_index = abort_target(request)
        request_id = scoped_request_id(self._tenant(context), request_id)
        if self._callers.get(request_id) != context.peer():
            return common_pb2.AbortResponse(found=False)
        return common_pb2.AbortResponse(found=await self.backend.abort(request_id, sample_index))

    async def ListModels(
        self, request: gateway_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.ListModelsResponse:
        return gateway_pb2.ListModelsResponse(
            models=[
                gateway_pb2.ModelInfo(
                    id=entry.id,
                    source=entry.source,
                    max_context_length=entry.max_context_length,
                    is_reasoning_model=entry.is_reasoning_model,
                )
                for entry in self.models
            ]
        )
