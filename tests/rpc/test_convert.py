"""Protobuf <-> domain conversion: validation names the field, round trips are lossless."""

from __future__ import annotations

import pytest

from cleave.errors import InvalidArgument
from cleave.generation.outputs import FinishReason
from cleave.generation.sampling_params import SamplingParams
from cleave.proto.cleave.v1 import common_pb2
from cleave.rpc import convert, types


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.5}, "sampling.temperature"),
        ({"temperature": float("nan")}, "sampling.temperature"),
        ({"top_p": 0.0}, "sampling.top_p"),
        ({"top_p": 1.5}, "sampling.top_p"),
        ({"min_p": 2.0}, "sampling.min_p"),
        ({"n": convert.MAX_SAMPLES + 1}, "sampling.n"),
        ({"logprobs": 21}, "sampling.logprobs"),
        ({"repetition_penalty": 0.0}, "sampling.repetition_penalty"),
        ({"presence_penalty": 3.0}, "sampling.presence_penalty"),
        ({"max_tokens": 4, "min_tokens": 5}, "sampling.min_tokens"),
        ({"stop": ["ok", ""]}, "sampling.stop[1]"),
        ({"stop_token_ids": [1, 2**31]}, "sampling.stop_token_ids[1]"),
        ({"logit_bias": {5: 100.5}}, "sampling.logit_bias.5"),
        ({"logit_bias": {5: float("nan")}}, "sampling.logit_bias.5"),
        ({"logit_bias": {i: 1.0 for i in range(1025)}}, "sampling.logit_bias"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(InvalidArgument) as raised:
        convert.sampling_from_proto(common_pb2.SamplingParams(**kwargs))
    assert raised.value.field == field


def test_sampling_defaults_and_presence():
    params = convert.sampling_from_proto(common_pb2.SamplingParams(temperature=0.0))
    assert params == SamplingParams(temperature=0.0, max_tokens=None)  # explicit 0 is kept: greedy
    unset = convert.sampling_from_proto(common_pb2.SamplingParams())
    assert (unset.temperature, unset.top_p, unset.max_tokens, unset.n) == (1.0, 1.0, None, 1)
    assert convert.sampling_from_proto(common_pb2.SamplingParams(skip_special_tokens=False)).skip_special_tokens is False


def test_sampling_min_tokens_and_logit_bias_arrive_and_reasoning_applies():
    params = convert.sampling_from_proto(common_pb2.SamplingParams(min_tokens=2, max_tokens=4,
                                                                   logit_bias={7: -100.0, 3: 2.5}))
    assert (params.min_tokens, params.logit_bias) == (2, {3: 2.5, 7: -100.0})
    assert convert.sampling_from_proto(common_pb2.SamplingParams()).logit_bias is None
    options = types.ReasoningOptions(types.ReasoningMode.HIDDEN, max_thinking_tokens=9, min_thinking_tokens=2)
    params = convert.sampling_from_proto(common_pb2.SamplingParams(), reasoning=options)
    assert (params.max_thinking_tokens, params.min_thinking_tokens, params.include_reasoning) == (9, 2, False)


def test_sampling_round_trip():
    params = SamplingParams(
        max_tokens=64, temperature=0.75, top_p=0.875, top_k=40, seed=0, stop=["</s>"],
        stop_token_ids=[2, 7], n=4, logprobs=0, repetition_penalty=1.125, skip_special_tokens=False,
        min_tokens=3, logit_bias={11: -100.0, 4: 0.5}, cache_salt="tenant-a", priority=-3,
    )
    wire = common_pb2.SamplingParams.FromString(convert.sampling_to_proto(params).SerializeToString())
    back = convert.sampling_from_proto(wire)
    assert back.seed == 0 and back.logprobs == 0  # zero survives thanks to `optional`
    assert back == params  # the floats chosen are exact in float32


def test_transfer_handle_round_trip():
    layout = types.KVLayout("tiny", "bfloat16", 16, 2, 4, 64, "ns")
    handle = types.TransferHandle(
        transport=types.TransportKind.TCP, address="10.0.0.2:7000", transfer_id="t-1",
        block_ids=(5, 9, 3), layout=layout, device_index=0, deadline_unix_s=1_700_000_000.25,
        num_cached_blocks=1, worker_id="decode-0",
    )
    assert convert.transfer_handle_from_proto(convert.transfer_handle_to_proto(handle)) == handle


def test_a_tensor_parallel_handle_carries_every_ranks_handle():
    def rank_layout(rank: int) -> types.KVLayout:
        return types.KVLayout("tiny", "float32", 4, 2, 1, 8, "ns", kv_head_start=rank, total_kv_heads=2)

    rank_1 = types.TransferHandle(transport=types.TransportKind.TCP, address="127.0.0.1:7001", transfer_id="t-1/rank1",
                                  block_ids=(4, 2), layout=rank_layout(1), deadline_unix_s=1_700_000_000.5)
    handle = types.TransferHandle(transport=types.TransportKind.TCP, address="127.0.0.1:7000", transfer_id="t-1",
                                  block_ids=(4, 2), layout=rank_layout(0), rank_handles=(rank_1,))
    back = convert.transfer_handle_from_proto(convert.transfer_handle_to_proto(handle))
    assert back == handle and back.rank_handles[0].layout.heads == range(1, 2)
    broken = convert.transfer_handle_to_proto(handle)
    broken.rank_handles[0].ClearField("address")
    with pytest.raises(InvalidArgument) as raised:
        convert.transfer_handle_from_proto(broken)
    assert raised.value.field == "destination.rank_handles[0].address"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"transfer_id": "t", "block_ids": [1], "address": "h:1"}, "destination.transport"),
        ({"transport": common_pb2.TRANSPORT_KIND_TCP, "block_ids": [1], "address": "h:1"}, "destination.transfer_id"),
        ({"transport": common_pb2.TRANSPORT_KIND_TCP, "transfer_id": "t", "address": "h:1"}, "destination.block_ids"),
        ({"transport": common_pb2.TRANSPORT_KIND_TCP, "transfer_id": "t", "block_ids": [1]}, "destination.address"),
        ({"transport": common_pb2.TRANSPORT_KIND_NCCL, "transfer_id": "t", "block_ids": [1]}, "destination.nccl_unique_id"),
    ],
)
def test_bad_transfer_handles_name_the_field(kwargs, field):
    with pytest.raises(InvalidArgument) as raised:
        convert.transfer_handle_from_proto(common_pb2.TransferHandle(**kwargs))
    assert raised.value.field == field


