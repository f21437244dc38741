"""deploy/: what can be checked without a Docker engine or systemd as PID 1.

Compose and Prometheus files parse and wire the three services by name on the CLI's
default ports; healthchecks probe /ready or /health; systemd units start real `pdserve`
subcommands and pass `systemd-analyze verify` where it is installed; the example TOML
holds only real config fields and loads for every command.
"""

from __future__ import annotations

import configparser
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import yaml

from common.config import ROLE_HTTP_PORTS, ROLE_KV_PORTS, NodeConfig, load_config
from common.proxy_addresses import parse_proxy_list
from pdserve import launcher
from proxy.config import ProxyConfig

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
UNITS = {cmd: DEPLOY / "systemd" / f"pdserve-{cmd}.service" for cmd in ("proxy", "prefill", "decode")}
PROXY2_UNIT = DEPLOY / "systemd" / "pdserve-proxy2.service"  # the second proxy: `pdserve proxy` too

# The CLI's default ports (ARCHITECTURE.md "Command line"); everything in deploy/ uses them.
PORTS = {"serve": 8000, "prefill": 8100, "decode": 8200, "proxy": 10001, "registry": 30001,
         "prefill_kv": 14579, "decode_kv": 14580}
SUBCOMMANDS = {"serve", "prefill", "decode", "proxy", "up", "down"}


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def gpu_compose() -> dict:
    return yaml.safe_load((DEPLOY / "docker-compose.gpu.yml").read_text())


@pytest.fixture(scope="module")
def example_toml() -> dict:
    with open(DEPLOY / "pdserve.example.toml", "rb") as f:
        return tomllib.load(f)


def read_unit(path: Path) -> configparser.ConfigParser:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # systemd keys are case-sensitive
    unit.read_string(path.read_text())
    return unit


# ---------------------------------------------------------------------------- defaults

def test_default_ports_match_the_config_models_and_launcher():
    options = launcher.UpOptions()
    assert (options.proxy_port, options.registry_port) == (PORTS["proxy"], PORTS["registry"])
    assert (options.prefill_port, options.decode_port) == (PORTS["prefill"], PORTS["decode"])
    assert (options.prefill_kv_port, options.decode_kv_port) == (PORTS["prefill_kv"],
                                                                 PORTS["decode_kv"])
    assert ROLE_HTTP_PORTS == {"both": PORTS["serve"], "prefill": PORTS["prefill"],
                               "decode": PORTS["decode"]}
    assert (ROLE_KV_PORTS["prefill"], ROLE_KV_PORTS["decode"]) == (PORTS["prefill_kv"],
                                                                   PORTS["decode_kv"])
    proxy = ProxyConfig()
    assert (proxy.port, proxy.registry_port) == (PORTS["proxy"], PORTS["registry"])


# ---------------------------------------------------------------------------- compose

def test_compose_runs_exactly_two_proxies_and_the_daemons_plus_optional_prometheus(compose):
    services = compose["services"]
    always = {name for name, svc in services.items() if not svc.get("profiles")}
    assert always == {"proxy", "proxy2", "prefill", "decode"}
    assert services["prometheus"]["profiles"] == ["monitoring"]


def test_compose_commands_point_at_each_other_by_service_name(compose):
    services = compose["services"]
    for name in ("proxy", "proxy2"):  # each in its own container, on the default ports
        proxy = services[name]["command"]
        assert proxy[:2] == ["pdserve", "proxy"]
        assert flag(proxy, "--host") == flag(proxy, "--registry-host") == "0.0.0.0"
        assert int(flag(proxy, "--port")) == PORTS["proxy"]
        assert int(flag(proxy, "--registry-port")) == PORTS["registry"]
    for role in ("prefill", "decode"):
        command = services[role]["command"]
        assert command[:2] == ["pdserve", role]
        assert flag(command, "--host") == "0.0.0.0"
        assert flag(command, "--kv-host") == role
        # both proxies, each heartbeated (the flag parses as two entries)
        assert flag(command, "--proxy") == f"proxy:{PORTS['registry']},proxy2:{PORTS['registry']}"
        assert [str(e) for e in parse_proxy_list(flag(command, "--proxy"))] == [
            f"proxy:{PORTS['registry']}", f"proxy2:{PORTS['registry']}"]
        assert int(flag(command, "--port")) == PORTS[role]
        assert int(flag(command, "--kv-port")) == PORTS[f"{role}_kv"]


