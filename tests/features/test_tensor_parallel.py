"""Tensor parallelism on CPU (gloo): shards as pure functions, ``tensor_parallel_size=2`` (and 3)
against one rank on the test models and SmolLM2, a worker killed mid-stream, and teardown.

Greedy tokens must be equal. Logits cannot be bit-equal: a row-parallel projection sums its ranks'
partial products (``all_reduce``) where one rank runs one GEMM, a float32 reduction-order change.
Its size is bounded by ``models.LOGPROB_ATOL`` on every returned log-probability."""

from __future__ import annotations

import asyncio
import functools
import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
from models import STRESS_ENGINE_ARGS, assert_same_greedy, make_random_model

from cb_serve import LLM, AsyncLLM, EngineConfig, SamplingParams
from cb_serve.distributed.sharding import balanced_range, shard_for
from cb_serve.errors import EngineError
from cb_serve.executor.forkserver import METHOD_ENV, multiproc_method

PROMPTS = [
    list(range(100, 130)),
    list(range(300, 310)),
    list(range(50, 200)),  # longer than the token budget: chunked prefill across steps
    list(range(100, 120)) + [7, 8, 9],  # shares a prefix block with the first: a prefix-cache hit
]
BF16_TIE = 0.1  # bfloat16 rounding of a random model's logits: top-two gaps below it are ties
GREEDY = SamplingParams(temperature=0, max_tokens=16, logprobs=2)


def heads(num_heads: int, num_kv: int, vocab: int = 100, intermediate: int = 10) -> SimpleNamespace:
    return SimpleNamespace(
        num_attention_heads=num_heads, num_key_value_heads=num_kv, vocab_size=vocab, intermediate_size=intermediate
    )


def test_balanced_ranges_cover_everything_once():
    for n in range(12):
        for parts in range(1, 5):
            pieces = [balanced_range(n, parts, i) for i in range(parts)]
            assert [x for p in pieces for x in p] == list(range(n))
            assert max(map(len, pieces)) - min(map(len, pieces)) <= 1


def test_shards_split_by_kv_head_and_replicate_past_them():
    smol = heads(9, 3, vocab=49152, intermediate=1536)  # SmolLM2: 3 query heads per KV head
    r0, r1 = shard_for(smol, 0, 2), shard_for(smol, 1, 2)
    assert (r0.kv_heads, r0.q_heads, r1.kv_heads, r1.q_heads) == (range(0, 2), range(0, 6), range(2, 3), range(6, 9))
    assert (r0.intermediate, r1.intermediate, r0.vocab, r1.vocab) == (
        range(768),
        range(768, 1536),
        range(24576),
        range(24576, 49152),
    )
    mqa = [shard_for(heads(4, 1), r, 2) for r in range(2)]  # one KV head, replicated; its 4 query heads split
    assert [(s.kv_heads, s.q_heads) for s in mqa] == [(range(1), range(2)), (range(1), range(2, 4))]
    four = [shard_for(heads(8, 2), r, 4) for r in range(4)]
    assert [(s.kv_heads.start, s.q_heads) for s in four] == [
        (0, range(0, 2)),
        (0, range(2, 4)),
        (1, range(4, 6)),
        (1, range(6, 8)),
    ]
    padded = [shard_for(heads(4, 2, vocab=101), r, 2).vocab for r in range(2)]
    assert padded == [range(51), range(51, 102)]  # equal shards for the all-gather; row 101 is padding
    with pytest.raises(ValueError, match="cannot split"):
        shard_for(heads(4, 2), 0, 3)  # more ranks than KV heads, not a multiple of them
    with pytest.raises(ValueError, match="cannot split"):
        shard_for(heads(2, 1), 0, 4)  # more ranks than query heads
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        EngineConfig(tensor_parallel_size=0)


def assert_no_blocks_held(llm: LLM) -> None:
    assert llm.engine.get_stats().kv_blocks_used == 0, "blocks leaked"