def test_tensor_bytes_must_match_shape_and_dtype():
    good = common_pb2.Tensor(dtype=common_pb2.DTYPE_BFLOAT16, shape=[2, 3], data=bytes(12))
    assert convert.tensor_from_proto(good, "payload") == types.TensorBytes("bfloat16", (2, 3), bytes(12))
    short = common_pb2.Tensor(dtype=common_pb2.DTYPE_FLOAT32, shape=[2, 3], data=bytes(12))
    with pytest.raises(InvalidArgument, match="holds 12 bytes but shape \\[2, 3\\] of float32 needs 24") as raised:
        convert.tensor_from_proto(short, "payload")
    assert raised.value.field == "payload.data"
    with pytest.raises(InvalidArgument) as raised:
        convert.tensor_from_proto(common_pb2.Tensor(shape=[1], data=b"x"), "payload")
    assert raised.value.field == "payload.dtype"


def test_every_wire_dtype_has_an_itemsize():
    wire_names = {name for name in common_pb2.DType.keys() if name != "DTYPE_UNSPECIFIED"}
    assert {f"DTYPE_{name.upper()}" for name in convert.DTYPE_ITEMSIZE} == wire_names


def test_finish_reasons_map_both_ways():
    for reason in FinishReason:
        assert convert.finish_reason_from_proto(convert.finish_reason_to_proto(reason)) is reason
    assert convert.finish_reason_to_proto(None) == common_pb2.FINISH_REASON_UNSPECIFIED