def test_every_deploy_file_runs_its_cluster_keyed(compose):
    """They bind 0.0.0.0, which a keyless daemon or proxy refuses (issue 33): each process gets
    the key (Kubernetes: test_k8s_manifests.py), and none opts out with --insecure-keyless-network."""
    for name in ("proxy", "proxy2", "prefill", "decode"):
        assert compose["services"][name]["environment"]["PDSERVE_CLUSTER_KEY_FILE"] == "/run/secrets/cluster_key"
        assert "cluster_key" in compose["services"][name]["secrets"]
    lines = (DEPLOY / "systemd" / "pdserve.env").read_text().splitlines()
    assert "PDSERVE_CLUSTER_KEY_FILE=/etc/pdserve/cluster.key" in lines
    for path in [*DEPLOY.glob("*.yml"), *DEPLOY.glob("k8s/*.yaml"), *DEPLOY.glob("systemd/*")]:
        text = path.read_text()
        assert "insecure-keyless-network" not in text and "INSECURE_KEYLESS" not in text, path


def test_compose_publishes_default_ports_and_shares_the_model_cache(compose):
    services = compose["services"]
    for name in ("proxy", "prefill", "decode"):
        published = [str(p).rsplit(":", 1)[-1] for p in services[name]["ports"]]
        assert published == [str(PORTS[name])]
        assert "model-cache:/var/cache/pdserve" in services[name]["volumes"]
    assert services["proxy2"]["ports"] == [f"{PORTS['proxy'] + 1}:{PORTS['proxy']}"]  # the second on 10002
    assert "model-cache" in compose["volumes"]


def test_compose_healthchecks_probe_ready_and_ordering_cannot_deadlock(compose):
    services = compose["services"]
    for name in ("proxy", "proxy2", "prefill", "decode"):
        probe = " ".join(services[name]["healthcheck"]["test"])
        assert f"127.0.0.1:{PORTS[name.rstrip('2')]}/ready" in probe
        assert "curl" not in probe and "wget" not in probe  # not in the image
    # A proxy is ready only once both daemons registered: they must not wait for it.
    for role in ("prefill", "decode"):
        for proxy in ("proxy", "proxy2"):
            assert services[role]["depends_on"][proxy]["condition"] == "service_started"
    assert services["decode"]["depends_on"]["prefill"]["condition"] == "service_healthy"


def test_compose_builds_the_repo_dockerfile(compose):
    build = compose["services"]["proxy"]["build"]
    assert (DEPLOY / build["context"] / build["dockerfile"]).resolve() == DEPLOY / "Dockerfile"


def gpu_devices(service: dict) -> list[dict]:
    return service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])


def test_compose_alone_requests_no_gpu_so_it_starts_without_one(compose):
    assert all(not gpu_devices(svc) and "gpus" not in svc for svc in compose["services"].values())


