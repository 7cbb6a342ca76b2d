"""CUDA IPC handle encoding, NCCL library discovery / unique ids, transport choice (CPU)."""

from __future__ import annotations

import pytest

from cleave.errors import InvalidArgument, Unavailable
from cleave.rpc.convert import transfer_handle_from_proto, transfer_handle_to_proto
from cleave.rpc.types import TransferHandle, TransportKind
from cleave.transfer import EndpointInfo, IpcTensorHandle, choose_transport
from cleave.transfer import nccl

HANDLE = IpcTensorHandle(
    gpu_uuid="GPU-1234", device=3, handle=bytes(range(64)), storage_size_bytes=1 << 33,
    storage_offset_bytes=512, ref_counter_handle=b"/torch_123_456", ref_counter_offset=8,
    event_handle=b"\x01" * 64, event_sync_required=True, dtype="bfloat16", tensor_offset=0,
    shape=(16, 2, 4096, 16, 8, 64), stride=(2 * 4096 * 8192, 4096 * 8192, 8192, 512, 64, 1),
)


def test_ipc_handle_round_trips_through_transfer_handle():
    data = HANDLE.to_bytes()
    handle = TransferHandle(transport=TransportKind.CUDA_IPC, address="h:1", transfer_id="t",
                            block_ids=(4, 5), cuda_ipc_handle=data, device_index=0)
    wire = transfer_handle_to_proto(handle).SerializeToString()
    decoded = transfer_handle_from_proto(type(transfer_handle_to_proto(handle)).FromString(wire))
    assert IpcTensorHandle.from_bytes(decoded.cuda_ipc_handle) == HANDLE


def test_ipc_handle_rejects_garbage():
    data = HANDLE.to_bytes()
    with pytest.raises(InvalidArgument, match="bad magic"):
        IpcTensorHandle.from_bytes(b"X" + data[1:])
    with pytest.raises(InvalidArgument, match="truncated"):
        IpcTensorHandle.from_bytes(data[:-3])
    with pytest.raises(InvalidArgument, match="trailing"):
        IpcTensorHandle.from_bytes(data + b"\0")


def test_nccl_unique_id_bytes():
    raw = bytes(range(128))
    assert nccl.unique_id_to_bytes(nccl.unique_id_from_bytes(raw)) == raw
    with pytest.raises(InvalidArgument, match="128 bytes"):
        nccl.unique_id_from_bytes(raw[:100])


def test_nccl_library_missing_is_unavailable(tmp_path):
    with pytest.raises(Unavailable, match="cannot load libnccl"):
        nccl.NcclLibrary(str(tmp_path / "libnccl.so.2"))


def test_nccl_library_when_present():
    try:
        library = nccl.NcclLibrary()
    except Unavailable as exc:
        pytest.skip(f"libnccl not loadable here (CPU torch): {exc}")
    assert library.version >= 20000
    unique_id = library.unique_id()
    assert len(unique_id) == 128 and unique_id != library.unique_id()


ALL = frozenset(TransportKind)


@pytest.mark.parametrize(("sender", "receiver", "expected"), [
    (EndpointInfo("a", "cuda", 0, "GPU-0", ALL), EndpointInfo("a", "cuda", 0, "GPU-0", ALL), TransportKind.CUDA_IPC),
    (EndpointInfo("a", "cuda", 0, "GPU-0", ALL), EndpointInfo("a", "cuda", 1, "GPU-1", ALL), TransportKind.NCCL),
    (EndpointInfo("a", "cuda", 0, "GPU-0", ALL), EndpointInfo("b", "cuda", 0, "GPU-9", ALL), TransportKind.NCCL),
    (EndpointInfo("a", "cuda", 0, "GPU-0", frozenset({TransportKind.TCP, TransportKind.CUDA_IPC})),
     EndpointInfo("a", "cuda", 1, "GPU-1", ALL), TransportKind.TCP),
    (EndpointInfo("a", "cuda", 0, "GPU-0", frozenset({TransportKind.TCP, TransportKind.NCCL})),
     EndpointInfo("a", "cuda", 0, "GPU-0", ALL), TransportKind.TCP),  # NCCL refuses one GPU
    (EndpointInfo("a", "cpu"), EndpointInfo("a", "cpu"), TransportKind.TCP),
    (EndpointInfo("a", "cuda", 0, "GPU-0", ALL), EndpointInfo("a", "cpu"), TransportKind.TCP),
])
def test_choose_transport(sender, receiver, expected):
    assert choose_transport(sender, receiver) is expected
