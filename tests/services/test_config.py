"""Service configuration: flags win over CLEAVE_* variables, which win over defaults."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from cleave.api_keys import bearer
from cleave.config import DEFAULT_MAX_MESSAGE_BYTES, gateway_api_keys, gateway_config, kvstore_config, worker_config
from cleave.worker import engine_config_from_worker
from tests.tls_files import stack_tls


def test_defaults():
    config = gateway_config([], {})
    assert config.service.listen == "0.0.0.0:50051"
    # the gateway takes prompts, not KV: a lower limit than the workers' (see test_input_limits)
    assert config.service.rpc.max_message_bytes == 32 * 1024 * 1024 < DEFAULT_MAX_MESSAGE_BYTES == 256 * 1024 * 1024
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


def test_gil_switch_interval_from_flag_or_environment_default_python_s():
    assert worker_config("decode", [], {}).service.gil_switch_interval_ms is None
    assert worker_config("decode", ["--gil-switch-interval-ms", "0.5"], {}).service.gil_switch_interval_ms == 0.5
    assert gateway_config([], {"CLEAVE_GIL_SWITCH_INTERVAL_MS": "1"}).service.gil_switch_interval_ms == 1.0


def test_prefill_layer_streaming_flag():
    assert worker_config("prefill", [], {}).layer_streaming == "auto"
    assert worker_config("prefill", ["--layer-streaming", "off"], {}).layer_streaming == "off"
    with pytest.raises(SystemExit):
        worker_config("prefill", ["--layer-streaming", "sometimes"], {})


def test_tensor_parallel_size_is_a_decode_flag():
    assert worker_config("decode", [], {}).tensor_parallel_size == 1
    assert worker_config("decode", ["--tensor-parallel-size", "2"], {}).tensor_parallel_size == 2
    assert engine_config_from_worker(worker_config("decode", ["--tensor-parallel-size", "2"], {})).tensor_parallel_size == 2
    with pytest.raises(SystemExit, match="prefill workers run one rank"):
        worker_config("prefill", ["--tensor-parallel-size", "2"], {})
    with pytest.raises(SystemExit, match="must be >= 1"):
        worker_config("decode", ["--tensor-parallel-size", "0"], {})


def test_worker_and_kvstore_configs():
    worker = worker_config("decode", ["--num-kv-blocks", "512", "--kvstore", "kv:50081"], {"CLEAVE_DEVICE": "cpu"})
    assert (worker.service.listen, worker.device, worker.num_kv_blocks, worker.kvstore_address) == (
        "127.0.0.1:50071", "cpu", 512, "kv:50081")  # internal services default to loopback
    assert worker.kv_listen == "127.0.0.1:0"
    store = kvstore_config(["--disk-path", "/data/kv"], {"CLEAVE_RAM_BYTES": "1024"})
    assert (store.ram_bytes, store.disk_path) == (1024, Path("/data/kv"))


@pytest.mark.parametrize(
    ("argv", "env"),
    [(["--num-kv-blocks", "-1"], {}), ([], {"CLEAVE_LOG_JSON": "maybe"}), (["--max-message-bytes", "0"], {}),
     (["--gil-switch-interval-ms", "0"], {})],
)
def test_invalid_values_exit_with_a_message(argv, env):
    with pytest.raises(SystemExit):
        worker_config("prefill", argv, env)


def test_internal_token_from_environment_or_file_and_hidden_from_repr(tmp_path):
    assert worker_config("decode", [], {}).service.internal_token is None  # auth off
    config = kvstore_config([], {"CLEAVE_INTERNAL_TOKEN": "from-env"})
    assert config.service.internal_token == "from-env" and "from-env" not in repr(config)
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    argv = ["--internal-token-file", str(token_file)]
    assert worker_config("prefill", argv, {"CLEAVE_INTERNAL_TOKEN": "from-env"}).service.internal_token == "from-file"
    assert gateway_config([], {"CLEAVE_INTERNAL_TOKEN_FILE": str(token_file)}).service.internal_token == "from-file"
    token_file.write_text("")
    with pytest.raises(SystemExit, match="is empty"):
        worker_config("decode", argv, {})
    with pytest.raises(SystemExit, match="cannot read"):
        worker_config("decode", ["--internal-token-file", str(tmp_path / "missing")], {})


def test_api_key_from_flag_or_environment_off_when_unset():
    assert gateway_config([], {}).api_keys is None
    assert gateway_config([], {"CLEAVE_API_KEY": ""}).api_keys is None  # compose passes an empty one
    config = gateway_config([], {"CLEAVE_API_KEY": "sk-env"})
    assert config.api_keys.keys == ("sk-env",) and "sk-env" not in repr(config)
    assert not config.api_keys.isolates
    assert gateway_config(["--api-key", "sk-flag"], {"CLEAVE_API_KEY": "sk-env"}).api_keys.keys == ("sk-flag",)


def test_an_api_key_file_adds_a_key_a_line_and_several_keys_are_tenants(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# tenants\nsk-a\n\n  sk-b  \n")
    config = gateway_config(["--api-key-file", str(keys)], {"CLEAVE_API_KEY": "sk-env"})
    assert config.api_keys.keys == ("sk-env", "sk-a", "sk-b") and config.api_keys.isolates
    assert "sk-a" not in repr(config)
    assert gateway_config([], {"CLEAVE_API_KEY_FILE": str(keys)}).api_keys.keys == ("sk-a", "sk-b")
    assert gateway_api_keys({"CLEAVE_API_KEY_FILE": str(keys)}).keys == ("sk-a", "sk-b")


@pytest.mark.parametrize("content, message", [
    ("# nothing but a comment\n", "holds no key"),
    ("sk-a\nsk-a\n", "given twice"),
    (None, "cannot read"),
])
def test_a_bad_api_key_file_stops_the_gateway_naming_the_flag(tmp_path, content, message):
    keys = tmp_path / "keys"
    if content is not None:
        keys.write_text(content)
    with pytest.raises(SystemExit, match=message) as raised:
        gateway_config(["--api-key-file", str(keys)], {})
    assert "--api-key-file" in str(raised.value)


def test_a_key_line_may_carry_a_priority_floor_taken_with_the_priority_policy(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("sk-batch   priority>=5\nsk-vip priority>=-10\nsk plain\n")
    config = gateway_config(["--api-key-file", str(keys), "--scheduling-policy", "priority"], {})
    api_keys = config.api_keys
    assert api_keys.keys == ("sk-batch", "sk-vip", "sk plain") and api_keys.has_priority_floors
    floors = [api_keys.priority_floor(api_keys.tenant(bearer(key))) for key in api_keys.keys]
    assert floors == [5, -10, None]
    assert "sk-batch" not in repr(config)
    with pytest.raises(SystemExit, match="--scheduling-policy priority"):
        gateway_config(["--api-key-file", str(keys)], {})


@pytest.mark.parametrize("content, message", [
    ("sk-a priority>=high\nsk-b\n", "takes an integer, got 'high'"),
    ("sk-a priority>=2147483648\nsk-b\n", "must be an integer in"),
    ("sk-a priority>=1\n", "two or more keys"),
])
def test_a_bad_priority_floor_stops_the_gateway_naming_the_flag(tmp_path, content, message):
    keys = tmp_path / "keys"
    keys.write_text(content)
    with pytest.raises(SystemExit, match=message) as raised:
        gateway_config(["--api-key-file", str(keys), "--scheduling-policy", "priority"], {})
    assert "--api-key-file" in str(raised.value) and "sk-a" not in str(raised.value)


def test_internal_services_listen_on_loopback_by_default_the_gateway_everywhere():
    assert kvstore_config([], {}).service.listen == "127.0.0.1:50081"
    assert worker_config("prefill", [], {}).service.listen == "127.0.0.1:50061"
    assert worker_config("decode", [], {}).kv_listen == "127.0.0.1:0"
    assert gateway_config([], {}).service.listen == "0.0.0.0:50051"
    assert worker_config("decode", ["--listen", "0.0.0.0:50071"], {}).service.listen == "0.0.0.0:50071"


def test_conditional_policy_flags_from_flag_or_environment_and_never_negative():
    config = gateway_config([], {})
    assert (config.local_prefill_max_running, config.remote_prefill_busy_max_queue_tokens) == (32, 8192)
    config = gateway_config(["--local-prefill-max-running", "8"], {"CLEAVE_REMOTE_PREFILL_BUSY_MAX_QUEUE_TOKENS": "0"})
    assert (config.local_prefill_max_running, config.remote_prefill_busy_max_queue_tokens) == (8, 0)
    with pytest.raises(SystemExit, match="--local-prefill-max-running must be >= 0"):
        gateway_config(["--local-prefill-max-running", "-1"], {})
    with pytest.raises(SystemExit, match="--local-prefill-max-tokens must be >= 0"):
        gateway_config([], {"CLEAVE_LOCAL_PREFILL_MAX_TOKENS": "-5"})


def test_prefill_graph_max_tokens_is_a_worker_flag_on_cuda_by_default():
    from cleave.worker.engine_setup import engine_config_from_worker

    assert worker_config("prefill", [], {}).prefill_graph_max_tokens == 1024
    assert engine_config_from_worker(worker_config("prefill", [], {})).prefill_graph_max_tokens == 1024
    config = worker_config("decode", ["--prefill-graph-max-tokens", "256", "--device", "cuda:1"], {})
    assert engine_config_from_worker(config).prefill_graph_max_tokens == 256
    assert engine_config_from_worker(worker_config("decode", ["--prefill-graph-max-tokens", "0"], {})
                                     ).prefill_graph_max_tokens == 0
    # off CUDA the worker prefills eagerly whatever the flag says
    cpu = worker_config("prefill", ["--device", "cpu"], {})
    assert cpu.prefill_graph_max_tokens == 1024
    assert engine_config_from_worker(cpu).prefill_graph_max_tokens == 0
    with pytest.raises(SystemExit, match="--prefill-graph-max-tokens"):
        worker_config("prefill", ["--prefill-graph-max-tokens", "-1"], {})


def test_kv_cache_dtype_is_a_worker_flag_and_env_variable_with_auto_by_default():
    assert worker_config("decode", [], {}).kv_cache_dtype == "auto"
    assert worker_config("decode", ["--kv-cache-dtype", "fp8"], {}).kv_cache_dtype == "fp8"
    assert worker_config("prefill", [], {"CLEAVE_KV_CACHE_DTYPE": "fp8"}).kv_cache_dtype == "fp8"
    assert engine_config_from_worker(worker_config("decode", ["--kv-cache-dtype", "fp8"], {})).cache.kv_cache_dtype == "fp8"
    assert engine_config_from_worker(worker_config("prefill", [], {})).cache.kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        worker_config("prefill", ["--kv-cache-dtype", "int8"], {})


def test_tls_files_from_flags_or_environment_mutual_on_internal_services_only(tmp_path):
    tls = stack_tls(tmp_path / "tls")
    env = {"CLEAVE_TLS_CERT_FILE": str(tls.cert_file), "CLEAVE_TLS_KEY_FILE": str(tls.key_file),
           "CLEAVE_TLS_CA_FILE": str(tls.ca_file)}
    for config in (worker_config("decode", [], env).service, worker_config("prefill", [], env).service,
                   kvstore_config([], env).service):
        assert config.tls == tls and config.rpc.tls == tls and config.rpc.mutual_tls
    gateway = gateway_config([], env).service
    assert gateway.tls == tls and not gateway.rpc.mutual_tls  # its clients authenticate with the API key
    flags = ["--tls-cert-file", str(tls.cert_file), "--tls-key-file", str(tls.key_file)]
    assert worker_config("decode", flags, {}).service.tls == replace(tls, ca_file=None)
    assert worker_config("decode", [], {}).service.tls is None and gateway_config([], {}).service.rpc.tls is None


@pytest.mark.parametrize(("argv", "message"), [
    (["--tls-cert-file", "CERT"], "--tls-key-file is missing"),
    (["--tls-ca-file", "CA"], "--tls-ca-file needs --tls-cert-file and --tls-key-file"),
    (["--tls-cert-file", "CERT", "--tls-key-file", "nowhere.pem"], "--tls-key-file: nowhere.pem is not a readable"),
])
def test_tls_flags_that_do_not_make_a_configuration_exit_naming_the_flag(tmp_path, argv, message):
    tls = stack_tls(tmp_path / "tls")
    argv = [{"CERT": str(tls.cert_file), "CA": str(tls.ca_file)}.get(arg, arg) for arg in argv]
    with pytest.raises(SystemExit, match=message):
        worker_config("decode", argv, {})


def test_max_requests_per_key_defaults_to_no_cap_and_refuses_a_negative_one():
    assert gateway_config([], {}).max_requests_per_key == 0
    assert gateway_config([], {"CLEAVE_MAX_REQUESTS_PER_KEY": "8"}).max_requests_per_key == 8
    with pytest.raises(SystemExit, match="--max-requests-per-key must be >= 0"):
        gateway_config(["--max-requests-per-key", "-1"], {})


def test_max_samples_per_key_defaults_to_no_cap_and_refuses_a_negative_one():
    assert gateway_config([], {}).max_samples_per_key == 0
    assert gateway_config([], {"CLEAVE_MAX_SAMPLES_PER_KEY": "64"}).max_samples_per_key == 64
    flag_over_env = gateway_config(["--max-samples-per-key", "8"], {"CLEAVE_MAX_SAMPLES_PER_KEY": "64"})
    assert flag_over_env.max_samples_per_key == 8
    with pytest.raises(SystemExit, match="--max-samples-per-key must be >= 0"):
        gateway_config(["--max-samples-per-key", "-1"], {})
    with pytest.raises(SystemExit, match="--max-samples-per-key must be >= 0"):
        gateway_config([], {"CLEAVE_MAX_SAMPLES_PER_KEY": "-2"})


def test_scheduling_policy_is_fcfs_by_default_and_priority_from_flag_or_environment():
    assert gateway_config([], {}).scheduling_policy == "fcfs"
    assert gateway_config(["--scheduling-policy", "priority"], {}).scheduling_policy == "priority"
    assert gateway_config([], {"CLEAVE_SCHEDULING_POLICY": "priority"}).scheduling_policy == "priority"
    assert gateway_config(["--scheduling-policy", "fcfs"], {"CLEAVE_SCHEDULING_POLICY": "priority"}).scheduling_policy == "fcfs"
    with pytest.raises(SystemExit):
        gateway_config(["--scheduling-policy", "lifo"], {})


@pytest.mark.parametrize(("flag", "variable", "config"), [
    ("--scheduling-policy", "CLEAVE_SCHEDULING_POLICY", lambda env: gateway_config([], env)),
    ("--mode", "CLEAVE_MODE", lambda env: gateway_config([], env)),
    ("--kv-cache-dtype", "CLEAVE_KV_CACHE_DTYPE", lambda env: worker_config("decode", [], env)),
    ("--layer-streaming", "CLEAVE_LAYER_STREAMING", lambda env: worker_config("prefill", [], env)),
])
def test_a_choice_from_the_environment_outside_its_choices_exits_naming_flag_and_variable(flag, variable, config):
    """argparse checks choices on the command line only: a variable's value is checked too."""
    with pytest.raises(SystemExit, match=f"{flag} \\({variable}\\): 'bogus' is not one of"):
        config({variable: "bogus"})
