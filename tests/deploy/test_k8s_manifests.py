"""deploy/k8s/: valid Kubernetes objects that start the real commands on the real ports.

Every manifest (and what the kustomization generates) validates against the API schemas
of a recent Kubernetes (kubernetes-validate ships them: no network). Then the wiring is
checked against the code: each flag is an option of `pdserve <command> --help`, ports are
the config's defaults and the containers' named ports, probes hit routes the apps serve,
daemons find every proxy's registry through a headless Service that lists the proxies before
they are ready.
"""

from __future__ import annotations

import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from common.config import ROLE_HTTP_PORTS, ROLE_KV_PORTS, env_name
from proxy.config import ProxyConfig

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
ROLES = ("proxy", "prefill", "decode")
DRAIN_S = 30  # uvicorn's timeout_graceful_shutdown in common/node/node.py
KEY_FLAG = "--cluster-key-file"


@pytest.fixture(scope="module")
def kustomization() -> dict:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


@pytest.fixture(scope="module")
def objects(kustomization) -> list[dict]:
    docs = []
    for name in kustomization["resources"]:
        docs += [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]
    return docs


def find(objects: list[dict], kind: str, name: str) -> dict:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} found"
    return matches[0]


def container(objects: list[dict], role: str) -> dict:
    (c,) = find(objects, "Deployment", f"pdserve-{role}")["spec"]["template"]["spec"]["containers"]
    return c


def flags(args: list[str]) -> dict[str, str]:
    return {a: args[i + 1] for i, a in enumerate(args) if a.startswith("--")}


def named_port(c: dict, name: str) -> int:
    return next(p["containerPort"] for p in c["ports"] if p["name"] == name)


@pytest.fixture(scope="module")
def cli_options() -> dict[str, set[str]]:
    """The options each command's --help lists (the CLI as users see it)."""
    def options(cmd: str) -> set[str]:
        out = subprocess.run([sys.executable, "-m", "pdserve.cli", cmd, "--help"], cwd=REPO,
                             capture_output=True, text=True, timeout=120, check=True).stdout
        return set(re.findall(r"(--[a-z][a-z0-9-]+)", out))

    with ThreadPoolExecutor(3) as pool:
        return dict(zip(ROLES, pool.map(options, ROLES)))


# ---------------------------------------------------------------------------- schemas

def test_every_yaml_file_is_a_listed_resource(kustomization):
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert files == set(kustomization["resources"])


def generated(kustomization: dict) -> list[dict]:
    """The ConfigMaps and Secrets the generators make, as objects to validate."""
    out = []
    for gen in kustomization.get("configMapGenerator", []):
        data = dict(lit.split("=", 1) for lit in gen.get("literals", []))
        out.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": gen["name"]},
                    "data": data})
    for gen in kustomization.get("secretGenerator", []):
        data = {Path(f).name: "" for f in gen.get("files", [])}  # the key file is the user's, never committed
        out.append({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": gen["name"]},
                    "stringData": data})
    return out


def test_every_object_validates_against_the_kubernetes_api_schemas(objects, kustomization):
    version = kubernetes_validate.latest_version()
    assert tuple(map(int, version.split(".")[:2])) >= (1, 30)
    for obj in [*objects, *generated(kustomization)]:
        # strict: unknown fields (a typo'd key Kubernetes would silently drop) fail too
        kubernetes_validate.validate(obj, version, strict=True)


def test_the_key_file_is_not_committed(kustomization):
    for gen in kustomization["secretGenerator"]:
        for name in gen["files"]:
            tracked = subprocess.run(["git", "ls-files", "--error-unmatch", str(K8S / name)], cwd=REPO,
                                     capture_output=True)
            assert tracked.returncode != 0, f"{name} holds a secret: it must not be in git"


# ---------------------------------------------------------------------------- wiring

def test_commands_flags_and_ports_match_the_cli(objects, cli_options):
    defaults = ProxyConfig()
    expected_ports = {"proxy": {"--port": defaults.port, "--registry-port": defaults.registry_port}}
    for r in ("prefill", "decode"):
        expected_ports[r] = {"--port": ROLE_HTTP_PORTS[r], "--kv-port": ROLE_KV_PORTS[r]}
    port_names = {"--port": "http", "--registry-port": "registry", "--kv-port": "kv"}
    unknown = set()
    for role in ROLES:
        c = container(objects, role)
        assert c["args"][:2] == ["pdserve", role]
        given = flags(c["args"])
        unknown |= set(given) - cli_options[role]
        assert given["--host"] == "0.0.0.0"
        for flag, port in expected_ports[role].items():
            assert int(given[flag]) == port == named_port(c, port_names[flag]), (role, flag)
    assert unknown == set(), f"flags no command knows: {unknown}"