def generate(llm: LLM, params: SamplingParams = GREEDY):
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def stopped(pid: int, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # a zombie child counts as stopped
            if open(f"/proc/{pid}/stat").read().split()[2] == "Z":
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize(
    "arch, overrides",
    [
        ("llama", {}),
        ("qwen2", {}),
        ("llama", {"num_key_value_heads": 1}),
        ("qwen3", {}),
        ("gemma3_text", {}),
        ("olmo2", {}),
        ("olmo2", {"num_key_value_heads": 1}),
        ("phi3", {}),
    ],
    ids=["llama", "qwen2-bias", "mqa", "qwen3-qk-norm-sliding", "gemma3", "olmo2-qk-norm", "olmo2-mqa", "phi3-fused"],
)
def test_two_ranks_equal_one_on_random_models(tmp_path, tokenizer, arch, overrides):
    model = str(make_random_model(tmp_path, arch, tokenizer, **overrides))
    ref = generate(LLM(model, **STRESS_ENGINE_ARGS))
    tp = LLM(model, tensor_parallel_size=2, **STRESS_ENGINE_ARGS)
    try:
        assert len(tp.engine.worker_pids) == 1
        assert_same_greedy(generate(tp), ref, f"{arch} {overrides}")
    finally:
        tp.engine.shutdown()


@pytest.mark.parametrize(
    "arch, expert_parallel",
    [
        ("mixtral", False),
        ("qwen3_moe", False),
        ("olmoe", False),
        ("gpt_oss", False),
        ("qwen3_moe", True),
        ("gpt_oss", True),
        ("qwen2_moe", True),
    ],
    ids=["mixtral", "qwen3-moe", "olmoe", "gpt-oss", "qwen3-moe-ep", "gpt-oss-ep", "qwen2-moe-shared-expert-ep"],
)
def test_mixtures_of_experts_over_two_ranks_equal_one(tmp_path, tokenizer, arch, expert_parallel):
    """Each expert's columns split over the ranks, or (expert parallelism) 4 whole experts per rank; the
    ranks read their slices from the checkpoint's per-expert (Qwen3-MoE, Mixtral, OLMoE) or fused
    interleaved (gpt-oss) tensors."""
    model = str(make_random_model(tmp_path, arch, tokenizer))
    ref = generate(LLM(model, **STRESS_ENGINE_ARGS))
    tp = LLM(model, tensor_parallel_size=2, enable_expert_parallel=expert_parallel, **STRESS_ENGINE_ARGS)
    try:
        assert_same_greedy(generate(tp), ref, f"{arch} expert_parallel={expert_parallel}")
        assert_no_blocks_held(tp)
    finally:
        tp.engine.shutdown()


@pytest.mark.parametrize(
    "arch, overrides",
    [
        ("qwen3_5_text", {}),
        ("qwen3_next", {}),
        ("granitemoehybrid", {"mamba_n_groups": 1, "position_embedding_type": None}),
    ],
)
def test_hybrid_models_over_two_ranks_equal_one(tmp_path, tokenizer, arch, overrides):
    """Gated DeltaNet layers split by key head (one of 2 per rank, with its 2 value heads and their states),
    attention by head, experts by column; Qwen3-Next's projections grouped per key head read as such.
    Mamba2 layers split by head, their one B/C group on both ranks and the gated norm's sum of squares
    all-reduced (Granite 4, without position embedding)."""
    model = str(make_random_model(tmp_path, arch, tokenizer, **overrides))
    ref = generate(LLM(model, **STRESS_ENGINE_ARGS))
    tp = LLM(model, tensor_parallel_size=2, **STRESS_ENGINE_ARGS)
    try:
        assert_same_greedy(generate(tp), ref, f"{arch} over two ranks")
        assert_no_blocks_held(tp)
        assert tp.engine.get_stats().state_slots_used == 0
    finally:
        tp.engine.shutdown()


def test_expert_parallelism_needs_an_expert_per_rank(random_model_dir):
    with pytest.raises(ValueError, match="at least as many experts"):
        shard_for(SimpleNamespace(**vars(heads(4, 4)), num_experts=2), 0, 4, expert_parallel=True)


def test_smollm2_on_two_ranks_equals_one(smol_llm):
    tp = LLM(tensor_parallel_size=2, **STRESS_ENGINE_ARGS)  # 3 KV heads: ranks hold 2 and 1
    try:
        assert_same_greedy(generate(tp), generate(smol_llm), "SmolLM2")
    finally:
        tp.engine.shutdown()


def test_shutdown_and_release_stop_the_workers(random_model_dir):
    model = str(random_model_dir("llama"))
    llm = LLM(model, tensor_parallel_size=2, **STRESS_ENGINE_ARGS)
    pid, group = llm.engine.worker_pids[0], llm.engine.executor.workers.group
    llm.engine.shutdown()
    llm.engine.shutdown()  # idempotent
    assert stopped(pid)
    assert group.aborted is None  # a worker told to stop is no failure: the watch ended first
    llm = LLM(model, tensor_parallel_size=2, **STRESS_ENGINE_ARGS)
    pid = llm.engine.worker_pids[0]
    (watchdog,) = llm.engine.executor.workers._watchdogs
    pool = weakref.ref(llm.engine.executor.workers)
    del llm  # no shutdown: releasing the engine stops its workers (the watchdog's thread holds no pool)
    gc.collect()
    assert pool() is None and not watchdog.running
    assert stopped(pid)


class HangUntilAborted:
    """Makes the driver's collectives act as NCCL's do once a peer is dead (``armed``): they neither
    complete nor fail until the group is aborted, then return garbage (their input), as a host
    sync behind an aborted NCCL kernel does. ``parked``: the driver is waiting in one, in the step
    after ``steps_at_park`` completed steps."""

    def __init__(self, group, num_steps: Callable[[], int]) -> None:
        self.group, self.size, self.num_steps = group, group.size, num_steps
        self.armed, self.parked = threading.Event(), threading.Event()
        self.steps_at_park = -1
        self.real = group.all_reduce, group.all_gather
        group.all_reduce, group.all_gather = self.all_reduce, self.all_gather

    def _hang(self) -> None:
        if not self.parked.is_set():
            self.steps_at_park = self.num_steps()
            self.parked.set()
        deadline = time.monotonic() + 60
        while self.group.aborted is None and time.monotonic() < deadline:
            time.sleep(0.01)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if not self.armed.is_set():
            return self.real[0](x)
        self._hang()
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        if not self.armed.is_set():
            return self.real[1](x)
        self._hang()
        return torch.cat([x] * self.size, dim=-1)


@pytest.mark.parametrize("collectives", ["gloo", "hang-until-aborted"])
def test_a_killed_worker_ends_the_streams_with_an_error(random_model_dir, collectives):
    """Every stream fails with an ``EngineError`` within a bound, and the health check names the
    dead rank. Gloo fails the collective at once; with collectives that hang as NCCL's do, the
    driver's watchdog aborts the group, and the step it ends is fatal although it returned."""
    engine = AsyncLLM(EngineConfig(model=str(random_model_dir("llama")), tensor_parallel_size=2, **STRESS_ENGINE_ARGS))
    group = engine._engine.executor.workers.group
    hang = HangUntilAborted(group, lambda: engine._engine.num_steps) if collectives == "hang-until-aborted" else None
    killed_at: list[float] = []

    async def stream(i: int, prompt: list[int]):
        got, params = 0, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        try:
            async for out in engine.generate(prompt, params, f"r{i}"):
                got += len(out.outputs[0].token_ids)
                if got >= 5 and prompt == PROMPTS[0] and not killed_at:
                    if hang is not None:  # the driver waits in a collective that will never complete
                        hang.armed.set()
                        assert hang.parked.wait(30)
                    os.kill(engine.worker_pids[0], signal.SIGKILL)
                    killed_at.append(time.monotonic())
        except EngineError as e:
            return got, e
        return got, None

    async def main():
        return await asyncio.wait_for(asyncio.gather(*(stream(i, p) for i, p in enumerate(PROMPTS[:3]))), timeout=120)

    try:
        results = asyncio.run(main())
        assert all(isinstance(error, EngineError) for _, error in results), results
        assert all(got < 200 for got, _ in results)
        assert time.monotonic() - killed_at[0] < 30  # a bound (the collective timeout is minutes), not a speed
        with pytest.raises(EngineError, match=r"rank\(s\) \[1\] died"):
            engine.check_health()
        if hang is not None:
            assert group.aborted == "worker rank(s) [1] died"
            assert engine._engine.num_steps == hang.steps_at_park  # the step the abort ended emitted nothing
    finally:
        engine.shutdown()


class RecordingGroup:
    """Stands in for a ProcessGroupNCCL (the CPU build has none): records ``abort`` calls."""

    def __init__(self, fail: bool = False) -> None:
        self.aborts, self.fail = 0, fail

    def abort(self) -> None:
        self.aborts += 1
        if self.fail:
            raise RuntimeError("abort failed")


def test_the_watchdog_aborts_a_dead_workers_group_once():
    """A killed worker's group is aborted exactly once, within a bound; later collectives raise.
    A stopped watch (shutdown) never aborts, and an abort that raises leaves the group aborted."""
    from cb_serve.distributed.group import TensorParallelGroup
    from cb_serve.executor.worker_pool import WorkerWatchdog, _abort_group, _dead_ranks

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    handles = [SimpleNamespace(is_alive=lambda: proc.poll() is None)]
    pg = RecordingGroup()
    group = TensorParallelGroup(0, 2, process_group=pg)
    watchdog = WorkerWatchdog(functools.partial(_dead_ranks, handles), functools.partial(_abort_group, group), 0.05)
    time.sleep(0.2)
    assert pg.aborts == 0 and watchdog.running
    proc.kill()
    deadline = time.monotonic() + 10
    while pg.aborts == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pg.aborts == 1 and group.aborted == "worker rank(s) [1] died"
    time.sleep(0.2)
    assert pg.aborts == 1 and not watchdog.running
    assert group.abort("again") is False and pg.aborts == 1  # idempotent
    with pytest.raises(RuntimeError, match="aborted"):
        group.all_reduce(torch.ones(2))
    proc.wait()

    dead: list[int] = []
    quiet = TensorParallelGroup(0, 2, process_group=RecordingGroup())
    stopped_watch = WorkerWatchdog(lambda: dead, functools.partial(_abort_group, quiet), 0.05)
    stopped_watch.stop()
    stopped_watch.stop()
    dead.append(1)
    time.sleep(0.2)
    assert quiet.pg.aborts == 0 and quiet.aborted is None and not stopped_watch.running

    failing = TensorParallelGroup(0, 2, process_group=RecordingGroup(fail=True))
    assert failing.abort("worker rank(s) [1] died") is True and failing.pg.aborts == 1
    with pytest.raises(RuntimeError, match="aborted"):
        failing.all_gather(torch.ones(2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_gpus_equal_one(random_model_dir):
    """NCCL across two GPUs (workers on cuda:1), bfloat16, eager: every token one GPU picks, and each
    log-probability within bfloat16 rounding. The bfloat16 tie rule: where one GPU's top two
    log-probabilities are within ``BF16_TIE``, the two runs may pick differently (comparison stops)."""
    model = str(random_model_dir("llama"))
    args = dict(device="cuda", dtype="bfloat16", max_model_len=512, max_num_seqs=8, num_gpu_blocks=256)
    one = LLM(model, **args)
    two = LLM(model, tensor_parallel_size=2, **args)
    try:
        params = SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True)
        ours, ref = (generate(llm, params) for llm in (two, one))
        assert_same_greedy(ours, ref, "two GPUs, bfloat16", tie=BF16_TIE, atol=BF16_TIE)
    finally:
        two.engine.shutdown()


NO_MAIN_GUARD = """
import json
from cb_serve import LLM, SamplingParams

print("the script's own output")
params = SamplingParams(temperature=0, max_tokens=12, logprobs=2)
tokens = {}
for size in (1, 2):
    llm = LLM(MODEL, tensor_parallel_size=size, num_gpu_blocks=64, max_model_len=256, max_num_batched_tokens=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    tokens[size] = [o.outputs[0].token_ids for o in outs]
print("TOKENS", json.dumps(tokens))
"""


def test_a_script_without_a_main_guard_runs_two_ranks(tmp_path, random_model_dir):
    """A user's plain script (no ``if __name__ == "__main__":``) with ``tensor_parallel_size=2``: the
    worker is a fresh interpreter that never runs the script, and the tokens are TP=1's."""
    script = tmp_path / "plain.py"
    script.write_text(f"MODEL = {str(random_model_dir('llama'))!r}\nPROMPTS = {PROMPTS!r}\n" + NO_MAIN_GUARD)
    env = {k: v for k, v in os.environ.items() if k != METHOD_ENV}  # the default a user gets: spawn
    command = [sys.executable, str(script)]
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("the script's own output") == 1, run.stdout
    (line,) = [x for x in run.stdout.splitlines() if x.startswith("TOKENS ")]
    tokens = json.loads(line.removeprefix("TOKENS "))
    assert tokens["1"] == tokens["2"] and all(len(t) == 12 for t in tokens["1"])


def parent_pid(pid: int) -> int:
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])


