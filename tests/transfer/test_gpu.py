"""GPU transports: CUDA IPC between two processes on one GPU (and the device memory of a peer
that died coming back once its mapping is let go), NCCL between two GPUs, TCP from/to CUDA
caches, and the block-copy kernel on the device."""

from __future__ import annotations

import asyncio
import hashlib
import sys
import tempfile
from pathlib import Path
from typing import IO

import pytest
import torch

from cleave.proto.cleave.v1 import common_pb2
from cleave.rpc.convert import transfer_handle_from_proto
from cleave.transfer import IpcCacheMap, KVReceiver, KVTransferClient, copy_blocks, copy_blocks_reference
from tests.transfer.peer import SHAPE

PEER = Path(__file__).with_name("peer.py")
multigpu = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices")


def source_cache(device: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(7)
    shape = (SHAPE["num_layers"], 2, SHAPE["num_blocks"], SHAPE["block_size"], SHAPE["num_kv_heads"], SHAPE["head_dim"])
    return torch.randn(shape, generator=generator).to(torch.bfloat16).to(device)


def digest(cache: torch.Tensor, block_ids: list[int]) -> str:
    blocks = cache[:, :, block_ids].contiguous().cpu()
    return hashlib.sha256(blocks.view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


async def run_peer(transport: str, device: int, dst_ids: list[int], src_ids: list[int],
                   sender_device: int, nccl_id: bytes = b"", mode: str = "per_layer") -> int:
    """Send `src_ids` into a peer process's `dst_ids`; returns the CUDA IPC frames written.

    mode: "per_layer" (send_layer per layer, as a prefill forward would), "send_all", or
    "late_producer" (the KV is written on another stream after a device-side delay and the
    sender orders its copy after that stream's event)."""
    stderr = tempfile.TemporaryFile()  # a file, not a pipe: an unread pipe could block the peer
    process = await asyncio.create_subprocess_exec(
        sys.executable, str(PEER), "--transport", transport, "--device", str(device),
        "--blocks", ",".join(map(str, dst_ids)), "--nccl-id", nccl_id.hex(),
        stdout=asyncio.subprocess.PIPE, stderr=stderr)
    client = KVTransferClient()
    try:
        comm_task = None
        if transport == "nccl":
            from cleave.transfer.nccl import NcclCommunicator

            comm_task = asyncio.ensure_future(NcclCommunicator.create(nccl_id, rank=0, device=sender_device))
        line = (await _peer_line(process, stderr, 90)).split()
        assert line and line[0] == "HANDLE", line
        handle = transfer_handle_from_proto(common_pb2.TransferHandle.FromString(bytes.fromhex(line[1])))
        if comm_task is not None:
            client.add_nccl_peer(handle.address, await comm_task)
        src = source_cache(f"cuda:{sender_device}")
        sender = await client.open(handle)
        if mode == "send_all":
            await sender.send_all(src, src_ids, timeout_s=60)
        elif mode == "late_producer":
            values, src = src, torch.zeros_like(src)
            producer = torch.cuda.Stream(src.device)
            with torch.cuda.stream(producer):
                torch.cuda._sleep(200_000_000)  # ~0.1 s of device time before the KV exists
                src.copy_(values)
                written = torch.cuda.Event()
                written.record(producer)
            for layer in range(src.shape[0]):
                await sender.send_layer(layer, src, src_ids, ready=written)
            await sender.finish(timeout_s=60)
        else:
            for layer in range(src.shape[0]):  # layer by layer, as a prefill forward would
                await sender.send_layer(layer, src, src_ids)
            await sender.finish(timeout_s=60)
        result = (await _peer_line(process, stderr, 60)).split()
        assert result == ["DIGEST", digest(src, src_ids)]
        # The peer shuts its receiver down while this side still holds the connection (and
        # the mapping), as a decode worker stopping under a live prefill worker would; its
        # exit closes the connection, and this side lets go of the mapping with it.
        assert await _peer_exit(process, stderr, 60) == 0
        if transport == "cuda_ipc":
            await _until(lambda: len(client.ipc_caches) == 0, 30, "the dead peer's cache is still mapped")
        return sender.num_frames
    finally:
        await client.close()
        if process.returncode is None:
            process.kill()
            await process.wait()
        stderr.close()


async def _peer_line(process: asyncio.subprocess.Process, stderr: IO[bytes], timeout_s: float) -> str:
    """The peer's next stdout line; on a timeout, fail with what the peer wrote to stderr."""
    reading = process.stdout.readline()
    return (await _bounded(reading, process, stderr, timeout_s, "said nothing")).decode()


async def _until(condition, timeout_s: float, failure: str) -> None:  # type: ignore[no-untyped-def]
    """Until `condition()` holds (it turns on an event of another task: a connection's close)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, failure
        await asyncio.sleep(0.01)


async def _peer_exit(process: asyncio.subprocess.Process, stderr: IO[bytes], timeout_s: float) -> int:
    """The peer's exit status; if it does not exit in time, fail with its stderr."""
    return await _bounded(process.wait(), process, stderr, timeout_s, "did not exit")


async def _bounded(waiting, process: asyncio.subprocess.Process, stderr: IO[bytes], timeout_s: float, what: str):
    try:
        return await asyncio.wait_for(waiting, timeout_s)
    except asyncio.TimeoutError:
        process.kill()
        await process.wait()
        stderr.seek(0)
        said = stderr.read().decode(errors="replace")
        pytest.fail(f"the receiver process {what} for {timeout_s} s; its stderr:\n{said[-4000:]}")


@pytest.mark.gpu
async def test_cuda_ipc_two_processes_one_gpu():
    await run_peer("cuda_ipc", 0, dst_ids=[3, 17, 4, 30, 0], src_ids=[9, 1, 2, 31, 8], sender_device=0)


@pytest.mark.gpu
async def test_cuda_ipc_send_all_is_one_frame():
    frames = await run_peer("cuda_ipc", 0, dst_ids=[3, 17, 4, 30, 0], src_ids=[9, 1, 2, 31, 8], sender_device=0,
                            mode="send_all")
    assert frames == 1


@pytest.mark.gpu
async def test_cuda_ipc_copies_wait_for_the_producer_event():
    frames = await run_peer("cuda_ipc", 0, dst_ids=[6, 7, 1], src_ids=[2, 30, 11], sender_device=0,
                            mode="late_producer")
    # Copied before the producer wrote, the peer would hold zeros and its digest differ.
    assert 1 <= frames <= SHAPE["num_layers"]


@pytest.mark.gpu
async def test_tcp_between_cuda_caches():
    await run_peer("tcp", 0, dst_ids=[5, 6, 2], src_ids=[0, 11, 7], sender_device=0)


@pytest.mark.gpu
async def test_tcp_in_process_cuda_to_cuda():
    receiver = KVReceiver(torch.zeros_like(source_cache("cuda")))
    await receiver.start()
    src = source_cache("cuda")
    pending = receiver.expect("t", [1, 2, 3], timeout_s=30)
    client = KVTransferClient()
    await (await client.open(pending.handle)).send_all(src, [7, 5, 3])
    await pending.wait()
    assert torch.equal(receiver.kv_cache[:, :, [1, 2, 3]], src[:, :, [7, 5, 3]])
    await client.close()
    await receiver.close()


@pytest.mark.gpu
def test_block_copy_kernel_on_device():
    src = source_cache("cuda")
    src_ids = torch.tensor([31, 0, 5, 6], device="cuda")
    dst_ids = torch.tensor([2, 9, 10, 30], device="cuda")
    expected, got = torch.zeros_like(src), torch.zeros_like(src)
    copy_blocks_reference(src, expected, src_ids, dst_ids, range(src.shape[0]))
    copy_blocks(src, got, src_ids, dst_ids)
    assert torch.equal(got, expected)


@pytest.mark.multigpu
@multigpu
async def test_nccl_between_two_gpus():
    from cleave.transfer.nccl import NcclLibrary

    unique_id = NcclLibrary().unique_id()
    await run_peer("nccl", 1, dst_ids=[4, 5, 6, 20], src_ids=[0, 2, 30, 12], sender_device=0, nccl_id=unique_id)


EXPORTER = """
import sys, torch
from cleave.transfer import export_tensor
cache = torch.empty(int(sys.argv[1]), dtype=torch.uint8, device="cuda:0")
print(export_tensor(cache).to_bytes().hex(), flush=True)
sys.stdin.readline()  # alive until killed
"""


@pytest.mark.gpu
async def test_a_dead_peers_cache_is_freed_once_its_mapping_is_let_go():
    """A decode worker's KV cache, mapped by a prefill worker, outlives the decode worker's
    death while mapped: its restart would find its share of the device taken."""
    size = 2 << 30
    torch.cuda.init()
    free_before = torch.cuda.mem_get_info(0)[0]
    stderr = tempfile.TemporaryFile()
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", EXPORTER, str(size), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=stderr)
    caches = IpcCacheMap()
    try:
        handle = bytes.fromhex(await _peer_line(process, stderr, 90))
        caches.open(handle, "decode-0")
        process.kill()  # as a SIGKILLed decode worker
        await _peer_exit(process, stderr, 60)
        held = free_before - torch.cuda.mem_get_info(0)[0]  # its cache, while mapped here (diagnostic)
        assert caches.forget_peer("decode-0") == 1
        torch.cuda.synchronize()
        deadline = asyncio.get_running_loop().time() + 30
        while free_before - torch.cuda.mem_get_info(0)[0] > size // 4:  # the driver frees it a moment after
            assert asyncio.get_running_loop().time() < deadline, f"still taken after the unmapping ({held} bytes while mapped)"
            await asyncio.sleep(0.05)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        stderr.close()
