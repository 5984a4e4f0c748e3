"""Shared fixtures: the default model's tokenizer, random-weight model directories, and
one engine on the real SmolLM2 (loading it costs ~20 s, so it is built once)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# The two pytest-xdist workers (and the processes they start) each run torch's OpenMP pool over every
# core: its threads would spin at each barrier while the other worker's threads hold the cores (a tiny
# model's step is all barriers). Idle threads sleep instead; the kernels still run their multi-thread
# paths. Set before torch loads libgomp, which reads it once.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

# The helpers beside this file (models.py, serving.py, ...), and the tests by concern (engine/,
# kernels/, features/, serve/, deploy/), whose modules a few others import helpers from.
HERE = Path(__file__).parent
sys.path[:0] = [str(HERE), *(str(d) for d in sorted(HERE.iterdir()) if d.is_dir() and d.name != "__pycache__")]
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no model hub here: never wait on the network
# Every Ray cluster of the tests is local (loopback): no token authentication, the same for the
# test process and every node it starts (a process keeps the mode it first read).
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
if not torch.cuda.is_available():  # Triton kernels run in its interpreter; set before anything imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Every engine the tests build with device="auto" runs on the CPU in float32, on a GPU host too (its
# workers and Serve replicas inherit this): the CPU suite compares against float32 HF. The tests for
# CUDA (marked gpu) name device="cuda".
os.environ.setdefault("CB_SERVE_DEVICE", "cpu")
# The suite builds ~40 tensor-parallel engines: their CPU workers fork from one warm server per process
# instead of each importing torch and transformers afresh (``cb_serve/executor/forkserver.py``). The
# default a user gets (spawn) is tested where named.
os.environ.setdefault("CB_SERVE_WORKER_MULTIPROC_METHOD", "forkserver")
# A GPU host without the built-in model's package (bench/gpu_check.sh): the tests' tokenizer (and the
# random models' vocabulary) from a saved copy of the built-in model's tokenizer.
TOKENIZER_ENV = "CB_SERVE_TEST_TOKENIZER"

from models import STRESS_ENGINE_ARGS, make_random_model  # noqa: E402


def default_model_or_skip():
    """The built-in model's source; the test skips where its package is not installed."""
    from cb_serve.model_executor.loader import default_model_source

    try:
        return default_model_source()
    except ValueError as e:
        pytest.skip(f"the built-in model is not installed: {e}")


@pytest.fixture(scope="session")
def tokenizer():
    from cb_serve.model_executor.loader import load_tokenizer

    if os.environ.get(TOKENIZER_ENV):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(os.environ[TOKENIZER_ENV])
    return load_tokenizer(default_model_or_skip())


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory, tokenizer):
    made: dict[str, Path] = {}

    def make(arch: str) -> Path:
        if arch not in made:
            made[arch] = make_random_model(tmp_path_factory.mktemp(arch), arch, tokenizer)
        return made[arch]

    return make


@pytest.fixture(scope="session")
def tiny_llm(random_model_dir):
    """A random-weight Llama engine with roomy settings, for API-level tests."""
    from cb_serve import LLM

    return LLM(str(random_model_dir("llama")), max_model_len=512, num_gpu_blocks=256)


@pytest.fixture(scope="session")
def smol_llm():
    """The real default model (SmolLM2-135M-Instruct), under the stress settings."""
    from cb_serve import LLM

    default_model_or_skip()
    return LLM(**STRESS_ENGINE_ARGS)


@pytest.fixture(scope="session")
def smol_hf():
    from hf_oracle import hf_model_from_gguf

    return hf_model_from_gguf(default_model_or_skip())


# The Serve modules run in two groups, at once, each on a worker of its own (its modules one after another): the
# ones that start `serve run` / `cb-serve serve` on deploy/config.yaml's port 8000 or a `ray start` cluster, and
# the rest (each its own in-process cluster on a port of its own). None runs `ray stop` (it would stop the other
# group's cluster): each kills its own processes (``serving.kill_session``). The faults module balances them.
SERVE_RUN_GROUP = ("test_serve.py", "test_gemma3_serve.py", "test_clients.py", "test_shutdown.py", "test_node_loss.py")
SERVE_RUN_GROUP += ("test_faults.py",)