def test_gpu_override_reserves_nvidia_gpus_for_the_daemons_only(gpu_compose):
    services = gpu_compose["services"]
    assert set(services) <= {"proxy", "proxy2", "prefill", "decode"}
    assert not gpu_devices(services.get("proxy", {})) and not gpu_devices(services.get("proxy2", {}))
    for role in ("prefill", "decode"):
        devices = gpu_devices(services[role])
        assert devices and all(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
        assert services[role]["environment"]["PDSERVE_DEVICE"] == "cuda"
    for name, svc in services.items():  # every service runs the CUDA image the override builds
        assert svc["image"] == "pdserve:cuda" and svc["build"]["args"]["DEVICE"] == "cuda", name


def test_gpu_override_shares_fit_when_the_daemons_share_a_gpu(gpu_compose):
    """--gpu-memory-utilization is a share of the whole GPU: two on one GPU must fit together."""
    from common.engine.gpu_memory import DEFAULT_GPU_MEMORY_UTILIZATION

    services = gpu_compose["services"]
    ids = [tuple(d.get("device_ids", ["all"])) for role in ("prefill", "decode") for d in gpu_devices(services[role])]
    if ids[0] == ids[1]:
        shares = [float(services[r]["environment"].get("PDSERVE_GPU_MEMORY_UTILIZATION", DEFAULT_GPU_MEMORY_UTILIZATION))
                  for r in ("prefill", "decode")]
        assert sum(shares) <= DEFAULT_GPU_MEMORY_UTILIZATION
        # cuda_ipc between two containers: decode joins prefill's PID and IPC namespaces
        assert services["decode"]["pid"] == services["decode"]["ipc"] == "service:prefill"
        assert services["prefill"]["ipc"] == "shareable"


def test_gpu_override_is_documented_with_the_compose_command():
    command = "docker compose -f deploy/docker-compose.yml -f deploy/docker-compose.gpu.yml up"
    assert command in (DEPLOY / "docker-compose.gpu.yml").read_text()
    assert command in (REPO / "README.md").read_text()


def test_prometheus_scrapes_the_three_metrics_endpoints():
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    targets = {t for job in config["scrape_configs"] for sc in job["static_configs"]
               for t in sc["targets"]}
    assert targets == {f"{name}:{PORTS[name]}" for name in ("proxy", "prefill", "decode")} | {"proxy2:10001"}
    assert all(job.get("metrics_path", "/metrics") == "/metrics"
               for job in config["scrape_configs"])


# ---------------------------------------------------------------------------- Dockerfile

def test_dockerfile_device_arg_torch_pin_healthcheck_and_cmd():
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^ARG DEVICE=cpu$", text, re.M)
    assert re.search(r"^FROM base-\$\{DEVICE\}", text, re.M)
    assert {"base-cpu", "base-cuda"} <= set(re.findall(r" AS (base-\w+)", text))
    pin = re.search(r"torch==([\d.]+)", (REPO / "Makefile").read_text()).group(1)
    assert re.search(rf"^ARG TORCH_VERSION={re.escape(pin)}$", text, re.M)
    assert "download.pytorch.org/whl/cpu" in text
    healthcheck = re.search(r"^HEALTHCHECK .*?\n\s+CMD (.*)$", text, re.M | re.S).group(1)
    assert healthcheck.startswith("python ") and "/health" in healthcheck
    assert re.search(r'^CMD \["pdserve", "serve"\]$', text, re.M)
    exposed = {int(p) for line in re.findall(r"^EXPOSE (.*)$", text, re.M) for p in line.split()}
    assert exposed == set(PORTS.values())


def dockerfile_stage(name: str) -> str:
    """The text of one build stage of deploy/Dockerfile, from its FROM to the next."""
    text = (DEPLOY / "Dockerfile").read_text()
    stages = re.split(r"^(?=FROM )", text, flags=re.M)
    return next(s for s in stages if re.match(rf"FROM \S+ AS {name}$", s, re.M))


def test_cuda_image_can_compile_triton_kernels():
    """Triton compiles its kernels when a daemon starts: a C compiler and the venv Python's headers."""
    stage = dockerfile_stage("base-cuda")
    packages = set(" ".join(re.findall(r"apt-get install ([^&\n]+)", stage)).split())
    assert packages & {"gcc", "build-essential", "clang"}
    venv_python = re.search(r"RUN (python3[\d.]*) -m venv", stage).group(1)
    assert venv_python in packages and f"{venv_python}-dev" in packages


# ---------------------------------------------------------------------------- systemd

@pytest.mark.parametrize("cmd", sorted(UNITS))
def test_unit_starts_its_subcommand_with_the_shared_env_file(cmd):
    service = read_unit(UNITS[cmd])["Service"]
    assert service["ExecStart"] == f"/opt/pdserve/.venv/bin/pdserve {cmd}"
    assert service["User"] == "pdserve"
    assert service["Restart"] == "on-failure"
    assert "EnvironmentFile=/etc/pdserve/pdserve.env" in UNITS[cmd].read_text()
    env = dict(kv.split("=", 1) for kv in service["Environment"].split())
    assert int(env["PDSERVE_PORT"]) == PORTS[cmd]
    other = {"proxy": ("PDSERVE_REGISTRY_PORT", "registry")}.get(cmd, ("PDSERVE_KV_PORT",
                                                                       f"{cmd}_kv"))
    assert int(env[other[0]]) == PORTS[other[1]]


def test_the_second_proxy_unit_runs_a_proxy_on_the_next_ports():
    service = read_unit(PROXY2_UNIT)["Service"]
    assert service["ExecStart"] == "/opt/pdserve/.venv/bin/pdserve proxy"
    assert (service["User"], service["Restart"]) == ("pdserve", "on-failure")
    text = PROXY2_UNIT.read_text()
    assert "EnvironmentFile=/etc/pdserve/pdserve.env" in text and "EnvironmentFile=-/etc/pdserve/proxy2.env" in text
    env = dict(kv.split("=", 1) for kv in service["Environment"].split())
    assert (int(env["PDSERVE_PORT"]), int(env["PDSERVE_REGISTRY_PORT"])) == (PORTS["proxy"] + 1, PORTS["registry"] + 1)


def test_env_file_points_daemons_at_both_registries():
    lines = (DEPLOY / "systemd" / "pdserve.env").read_text().splitlines()
    env = dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))
    assert env["PDSERVE_PROXY"] == f"127.0.0.1:{PORTS['registry']},127.0.0.1:{PORTS['registry'] + 1}"
    assert all(key.startswith("PDSERVE_") for key in env)
    assert "PDSERVE_PORT" not in env  # shared by three units with three ports


