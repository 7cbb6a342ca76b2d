"""Service configuration: flags win over CLEAVE_* variables, which win over defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from cleave.config import DEFAULT_MAX_MESSAGE_BYTES, gateway_config, kvstore_config, worker_config


def test_defaults():
    config = gateway_config([], {})
    assert config.service.listen == "0.0.0.0:50051"
    assert config.service.rpc.max_message_bytes == DEFAULT_MAX_MESSAGE_BYTES == 256 * 1024 * 1024
    assert config.http_listen == "0.0.0.0:8000" and config.mode == "disaggregated"
    assert config.prefill_addresses == () and config.service.log_json is None


def test_environment_then_flags():
    env = {"CLEAVE_LISTEN": "127.0.0.1:7", "CLEAVE_DECODE": "d1:1,d2:2", "CLEAVE_LOG_JSON": "false",
           "CLEAVE_GRACE_SECONDS": "2.5", "CLEAVE_MODEL": "org/m", "CLEAVE_HTTP_LISTEN": ""}
    config = gateway_config(["--decode", "d3:3", "--served-model-name", "m"], env)
    assert config.service.listen == "127.0.0.1:7"
    assert config.decode_addresses == ("d3:3",)  # a flag replaces the variable's list
    assert config.service.log_json is False and config.service.rpc.grace_seconds == 2.5
    assert (config.model.source, config.model.id, config.http_listen) == ("org/m", "m", None)
    assert gateway_config([], env).decode_addresses == ("d1:1", "d2:2")


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        ([], {}, True),
        (["--no-store-to-kvstore"], {}, False),
        ([], {"CLEAVE_STORE_TO_KVSTORE": "off"}, False),
        (["--store-to-kvstore"], {"CLEAVE_STORE_TO_KVSTORE": "false"}, True),  # the flag wins
    ],
)
def test_gateway_store_to_kvstore_from_flag_and_environment(argv, env, expected):
    assert gateway_config(argv, env).store_to_kvstore is expected


def test_bad_store_to_kvstore_variable_exits_naming_it():
    with pytest.raises(SystemExit, match="CLEAVE_STORE_TO_KVSTORE"):
        gateway_config([], {"CLEAVE_STORE_TO_KVSTORE": "sometimes"})


def test_worker_and_kvstore_configs():
    worker = worker_config("decode", ["--num-kv-blocks", "512", "--kvstore", "kv:50081"], {"CLEAVE_DEVICE": "cpu"})
    assert (worker.service.listen, worker.device, worker.num_kv_blocks, worker.kvstore_address) == (
        "0.0.0.0:50071", "cpu", 512, "kv:50081")
    store = kvstore_config(["--disk-path", "/data/kv"], {"CLEAVE_RAM_BYTES": "1024"})
    assert (store.ram_bytes, store.disk_path) == (1024, Path("/data/kv"))


@pytest.mark.parametrize(
    ("argv", "env"),
    [(["--num-kv-blocks", "-1"], {}), ([], {"CLEAVE_LOG_JSON": "maybe"}), (["--max-message-bytes", "0"], {})],
)
def test_invalid_values_exit_with_a_message(argv, env):
    with pytest.raises(SystemExit):
        worker_config("prefill", argv, env)