def test_daemons_advertise_their_pod_ip_and_find_the_registry(objects):
    proxy = container(objects, "proxy")
    assert flags(proxy["args"])["--registry-host"] == "0.0.0.0"
    proxy_labels = find(objects, "Deployment", "pdserve-proxy")["spec"]["template"]["metadata"]["labels"]
    for role in ("prefill", "decode"):
        c = container(objects, role)
        given = flags(c["args"])
        assert given["--kv-host"] == "$(POD_IP)"
        (env,) = [e for e in c["env"] if e["name"] == "POD_IP"]
        assert env["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        host, port = given["--proxy"].rsplit(":", 1)
        svc = find(objects, "Service", host)
        # headless: the name resolves to every proxy pod, and the daemon heartbeats each (a virtual
        # IP would hand its one connection to one proxy, and the others would never hear of it)
        assert svc["spec"]["clusterIP"] == "None"
        # a proxy turns ready only once daemons registered: its registry must be listed before that
        assert svc["spec"]["publishNotReadyAddresses"] is True
        assert svc["spec"]["selector"].items() <= proxy_labels.items()
        (svc_port,) = [p for p in svc["spec"]["ports"] if p["port"] == int(port)]
        assert named_port(proxy, svc_port["targetPort"]) == int(flags(proxy["args"])["--registry-port"])


def test_the_api_service_reaches_the_proxy_http_port(objects):
    svc = find(objects, "Service", "pdserve-proxy")
    (port,) = svc["spec"]["ports"]
    assert port["port"] == ProxyConfig().port and port["targetPort"] == "http"
    assert not svc["spec"].get("publishNotReadyAddresses")  # clients only reach a ready proxy


def routes_of(role: str) -> set[str]:
    if role == "proxy":
        from proxy.app import build_app

        return {getattr(r, "path", "") for r in build_app(ProxyConfig(registry_port=0)).routes}
    from common.serving.system import router

    return {r.path for r in router.routes}


@pytest.mark.parametrize("role", ROLES)
def test_probes_and_scrape_annotations_hit_real_routes(objects, role):
    c = container(objects, role)
    routes = routes_of(role)
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        if probe in c:
            assert c[probe]["httpGet"]["path"] in routes
            assert c[probe]["httpGet"]["port"] == "http"
    template = find(objects, "Deployment", f"pdserve-{role}")["spec"]["template"]
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == named_port(c, "http")
    assert annotations["prometheus.io/path"] == "/metrics" and "/metrics" in routes


@pytest.mark.parametrize("role", ROLES)
def test_the_cluster_key_is_the_secret_mounted_read_only(objects, kustomization, role):
    spec = find(objects, "Deployment", f"pdserve-{role}")["spec"]["template"]["spec"]
    c = container(objects, role)
    key_path = Path(flags(c["args"])[KEY_FLAG])
    (mount,) = [m for m in c["volumeMounts"] if Path(m["mountPath"]) == key_path.parent]
    assert mount["readOnly"] is True
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    (gen,) = kustomization["secretGenerator"]
    assert volume["secret"]["secretName"] == gen["name"]
    assert key_path.name in {Path(f).name for f in gen["files"]}


@pytest.mark.parametrize("role", ("prefill", "decode"))
def test_daemons_get_a_gpu_the_model_and_time_to_drain(objects, kustomization, role):
    spec = find(objects, "Deployment", f"pdserve-{role}")["spec"]["template"]["spec"]
    c = container(objects, role)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert spec["terminationGracePeriodSeconds"] > DRAIN_S
    (gen,) = kustomization["configMapGenerator"]
    assert any(e["configMapRef"]["name"] == gen["name"] for e in c["envFrom"])
    model = dict(lit.split("=", 1) for lit in gen["literals"])[env_name("model")]
    models = [m["mountPath"] for m in c["volumeMounts"] if m["name"] == "models"]
    assert models and model.startswith(models[0] + "/")


def test_replicas_images_and_disruption_budgets_are_set_in_one_place(objects, kustomization):
    deployments = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Deployment"}
    assert {r["name"] for r in kustomization["replicas"]} == {"pdserve-proxy", "pdserve-prefill", "pdserve-decode"}
    assert {r["name"] for r in kustomization["replicas"]} <= set(deployments)
    # two proxies, both active; a voluntary disruption takes down one at most
    assert {r["name"]: r["count"] for r in kustomization["replicas"]}["pdserve-proxy"] == 2
    assert deployments["pdserve-proxy"]["spec"]["replicas"] == 2
    (image,) = kustomization["images"]
    assert all(container(objects, role)["image"] == image["name"] for role in ROLES)
    for role in ROLES:
        pdb = find(objects, "PodDisruptionBudget", f"pdserve-{role}")
        labels = deployments[f"pdserve-{role}"]["spec"]["template"]["metadata"]["labels"]
        assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
