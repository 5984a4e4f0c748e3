"""The Serve config files in deploy/ are valid for Ray Serve's own schema and for our
application builder, without starting Ray."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

yaml = pytest.importorskip("yaml")
schema = pytest.importorskip("ray.serve.schema")

from ray.serve.config import AutoscalingConfig  # noqa: E402

from cb_serve.serve.app import AppArgs, build_app, engine_replica_options, tensor_parallel_bundles  # noqa: E402
from cb_serve.serve.engine_replica import EngineReplica  # noqa: E402
from cb_serve.serve.router import Router  # noqa: E402

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
CONFIGS = ["config.yaml", "config.gemma3.yaml", "config.gpu.yaml", "config.tp.yaml", "config.moe.yaml"]


def load(name: str) -> dict:
    return yaml.safe_load((DEPLOY / name).read_text())


@pytest.mark.parametrize("name", CONFIGS)
def test_config_is_valid_for_ray_serve_and_our_app_args(name):
    config = schema.ServeDeploySchema.model_validate(load(name))
    assert config.applications, name
    for app in config.applications:
        assert app.import_path == "cb_serve.serve.app:build_app"
        args = AppArgs.model_validate(app.args)  # unknown keys or engine arguments fail here
        assert build_app(app.args) is not None  # builds the deployment graph (Ray not started)
        names = {d.name for d in app.deployments}
        assert names <= {EngineReplica.name, Router.name}, f"{name}: unknown deployment(s) {names}"
        assert args.engine.get("max_waiting_requests"), f"{name}: the engine's queue must be bounded"


def test_gpu_config_has_one_gpu_per_autoscaled_engine_replica():
    config = schema.ServeDeploySchema.model_validate(load("config.gpu.yaml"))
    (app,) = config.applications
    engine = next(d for d in app.deployments if d.name == EngineReplica.name)
    assert engine.ray_actor_options.num_gpus == 1
    autoscaling = AutoscalingConfig(**engine.autoscaling_config)
    assert autoscaling.min_replicas >= 1 and autoscaling.max_replicas > autoscaling.min_replicas
    assert "num_replicas" not in engine.model_fields_set  # the autoscaler owns the replica count
    assert engine.max_ongoing_requests >= AppArgs.model_validate(app.args).engine["max_num_seqs"]
    assert engine.max_queued_requests > 0  # backpressure: beyond the queue, 503 at once


def test_cpu_config_serves_locally_with_bounded_queues():
    config = schema.ServeDeploySchema.model_validate(load("config.yaml"))
    (app,) = config.applications
    assert config.http_options.port == 8000
    engine = next(d for d in app.deployments if d.name == EngineReplica.name)
    assert "num_gpus" not in engine.ray_actor_options.model_fields_set
    assert engine.max_queued_requests > 0
    assert AppArgs.model_validate(app.args).engine["max_waiting_requests"] > 0


def commented_speculative_config() -> dict:
    """deploy/config.yaml's speculative_config line, commented out there: what turns speculation on."""
    (line,) = [x for x in (DEPLOY / "config.yaml").read_text().splitlines() if "# speculative_config:" in x]
    return yaml.safe_load(line.replace("# ", "", 1).strip())["speculative_config"]


def test_config_yaml_turns_speculation_on_with_its_commented_line():
    config = load("config.yaml")
    (app,) = config["applications"]
    app["args"]["engine"]["speculative_config"] = commented_speculative_config()
    args = AppArgs.model_validate(app["args"])
    assert args.engine["speculative_config"]["method"] == "ngram"
    assert build_app(app["args"]) is not None


def test_app_args_reject_unknown_keys_and_bad_values():
    with pytest.raises(ValidationError):
        AppArgs.model_validate({"engine": {"no_such_engine_arg": 1}})
    with pytest.raises(ValidationError):
        AppArgs.model_validate({"engine": {"max_num_seqs": 0}})
    with pytest.raises(ValidationError):
        AppArgs.model_validate({"engine": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 99}}})
    with pytest.raises(ValidationError):
        AppArgs.model_validate({"routr": {}})
    with pytest.raises(ValidationError):
        AppArgs.model_validate({"engine_replica": {"num_replica": 2}})


@pytest.mark.parametrize("name", ["config.tp.yaml", "config.moe.yaml"])
def test_tp_config_declares_one_gpu_bundle_per_rank_on_one_node(name):
    config = schema.ServeDeploySchema.model_validate(load(name))
    (app,) = config.applications
    size = AppArgs.model_validate(app.args).engine["tensor_parallel_size"]
    engine = next(d for d in app.deployments if d.name == EngineReplica.name)
    bundles = engine.placement_group_bundles
    assert size > 1 and len(bundles) == size and all(b.get("GPU") == 1 for b in bundles)
    assert engine.placement_group_strategy == "STRICT_PACK"
    first = bundles[0]  # the replica's own resources must fit in it
    assert engine.ray_actor_options.num_gpus <= first["GPU"] and engine.ray_actor_options.num_cpus <= first["CPU"]


def test_tensor_parallel_bundles_follow_the_replica_resources():
    assert tensor_parallel_bundles(2, {"num_cpus": 1}) == [{"CPU": 1}, {"CPU": 1}]
    assert tensor_parallel_bundles(4, {"num_gpus": 1, "num_cpus": 2}) == [{"CPU": 2, "GPU": 1}] + [{"GPU": 1}] * 3
    derived = engine_replica_options(AppArgs.model_validate({"engine": {"tensor_parallel_size": 2}}))
    assert derived["placement_group_bundles"] == [{"CPU": 1}, {"CPU": 1}]
    assert derived["placement_group_strategy"] == "STRICT_PACK"
    assert "placement_group_bundles" not in engine_replica_options(AppArgs.model_validate({}))
    given = {"engine": {"tensor_parallel_size": 2}, "engine_replica": {"placement_group_bundles": [{"CPU": 3}] * 2}}
    assert engine_replica_options(AppArgs.model_validate(given))["placement_group_bundles"] == [{"CPU": 3}] * 2


def test_config_gpu_yaml_turns_lora_on_with_its_commented_lines():
    """deploy/config.gpu.yaml's commented LoRA lines (engine options and lora_modules), uncommented."""
    text = (DEPLOY / "config.gpu.yaml").read_text()
    lines = [x for x in text.splitlines() if x.strip().startswith(("# enable_lora", "# max_lora", "# max_cpu_loras"))]
    (modules,) = [x for x in text.splitlines() if "# lora_modules:" in x]
    config = load("config.gpu.yaml")
    (app,) = config["applications"]
    app["args"]["engine"].update(yaml.safe_load("\n".join(x.replace("# ", "", 1).strip() for x in lines)))
    app["args"].update(yaml.safe_load(modules.replace("# ", "", 1).strip()))
    args = AppArgs.model_validate(app["args"])
    assert args.engine["enable_lora"] and args.engine["max_loras"] == 8
    assert args.lora_modules["customer-a"].startswith("/home/ray/.cache/huggingface/")
    with pytest.raises(ValidationError, match="enable_lora"):
        AppArgs.model_validate({"lora_modules": {"a": "/x"}})