def test_unit_subcommands_are_real_cli_subcommands():
    code = "import sys; from pdserve.cli import main; sys.exit(main(sys.argv[1:]))"
    for cmd in UNITS:
        result = subprocess.run([sys.executable, "-c", code, cmd, "--help"], cwd=REPO,
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, f"pdserve {cmd} --help: {result.stderr}"


def test_unit_subcommands_are_documented_commands():
    assert set(UNITS) <= SUBCOMMANDS


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
def test_units_pass_systemd_analyze_verify():
    result = subprocess.run(["systemd-analyze", "verify", *map(str, UNITS.values()), str(PROXY2_UNIT)],
                            capture_output=True, text=True, timeout=60)
    # /opt/pdserve is not installed on a dev machine; every other complaint is a real one.
    problems = [line for line in (result.stdout + result.stderr).splitlines()
                if line.strip() and "is not executable" not in line]
    assert problems == []


# ---------------------------------------------------------------------------- example TOML

def test_example_toml_keys_are_real_config_fields(example_toml):
    node_fields = set(NodeConfig.model_fields) - {"role"}  # role is the subcommand
    top = {k for k, v in example_toml.items() if not isinstance(v, dict)}
    assert top <= node_fields & set(ProxyConfig.model_fields)
    assert set(example_toml["proxy"]) <= set(ProxyConfig.model_fields)
    for table in ("prefill", "decode", "serve"):
        assert set(example_toml[table]) <= node_fields, table


def test_example_toml_documents_every_option():
    text = (DEPLOY / "pdserve.example.toml").read_text()
    documented = set(re.findall(r"^#?\s*(\w+) = ", text, re.M))
    missing = (set(NodeConfig.model_fields) | set(ProxyConfig.model_fields)) - {"role"}
    assert missing - documented == set(), "document these in deploy/pdserve.example.toml"


def test_example_toml_tables_use_the_default_ports(example_toml):
    assert example_toml["proxy"]["port"] == PORTS["proxy"]
    assert example_toml["proxy"]["registry_port"] == PORTS["registry"]
    for role in ("prefill", "decode"):
        assert example_toml[role]["port"] == PORTS[role]
        assert example_toml[role]["kv_port"] == PORTS[f"{role}_kv"]
        assert example_toml[role]["proxy"].endswith(f":{PORTS['registry']}")
    assert example_toml["serve"]["port"] == PORTS["serve"]


@pytest.mark.parametrize("cmd, role", [
    ("proxy", None), ("prefill", "prefill"), ("decode", "decode"),
    ("serve", "both"),
])
def test_example_toml_loads_for_every_command(cmd, role):
    argv = ["--config", str(DEPLOY / "pdserve.example.toml")]
    if role is None:
        config = load_config(ProxyConfig, argv, prog=f"pdserve {cmd}", env={})
        assert config.port == PORTS["proxy"]
    else:
        config = load_config(NodeConfig, argv, prog=f"pdserve {cmd}", fixed={"role": role},
                             env={})
        assert config.port == PORTS["serve" if role == "both" else role]


def test_example_toml_documented_static_nodes_load(tmp_path):
    """The commented `static_*` examples, uncommented, are what the proxy's loader accepts."""
    text = (DEPLOY / "pdserve.example.toml").read_text()
    examples = re.findall(r"^# (static_(?:prefill|decode) = \[.+\])$", text, re.M)
    assert len(examples) == 2
    live = re.sub(r"^static_(prefill|decode) = \[\].*$", "", text, flags=re.M)
    live = live.replace("[proxy]\n", "[proxy]\n" + "\n".join(examples) + "\n")
    path = tmp_path / "pdserve.toml"
    path.write_text(live)
    config = load_config(ProxyConfig, ["--config", str(path)], prog="pdserve proxy", env={})
    nodes = config.static_nodes()
    assert [(n.type, n.http_address, n.zmq_address) for n in nodes] == [
        ("P", "10.0.0.5:8100", "10.0.0.5:14579"), ("P", "10.0.0.6:8100", "10.0.0.6:14579"),
        ("D", "10.0.0.7:8200", "10.0.0.7:14580")]
    assert nodes[1].model == "pdserve-tiny"


def test_example_toml_values_are_the_defaults(example_toml):
    """The header promises the defaults; the daemons' `proxy` is the one documented exception."""
    proxy_defaults = ProxyConfig()
    for key, value in example_toml["proxy"].items():
        assert getattr(proxy_defaults, key) == value, key
    for role in ("prefill", "decode"):
        defaults = NodeConfig(role=role)
        for key, value in example_toml[role].items():
            if key != "proxy":
                assert getattr(defaults, key) == value, (role, key)