def test_worker_start_methods(monkeypatch):
    monkeypatch.delenv(METHOD_ENV, raising=False)
    assert multiproc_method("cpu") == "spawn"  # the default
    monkeypatch.setenv(METHOD_ENV, "forkserver")
    assert (multiproc_method("cpu"), multiproc_method("cuda")) == ("forkserver", "spawn")
    monkeypatch.setenv(METHOD_ENV, "fork")
    with pytest.raises(ValueError, match="expected one of spawn, forkserver"):
        multiproc_method("cpu")


def test_forked_workers_come_from_one_server_per_environment(random_model_dir, monkeypatch):
    """``forkserver`` (the suite's setting; the spawned default runs in the script test above): the
    workers of later engines are forked by one server process, not this one's children, and end with
    their engine; a changed environment gets a new server (a module may read a variable at import).
    The tokens are the same each time (every other test here compares them with one rank's)."""
    monkeypatch.setenv(METHOD_ENV, "forkserver")
    model, args = str(random_model_dir("llama")), {**STRESS_ENGINE_ARGS, "max_num_seqs": 4}
    runs = []
    for mark in ("0", "0", "1"):
        monkeypatch.setenv("CB_SERVE_TEST_ENV_MARK", mark)
        llm = LLM(model, tensor_parallel_size=2, **args)
        (pid,) = llm.engine.worker_pids
        runs.append((parent_pid(pid), [tokens for tokens, _ in generate(llm)]))
        llm.engine.shutdown()
        assert stopped(pid)
    (first, tokens), (again, _), (new_env, _) = runs
    assert first == again and os.getpid() != first != new_env != os.getpid()
    assert all(run[1] == tokens for run in runs)