def serve_group(nodeid: str) -> str | None:
    """The Ray group of a test (None: not a Serve module)."""
    module = nodeid.split("::", 1)[0]
    if not module.startswith("tests/serve/"):
        return None
    return "ray: serve run" if module.rsplit("/", 1)[-1] in SERVE_RUN_GROUP else "ray: in-process"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``make test`` runs two pytest-xdist workers with ``--dist loadscope``, scheduled here: each
    module's tests stay on one worker (its fixtures, an engine or a Serve cluster, are made once), and
    the modules that start Ray clusters (``tests/serve/``) are two units (``SERVE_RUN_GROUP``), the
    first work each worker takes: they mostly wait on Ray and HTTP, and the rest fills the cores
    around them, longest first (``DURATIONS``: a long module taken last would run alone at the end).
    (xdist's own ``loadgroup`` renames node ids, which pytest 9 no longer reads.)"""
    if config.getoption("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ServeGroupsFirst(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return serve_group(nodeid) or nodeid.split("::", 1)[0]

        def _assign_work_unit(self, node) -> None:
            if not getattr(self, "serve_groups_first", False):  # the first assignment: the queue is complete
                self.serve_groups_first = True
                rest = [s for s in self.workqueue if not s.startswith("ray: ")]
                for scope in sorted(rest, key=module_seconds(), reverse=True):
                    self.workqueue.move_to_end(scope)  # the Ray groups first, then the longest modules
                for group in ("ray: in-process", "ray: serve run"):  # the modules sharing a cluster or a server
                    if (tests := self.workqueue.get(group)) is not None:
                        order = sorted(tests, key=lambda n: shared_cluster_rank(n.split("::", 1)[0]))
                        self.workqueue[group] = {nodeid: tests[nodeid] for nodeid in order}
            super()._assign_work_unit(node)

    return ServeGroupsFirst(config, log)


def shared_cluster_rank(module: str) -> int:
    """Where a Serve module runs in its group: those sharing one Ray cluster (``serving.SHARED_CLUSTER_MODULES``)
    or one ``serve run`` (``serving.SMOL_SERVER_MODULES``) one after another, first."""
    from serving import SHARED_CLUSTER_MODULES, SMOL_SERVER_MODULES

    name, shared = module.rsplit("/", 1)[-1], SHARED_CLUSTER_MODULES + SMOL_SERVER_MODULES
    return shared.index(name) if name in shared else len(shared)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    """Tells ``serving.local_ray_serve`` (a module fixture, finalized in this teardown) which module runs next."""
    from serving import NEXT_TEST

    NEXT_TEST["module"] = nextitem.path.name if nextitem is not None else None
    return (yield)


# Each module's seconds in a recent full run (setup, call and teardown of its tests), for the order above: a stale
# or missing entry costs balance, never correctness. Refreshed by ``make test-durations``
# (CB_SERVE_STORE_DURATIONS=1: the controller writes what this run measured).
DURATIONS = HERE / "durations.json"
_measured: dict[str, float] = {}


def module_seconds():
    """module -> its recorded seconds (a module not recorded: the median)."""
    import json
    import statistics

    known = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    default = statistics.median(known.values()) if known else 0.0
    return lambda module: known.get(module, default)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if os.environ.get("CB_SERVE_STORE_DURATIONS"):
        module = report.nodeid.split("::", 1)[0]
        _measured[module] = _measured.get(module, 0.0) + report.duration
    timeline = os.environ.get("CB_SERVE_TIMELINE")
    if timeline and not os.environ.get("PYTEST_XDIST_WORKER"):  # the controller: which worker ran what, when
        import json

        worker = getattr(getattr(getattr(report, "node", None), "gateway", None), "id", "main")
        line = {"worker": worker, "nodeid": report.nodeid, "when": report.when, "start": report.start}
        with open(timeline, "a") as f:
            f.write(json.dumps({**line, "stop": report.stop}) + "\n")


def pytest_sessionfinish(session: pytest.Session) -> None:
    import json

    config = session.config  # only the whole suite's seconds (`make test`'s later runs pick tests)
    whole = config.args_source != pytest.Config.ArgsSource.ARGS
    whole = whole and not config.option.markexpr and not config.option.keyword
    if os.environ.get("CB_SERVE_STORE_DURATIONS") and _measured and whole and not hasattr(config, "workerinput"):
        durations = {module: round(seconds, 1) for module, seconds in sorted(_measured.items())}
        DURATIONS.write_text(json.dumps(durations, indent=1) + "\n")


def pytest_report_header(config: pytest.Config) -> list[str]:
    """The CPU and the instruction-set dispatch this run computes under: bit-for-bit results of torch's
    vector kernels and MKL's GEMMs are per CPU kind and per dispatch (``make test-dispatch``)."""
    from cb_serve.cpu_ops import cpu_model_and_flags

    model, flags = cpu_model_and_flags()
    isa = "AMX" if "amx_tile" in flags else "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "-"
    mkl = [f"{k}={os.environ[k]}" for k in ("MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS") if k in os.environ]
    return [
        f"cpu: {model} ({isa}), {os.cpu_count()} cores",
        f"dispatch: torch {torch.backends.cpu.get_cpu_capability()}, MKL {' '.join(mkl) or 'its own choice'}",
    ]
