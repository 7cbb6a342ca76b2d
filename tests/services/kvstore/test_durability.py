"""The kvstore's disk tier keeps what it acknowledged: a SIGKILL right after a Put loses none of
it, a corrupt block is never reported as stored, and a corrupt layout.json does not stop the
store from starting."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import structlog
import torch

from cleave.transfer.kvstore_client import KVStoreClient
from services.kvstore.store import StoreConfig
from tests.services.kvstore.test_store import BLOCK_BYTES, LAYOUT, Store, chain
from tests.services.test_process import wait_for_port

NUM_PUTS = 40


def _start_kvstore(disk: Path, tmp_path: Path, name: str) -> tuple[subprocess.Popen, str, Path]:
    port_file, log = tmp_path / f"{name}.port", tmp_path / f"{name}.log"
    env = {key: value for key, value in os.environ.items() if key != "CLEAVE_INTERNAL_TOKEN"}
    command = [sys.executable, "-m", "services.kvstore", "--listen", "127.0.0.1:0", "--port-file", str(port_file),
               "--disk-path", str(disk), "--ram-bytes", str(1 << 30), "--disk-bytes", str(1 << 30)]
    with open(log, "wb") as out:
        process = subprocess.Popen(command, env={**env, "CLEAVE_LOG_JSON": "true"}, stderr=out)
    return process, str(port_file), log


@pytest.fixture
def kvstore_processes():
    """Starts kvstore processes; every one is killed and reaped at the end."""
    started: list[subprocess.Popen] = []

    def start(disk: Path, tmp_path: Path, name: str) -> str:
        process, port_file, log = _start_kvstore(disk, tmp_path, name)
        started.append(process)
        return f"127.0.0.1:{wait_for_port(Path(port_file), process, log)}"

    start.processes = started  # type: ignore[attr-defined]
    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait()


async def test_sigkill_right_after_acknowledged_puts_loses_nothing(tmp_path: Path, kvstore_processes):
    disk = tmp_path / "disk"
    address = kvstore_processes(disk, tmp_path, "first")
    chains = [chain(2, seed=100 + index) for index in range(NUM_PUTS)]
    client = KVStoreClient(address, client_id="test")
    try:
        await client.connect(LAYOUT)
        for hashes, blocks in chains:  # each Put acknowledged before the next starts
            assert (await client.put(hashes, blocks)).num_stored == 2
        kvstore_processes.processes[0].kill()  # SIGKILL at once after the last acknowledgement
    finally:
        await client.close()
    assert kvstore_processes.processes[0].wait() == -9
    address = kvstore_processes(disk, tmp_path, "restarted")
    client = KVStoreClient(address, client_id="test")
    try:
        await client.connect(LAYOUT)  # the layout survived too: the same one is accepted
        for hashes, blocks in chains:
            assert await client.lookup(hashes) == 2
            assert torch.equal(await client.get(hashes), blocks)
    finally:
        await client.close()


async def test_a_corrupt_block_is_a_lookup_miss_and_is_deleted(tmp_path: Path):
    config = StoreConfig(ram_bytes=BLOCK_BYTES // 2, disk_path=tmp_path, disk_bytes=1 << 20)
    hashes, blocks = chain(3, seed=11)
    async with Store(config) as store:
        await store.client.put(hashes, blocks)
    path = next(tmp_path.glob(f"blocks/*/{hashes[1].hex()}.kvb"))
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01  # same length: only the checksum can tell
    path.write_bytes(bytes(data))
    async with Store(config) as store:
        assert (await store.client.stats()).num_blocks_disk == 3  # not read at start
        assert await store.client.lookup(hashes) == 1  # never a hit, even before any Get
        assert not path.exists() and store.backend.stats().checksum_failures == 1
        assert await store.client.lookup(hashes[:1]) == 1  # the good one stays
        assert (await store.client.put(hashes[1:], blocks[1:], parent_hash=hashes[0])).num_stored == 1
        assert await store.client.lookup(hashes) == 3
        assert torch.equal(await store.client.get(hashes), blocks)


@pytest.mark.parametrize("layout_text", [b"{not json", b'{"model_id": "tiny"}', b"\xff\xfe"])
async def test_a_corrupt_layout_file_is_moved_aside_and_the_store_starts_empty(tmp_path: Path, layout_text: bytes):
    config = StoreConfig(ram_bytes=1 << 20, disk_path=tmp_path, disk_bytes=1 << 20)
    hashes, blocks = chain(2, seed=12)
    async with Store(config) as store:
        await store.client.put(hashes, blocks)
    (tmp_path / "layout.json").write_bytes(layout_text)
    with structlog.testing.capture_logs() as logs:
        async with Store(config) as store:  # connects with LAYOUT: the store took it as new
            assert await store.client.lookup(hashes) == 0
            assert (await store.client.stats()).num_blocks_disk == 0
            await store.client.put(hashes, blocks)
            assert await store.client.lookup(hashes) == 2
    (aside,) = tmp_path.glob("quarantine-*")
    assert (aside / "layout.json").read_bytes() == layout_text
    assert len(list(aside.glob("blocks/*/*.kvb"))) == 2
    (line,) = [entry["event"] for entry in logs if entry["log_level"] == "error"]
    assert str(tmp_path / "layout.json") in line and str(aside) in line and "starting empty" in line


async def test_puts_of_one_call_share_one_directory_sync(tmp_path: Path, monkeypatch):
    import services.kvstore.disk as disk

    synced: list[Path] = []
    fsync_directory = disk._fsync_directory
    monkeypatch.setattr(disk, "_fsync_directory", lambda path: (synced.append(Path(path)), fsync_directory(path)))
    config = StoreConfig(ram_bytes=1 << 20, disk_path=tmp_path, disk_bytes=1 << 20)
    hashes, blocks = chain(8, seed=13)
    async with Store(config) as store:
        synced.clear()
        await store.client.put(hashes, blocks)
        block_directories = {path.parent for path in tmp_path.glob("blocks/*/*.kvb")}
        assert block_directories <= set(synced)  # every rename made durable before the ack
        assert len(synced) == len(set(synced)) <= len(block_directories) + 1  # each once (+ blocks/)