def test_each_gpu_sizes_its_kv_cache_for_its_own_heads():
    from transformers import LlamaConfig

    from cb_serve.engine.builder import per_rank_config

    smol = LlamaConfig(num_attention_heads=9, num_key_value_heads=3, hidden_size=576, intermediate_size=1536)
    assert per_rank_config(smol, 2, torch.device("cuda")).num_key_value_heads == 2  # ranks hold 2 and 1
    assert per_rank_config(smol, 3, torch.device("cuda")).num_key_value_heads == 1
    assert smol.num_key_value_heads == 3  # the model's own config is untouched
    assert per_rank_config(smol, 2, torch.device("cpu")) is smol  # one shared memory: the whole model's size
    assert per_rank_config(smol, 1, torch.device("cuda")) is smol


def test_worker_devices(monkeypatch):
    from cb_serve.executor.worker_pool import worker_devices

    assert worker_devices(torch.device("cpu"), 3, "mp") == ["cpu", "cpu"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert worker_devices(torch.device("cuda", 1), 3, "mp") == ["cuda:2", "cuda:3"]  # the GPUs after the driver's
    assert worker_devices(torch.device("cuda", 0), 2, "ray") == ["cuda"]  # Ray shows each actor its own GPU
    with pytest.raises(ValueError, match="needs 5 GPUs; 4 visible"):
        worker_devices(torch.device("cuda", 2), 3, "mp")


def test_a_rank_reads_only_its_slices_of_a_safetensors_checkpoint(tmp_path, tokenizer, monkeypatch):
    """From a local safetensors directory a rank reads its slices alone (about 1/N of the weights)
    and gets the same parameters as slicing the fully loaded HF model."""
    from safetensors.torch import load_file

    from cb_serve.attention import TorchAttentionBackend
    from cb_serve.distributed.group import TensorParallelGroup
    from cb_serve.model_executor import loader
    from cb_serve.model_executor.layers import checkpoint

    model_dir = make_random_model(tmp_path, "qwen2", tokenizer)  # biases on q/k/v
    source = loader.resolve_model_source(str(model_dir))
    config = loader.load_config(source)
    total = sum(t.numel() for t in load_file(model_dir / "model.safetensors").values())
    read = []
    lazy_read = checkpoint.LazyTensor.__getitem__
    monkeypatch.setattr(checkpoint.LazyTensor, "__getitem__", lambda t, i: read.append(lazy_read(t, i)) or read[-1])

    def load(rank: int):
        tp = TensorParallelGroup(rank, 2, process_group=object())  # loading communicates nothing
        args = (source, config, TorchAttentionBackend(), torch.float32, torch.device("cpu"), 64)
        return loader.load_model(*args, shard=shard_for(config, rank, 2), tp=tp).state_dict()

    for rank in range(2):
        read.clear()
        lazily = load(rank)
        assert sum(t.numel() for t in read) < 0.6 * total
        with monkeypatch.context() as m:
            m.setattr(loader, "safetensors_files", lambda path: None)  # the whole-model path
            fully = load(rank)
        assert lazily.keys() == fully.keys()
        assert all(torch.equal(lazily[k], fully[k]) for k in lazily), rank
