"""The GPU path's logic, on CPU: CUDA-graph buckets and padding, KV-cache sizing from device
memory, and the whole engine running decode steps through the padded static-buffer path with
the Triton kernels (under the Triton interpreter). The same engine checks run on CUDA, with real
graphs, where a GPU is present."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib.util
import os
import threading
import weakref

import pytest
import torch
from models import assert_greedy_match

from cb_serve import LLM, SamplingParams
from cb_serve.attention.base import AttentionMetadata
from cb_serve.config import EngineConfig
from cb_serve.engine.kv_cache_sizing import activation_bytes, cuda_kv_cache_bytes, encoder_bytes
from cb_serve.model_executor.cuda_graph import DecodeBuffers, DecodeGraphRunner, bucket_for, capture_sizes
from cb_serve.model_executor.models import MODELS

GiB = 1 << 30
HAS_TRITON = importlib.util.find_spec("triton") is not None
CUDA = torch.cuda.is_available()


def test_capture_sizes_and_buckets():
    assert capture_sizes(256) == [1, 2, 4, *range(8, 257, 8)]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(1) == [1]
    assert capture_sizes(1000)[-1] == 256  # larger decode batches run eagerly
    sizes = capture_sizes(64)
    assert [bucket_for(n, sizes) for n in (1, 3, 5, 8, 9, 63, 64, 65)] == [1, 4, 8, 8, 16, 64, 64, None]


def decode_meta(seq_lens: list[int], block_table: list[list[int]], block_size: int) -> AttentionMetadata:
    n = len(seq_lens)
    width = max(len(row) for row in block_table)
    table = torch.tensor([row + [0] * (width - len(row)) for row in block_table], dtype=torch.int32)
    slots = [table[i, (s - 1) // block_size] * block_size + (s - 1) % block_size for i, s in enumerate(seq_lens)]
    return AttentionMetadata(
        num_decodes=n,
        query_lens=[1] * n,
        seq_lens=seq_lens,
        cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32),
        cu_seqlens_k=torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], dtype=torch.int32),
        seqused_k=torch.tensor(seq_lens, dtype=torch.int32),
        max_seqlen_q=1,
        max_seqlen_k=max(seq_lens),
        block_table=table,
        slot_mapping=torch.stack(slots).long(),
    )


def test_decode_buffers_pad_rows_and_clear_stale_ones():
    buffers = DecodeBuffers.allocate(max_rows=8, max_blocks_per_seq=4, device=torch.device("cpu"))
    big = decode_meta([5, 17, 33, 2, 9], [[1], [2, 3], [4, 5, 6], [7], [8]], block_size=16)
    buffers.load(torch.arange(10, 15), torch.tensor([4, 16, 32, 1, 8]), big, size=8)
    small = decode_meta([20, 3], [[9, 10], [11]], block_size=16)
    buffers.load(torch.tensor([7, 8]), torch.tensor([19, 2]), small, size=4)
    assert buffers.input_ids[:4].tolist() == [7, 8, 0, 0]
    assert buffers.positions[:4].tolist() == [19, 2, 0, 0]
    assert buffers.seqused_k[:4].tolist() == [20, 3, 0, 0]  # padding rows attend to nothing ...
    assert buffers.slot_mapping[0, :4].tolist() == [10 * 16 + 3, 11 * 16 + 2, -1, -1]  # ... and write no KV
    assert buffers.block_table[0, :2, :2].tolist() == [[9, 10], [11, 0]]
    assert buffers.block_table[0, 2, :3].tolist() == [4, 5, 6]  # a padding row's stale blocks: never read (seqused_k 0)
    meta = buffers.metadata(4, max_seqlen_k=64)
    assert meta.num_decodes == 4 and meta.max_seqlen_q == 1 and meta.cu_seqlens_q.tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(AssertionError, match="block table wider"):
        buffers.load(torch.tensor([1]), torch.tensor([0]), decode_meta([80], [[1, 2, 3, 4, 5]], 16), size=1)


def test_decode_buffers_hold_each_kv_cache_group():
    """Two KV-cache groups (layer 0 full, layer 1 sliding): the graphs' static tables hold both, and
    each layer's captured metadata reads its own group's."""
    buffers = DecodeBuffers.allocate(max_rows=4, max_blocks_per_seq=4, device=torch.device("cpu"), layer_groups=(0, 1))
    meta = decode_meta([20, 3], [[9, 10], [11]], block_size=16)
    meta.kv_block_tables = torch.stack([meta.block_table, torch.tensor([[0, 12], [13, 0]], dtype=torch.int32)])
    meta.kv_slot_mappings = torch.stack([meta.slot_mapping, torch.tensor([12 * 16 + 3, 13 * 16 + 2])])
    buffers.load(torch.tensor([7, 8]), torch.tensor([19, 2]), meta, size=4)
    static = buffers.metadata(4, max_seqlen_k=64)
    assert static.for_layer(0).block_table[:2, :2].tolist() == [[9, 10], [11, 0]]
    assert static.for_layer(1).block_table[:2, :2].tolist() == [[0, 12], [13, 0]]
    assert static.for_layer(1).slot_mapping.tolist() == [12 * 16 + 3, 13 * 16 + 2, -1, -1]
    assert static.for_layer(1) is static.for_layer(1), "a group's metadata is made once per step"


def test_a_model_that_reads_images_reserves_its_encoder_s_memory():
    """CUDA KV sizing takes the encoder cache (full) and one encoder call's activations from free memory:
    SigLIP's fixed patch square (Gemma 3 4B's 896 px / 14), or Qwen3-VL's most patches in one step's budget."""
    from transformers import Gemma3Config, Qwen3VLConfig

    vision = dict(hidden_size=1152, intermediate_size=4304, num_attention_heads=16, image_size=896, patch_size=14)
    gemma = Gemma3Config(vision_config=vision, text_config={"hidden_size": 2560})
    config = EngineConfig(model="m", max_num_batched_tokens=2048)
    cache, patch = 8192 * 2560 * 2, (4 * 1152 + 3 * 4304) * 2
    assert encoder_bytes(gemma, config, 2, 8192, 8) == cache + 8 * 64 * 64 * patch  # about 1.2 GiB
    qwen = Qwen3VLConfig()
    v, width = qwen.vision_config, qwen.text_config.hidden_size
    per_image = 2048 * 2**2 * (4 * v.hidden_size + 3 * v.intermediate_size) * 2
    assert encoder_bytes(qwen, config, 2, 8192, 8) == 8192 * width * 2 + 8 * per_image


def test_kv_cache_sizing_from_device_memory():
    act = 2 * GiB
    # Alone on an 80 GiB card with 2 GiB used by our weights: 0.9 * 80 - 2 - act.
    assert cuda_kv_cache_bytes(78 * GiB, 80 * GiB, 0.9, act) == int(0.9 * 80 * GiB - 2 * GiB - act)
    # Another process holds 30 GiB: our share shrinks by it (utilization is of the whole card).
    assert cuda_kv_cache_bytes(48 * GiB, 80 * GiB, 0.9, act) == int(0.9 * 80 * GiB - 32 * GiB - act)
    # Less free than the utilization allows: never more than what is free.
    assert cuda_kv_cache_bytes(10 * GiB, 80 * GiB, 1.0, act) == 8 * GiB
    assert cuda_kv_cache_bytes(1 * GiB, 80 * GiB, 0.9, act) == 0  # the engine then refuses to start


def test_activation_estimate_covers_a_full_budget_step():
    """Issue 36 (8): the bound holds a full token budget's widest activations, and the sampler's
    working set on the float32 logits of every sampled row, draft rows of speculation included."""
    from transformers import LlamaConfig

    from cb_serve.engine.kv_cache_sizing import SAMPLER_BYTES_PER_LOGIT, logit_rows

    hf = LlamaConfig(hidden_size=2048, intermediate_size=8192, vocab_size=152000)
    config = EngineConfig(max_num_batched_tokens=2048, max_num_seqs=256)
    est = activation_bytes(hf, config, dtype_size=2)
    gate_up = 2048 * 2 * 8192 * 2  # the widest single activation of a 2048-token step
    sort = 256 * 152000 * (4 + 8)  # top-p's sorted values and int64 order alone
    assert logit_rows(config) == 256 and SAMPLER_BYTES_PER_LOGIT >= 4 + 4 + 4 + 8 + 4 + 4
    assert est > gate_up + 256 * 152000 * 4 + sort + (512 << 20)
    spec = EngineConfig(max_num_batched_tokens=2048, max_num_seqs=256, speculative_config=NGRAM_4)
    assert logit_rows(spec) == 256 * 5
    assert activation_bytes(hf, spec, 2) - est == 4 * 256 * 152000 * SAMPLER_BYTES_PER_LOGIT
    assert est < 4 * GiB


NGRAM_4 = {"method": "ngram", "num_speculative_tokens": 4}


@pytest.mark.skipif(
    not HAS_TRITON or os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs triton run by its interpreter (TRITON_INTERPRET=1, set by conftest without CUDA); on CUDA see below",
)
@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_padded_decode_path_with_triton_kernels_matches_reference(random_model_dir, tokenizer, arch):
    """The engine with the Triton backend (interpreted on CPU) and the CUDA-graph runner's
    padded static-buffer path (graphs off) gives HF's greedy tokens (float32, top-2 tie rule).
    5 requests finishing at different lengths (one after its prompt) -> decode batches of 4..1 rows.
    A hybrid model's padding rows (state slot -1) leave every sequence's recurrent state alone."""
    from models import hf_greedy

    model = str(random_model_dir(arch))
    args = dict(max_model_len=128, num_gpu_blocks=64, block_size=16, max_num_seqs=8)
    prompts = [tokenizer.encode(t) for t in ("One", "Two words here", "a b c d e f g h i j k l m n o p q", "x", "yz")]
    lens = [3, 9, 6, 12, 1]
    expected = hf_greedy(model, prompts, lens)
    llm = LLM(model, attention_backend="triton", **args)
    engine = llm.engine
    assert engine.backend.supports_cuda_graphs and engine.runner.graph_runner is None  # no graphs on CPU
    runner = engine.runner
    runner.graph_runner = DecodeGraphRunner(
        runner.decode_graph_forward,
        capture_sizes(8),
        engine.max_model_len,
        engine.block_size,
        engine.device,
        capture=False,
    )
    used: list[int] = []
    run = runner.graph_runner.run
    runner.graph_runner.run = lambda ids, pos, meta: (used.append(ids.shape[0]), run(ids, pos, meta))[1]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
    outputs = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert set(used) >= {4, 3, 1}, used  # decode steps went through the padded path (3 rows -> bucket 4)
    for i, (ours, (ref, logits)) in enumerate(zip(outputs, expected)):
        assert_greedy_match(ours, ref, logits, context=f"request {i}")


@pytest.mark.skipif(
    not HAS_TRITON or os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs triton run by its interpreter (TRITON_INTERPRET=1, set by conftest without CUDA)",
)
def test_warm_up_runs_the_prefill_shapes_and_leaves_the_outputs_alone(random_model_dir, tokenizer):
    """Issue 36 (9): the start-up warm-up (run on CUDA by the builder) launches prefill and mixed
    steps of each query-tile class through the Triton kernels (interpreted here); the KV it writes
    into free blocks is garbage no request reads: greedy tokens afterwards are HF's."""
    from models import hf_greedy

    from cb_serve.model_executor.warm_up import warm_up, warm_up_query_lens

    assert warm_up_query_lens(2048, 4096) == [[7], [33], [130], [2048], [1, 1, 24]]
    assert warm_up_query_lens(64, 40) == [[7], [33], [40], [1, 1, 24]]
    model = str(random_model_dir("llama"))
    llm = LLM(model, attention_backend="triton", max_model_len=128, num_gpu_blocks=16, max_num_batched_tokens=64)
    warm_up(llm.engine.runner, 64, 128)
    prompts = [tokenizer.encode(t) for t in ("One", "a b c d e f g h i j k l m n o p q")]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outputs = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    for i, (ours, (ref, logits)) in enumerate(zip(outputs, hf_greedy(model, prompts, [5, 5]))):
        assert_greedy_match(ours, ref, logits, context=f"request {i}")


def assert_matches_hf_greedy(llm: LLM, model: str, tokenizer, count: int) -> None:
    """``count`` prompts of growing length, each with its own output length: ``llm`` against HF
    ``generate`` in float32 (top-2 tie rule)."""
    from models import hf_greedy

    prompts = [tokenizer.encode(f"Request {i}: " + "word " * (3 * i)) for i in range(count)]
    lens = [4 + 3 * i for i in range(count)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
    outputs = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    for i, ((ref, logits), ours) in enumerate(zip(hf_greedy(model, prompts, lens), outputs)):
        assert_greedy_match(ours, ref, logits.cpu(), context=f"request {i}")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or not HAS_TRITON, reason="needs CUDA and triton")
def test_cuda_graphs_match_hf_greedy(random_model_dir, tokenizer):
    """On CUDA in float32: Triton kernels + CUDA graphs vs HF ``generate`` (top-2 tie rule)."""
    model = str(random_model_dir("llama"))
    llm = LLM(model, device="cuda", dtype="float32", max_model_len=256, max_num_seqs=16, num_gpu_blocks=256)
    assert llm.engine.backend.name == "triton" and llm.engine.runner.graph_runner is not None
    assert_matches_hf_greedy(llm, model, tokenizer, 12)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or not HAS_TRITON, reason="needs CUDA and triton")
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_mixtures_of_experts_in_cuda_graphs_match_hf_greedy(arch, random_model_dir, tokenizer):
    """The Triton grouped GEMM and the router inside captured decode graphs (no host sync in the layer)."""
    model = str(random_model_dir(arch))
    llm = LLM(model, device="cuda", dtype="float32", max_model_len=256, max_num_seqs=16, num_gpu_blocks=256)
    assert llm.engine.backend.name == "triton" and llm.engine.runner.graph_runner is not None
    assert_matches_hf_greedy(llm, model, tokenizer, 12)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or not HAS_TRITON, reason="needs CUDA and triton")
@pytest.mark.parametrize("arch", ["qwen3_next", "granitemoehybrid"])
def test_hybrid_models_on_cuda_match_hf_greedy(arch, random_model_dir, tokenizer):
    """Recurrent layers on CUDA: the Triton decode steps on state slots inside captured decode graphs (padding
    rows' slot -1 skipped), the PyTorch chunked forms eagerly."""
    model = str(random_model_dir(arch))
    llm = LLM(model, device="cuda", dtype="float32", max_model_len=256, max_num_seqs=16, num_gpu_blocks=256)
    assert llm.engine.backend.name == "triton" and llm.engine.runner.graph_runner is not None
    assert_matches_hf_greedy(llm, model, tokenizer, 12)


def test_flash_attn_decode_is_graph_capturable():
    """Issue 24 (5): flash-attn decode steps run in CUDA graphs; its KV write is the Triton kernel,
    which skips a graph padding row's slot -1 (``index_copy_`` would fault on it)."""
    from cb_serve.attention.flash_backend import FlashAttentionBackend
    from cb_serve.attention.triton_backend import TritonAttentionBackend

    assert FlashAttentionBackend.supports_cuda_graphs
    assert FlashAttentionBackend.write_kv is TritonAttentionBackend.write_kv


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or importlib.util.find_spec("flash_attn") is None, reason="needs CUDA and flash-attn")
def test_flash_attn_decode_graphs_match_eager(random_model_dir):
    """bfloat16 with flash-attn: decode through captured graphs (3 rows padded to 4) picks what
    eager decode picks, with log-probabilities within bfloat16 rounding."""
    model = str(random_model_dir("llama"))
    # Two engines in one process: each sized explicitly (without it the first takes 0.9 of the card
    # and the second gets no KV block).
    args = dict(device="cuda", dtype="bfloat16", attention_backend="flash_attn", max_model_len=512, max_num_seqs=8)
    args["num_gpu_blocks"] = 256
    graphs, eager = LLM(model, **args), LLM(model, enforce_eager=True, **args)
    assert graphs.engine.runner.graph_runner is not None and eager.engine.runner.graph_runner is None
    prompts = [list(range(100, 100 + n)) for n in (5, 17, 300)]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=1, ignore_eos=True)
    for a, b in zip(graphs.generate(prompts, params, use_tqdm=False), eager.generate(prompts, params, use_tqdm=False)):
        ours, ref = a.outputs[0], b.outputs[0]
        assert ours.token_ids[0] == ref.token_ids[0]
        for t, (x, y) in enumerate(zip(ours.token_ids, ref.token_ids)):
            if x != y:
                break
            assert abs(ours.logprobs[t][x].logprob - ref.logprobs[t][y].logprob) < 0.05


def test_the_suite_runs_on_cpu_on_a_gpu_host(monkeypatch, random_model_dir):
    """Issue 36 (6): with a CUDA device present (faked here), an engine the tests build with
    device="auto" runs on the CPU in float32 (conftest sets ``CB_SERVE_DEVICE=cpu``, which worker
    processes and Serve replicas inherit) and never touches CUDA; a user's ``auto`` picks CUDA."""
    from cb_serve.model_executor.model_setup import DEVICE_ENV, auto_device_name

    assert os.environ[DEVICE_ENV] == "cpu"
    model = str(random_model_dir("llama"))  # (made first: importing transformers' model meets the fakes)
    forbid_cuda(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    llm = LLM(model, max_model_len=128, num_gpu_blocks=16)
    assert (llm.engine.device, llm.engine.dtype) == (torch.device("cpu"), torch.float32)
    assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids) == 2
    assert auto_device_name("auto", True, {}) == "cuda"
    assert auto_device_name("auto", False, {}) == "cpu"
    assert auto_device_name("cuda:1", True, {DEVICE_ENV: "cpu"}) == "cuda:1"


@pytest.mark.parametrize(
    "device, available, expected",
    [
        ("cuda", (True, False), "triton"),
        ("cuda", (False, False), "torch"),
        ("cpu", (False, True), "cpu"),
        ("cpu", (False, False), "torch"),
    ],
)
def test_auto_backend_choice_by_device(device, available, expected):
    """Issue 36 (2): on CUDA ``auto`` is the Triton backend (flash-attn, even where installed, only
    when asked for: its wheels cover few torch and CUDA versions); on CPU the C++ kernels."""
    from cb_serve.attention import auto_backend_name

    assert auto_backend_name(device, *available) == expected


def test_flash_attn_asked_for_with_float32_is_a_clear_error():
    from cb_serve.attention import get_attention_backend

    with pytest.raises(ValueError, match="float16 or bfloat16"):
        get_attention_backend("flash_attn", torch.device("cpu"), torch.float32)


# ---- issue 24 (2): the engine's device is the current one where graphs and Triton kernels run ----


def forbid_cuda(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("touched CUDA on a CPU engine")

    for name in ("device", "set_device", "current_device", "synchronize", "Stream", "graph", "CUDAGraph"):
        monkeypatch.setattr(torch.cuda, name, refuse)


def test_device_context_leaves_cuda_alone_off_cuda(monkeypatch):
    from cb_serve.model_executor.device_context import bind_thread_to_device, concrete_device, device_context

    forbid_cuda(monkeypatch)
    cpu = torch.device("cpu")
    with device_context(cpu):
        pass
    bind_thread_to_device(cpu)
    assert concrete_device(cpu) == cpu


class FakeCuda:
    """Stands in for ``torch.cuda``'s device selection, streams and graphs: records which device
    was current at each call."""

    def __init__(self, monkeypatch, current: int = 0) -> None:
        self.current = current
        self.log: list[tuple] = []
        fake = self

        class Device:
            def __init__(self, device):
                self.idx = device.index if device.index is not None else fake.current

            def __enter__(self):
                self.prev, fake.current = fake.current, self.idx

            def __exit__(self, *exc):
                fake.current = self.prev

        class Stream:
            def __init__(self, device=None):
                self.device = torch.device(device)
                fake.log.append(("stream", self.device, fake.current))

        class Graph:
            def replay(self):
                fake.log.append(("replay", fake.current))

        class Capture:
            def __init__(self, graph, pool=None, stream=None):
                self.stream = stream

            def __enter__(self):
                fake.log.append(("capture", self.stream and self.stream.device, fake.current))

            def __exit__(self, *exc):
                fake.log.append(("capture end", fake.current))

        monkeypatch.setattr(torch.cuda, "device", Device)
        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
        monkeypatch.setattr(torch.cuda, "graph", Capture)
        monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: fake.log.append(("sync", fake.current)))
        monkeypatch.setattr(torch.cuda, "current_device", lambda: fake.current)
        monkeypatch.setattr(torch.cuda, "set_device", lambda device: setattr(fake, "current", device.index))


def test_device_context_selects_the_engine_gpu(monkeypatch):
    from cb_serve.model_executor.device_context import bind_thread_to_device, concrete_device, device_context

    cuda = FakeCuda(monkeypatch, current=0)
    with device_context(torch.device("cuda", 1)):
        assert cuda.current == 1
    assert cuda.current == 0  # restored
    with device_context(torch.device("cuda")):  # bare "cuda": the current device
        assert cuda.current == 0
    cuda.current = 3
    assert concrete_device(torch.device("cuda")) == torch.device("cuda", 3)
    assert concrete_device(torch.device("cuda", 1)) == torch.device("cuda", 1)
    bind_thread_to_device(torch.device("cuda", 2))
    assert cuda.current == 2


def test_graphs_are_captured_and_replayed_on_the_runner_gpu(monkeypatch):
    """A runner for cuda:1 driven from a thread whose current device is 0: every warmup, capture
    and replay runs with cuda:1 current, on one capture stream made on cuda:1 (torch.cuda.graph's
    default stream belongs to whichever device was current when the process first captured)."""
    cuda = FakeCuda(monkeypatch, current=0)
    allocate, CPU = DecodeBuffers.allocate.__func__, torch.device("cpu")
    monkeypatch.setattr(
        DecodeBuffers,
        "allocate",
        classmethod(lambda cls, rows, width, _device, groups=(): allocate(cls, rows, width, CPU, groups)),
    )
    forwards: list[int] = []

    def forward(ids, pos, meta):
        forwards.append(cuda.current)
        return torch.zeros(ids.shape[0], 4)

    gpu1 = torch.device("cuda", 1)
    runner = DecodeGraphRunner(forward, [1, 2, 4], max_model_len=64, block_size=16, device=gpu1)
    assert cuda.current == 0  # restored after capture
    assert forwards == [1] * 6  # a warmup and a capture per size, all on cuda:1
    streams = [entry for entry in cuda.log if entry[0] == "stream"]
    assert streams == [("stream", gpu1, 1)]
    assert [e for e in cuda.log if e[0] == "capture"] == [("capture", gpu1, 1)] * 3
    assert all(e[-1] == 1 for e in cuda.log if e[0] in ("sync", "capture end"))
    meta = decode_meta([5, 9, 3], [[1], [2], [3]], block_size=16)
    out = runner.run(torch.tensor([1, 2, 3]), torch.tensor([4, 8, 2]), meta)
    assert out.shape == (3, 4) and cuda.log[-1] == ("replay", 1) and cuda.current == 0


def test_engine_thread_binds_the_engine_device(random_model_dir, monkeypatch):
    """AsyncLLM's engine thread makes the engine's device its current one (per host thread) before
    its first step; on CPU that call leaves CUDA alone (see above)."""
    from cb_serve.engine import async_llm, engine_loop

    bound: list[tuple[str, torch.device]] = []
    done = threading.Event()

    def spy(device):
        bound.append((threading.current_thread().name, device))
        done.set()

    monkeypatch.setattr(engine_loop, "bind_thread_to_device", spy)
    engine = async_llm.AsyncLLM(
        EngineConfig.from_kwargs(model=str(random_model_dir("llama")), max_model_len=128, num_gpu_blocks=32)
    )
    try:
        assert done.wait(30)
    finally:
        engine.shutdown()
    assert bound == [("cb-serve-engine", torch.device("cpu"))]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_engine_on_a_second_gpu_matches_hf_greedy(random_model_dir, tokenizer):
    """``device="cuda:1"`` while the calling thread's current device is 0: graphs and Triton
    kernels run on cuda:1 (float32, top-2 tie rule)."""
    model = str(random_model_dir("llama"))
    llm = LLM(model, device="cuda:1", dtype="float32", max_model_len=256, max_num_seqs=8)
    assert torch.cuda.current_device() == 0
    assert llm.engine.runner.kv_caches[0].device == torch.device("cuda", 1)
    assert_matches_hf_greedy(llm, model, tokenizer, 6)


# ---- issue 24 (3): KV-cache sizing sees the memory the weights really use ----


def test_kv_sizing_frees_cached_memory_before_asking_what_is_free(monkeypatch):
    from transformers import LlamaConfig

    from cb_serve.engine.kv_cache_sizing import kv_cache_bytes_per_block, num_kv_blocks

    calls: list[object] = []
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append("gc") or 0)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))

    def mem_get_info(device=None):
        calls.append(("mem_get_info", device))
        return 60 * GiB, 80 * GiB

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    hf = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_key_value_heads=8)
    config = EngineConfig(gpu_memory_utilization=0.9)
    device = torch.device("cuda", 1)
    num = num_kv_blocks(config, hf, 16, 4096, torch.bfloat16, torch.bfloat16, device)
    assert calls == ["gc", "empty_cache", ("mem_get_info", device)]  # cached blocks returned first
    budget = cuda_kv_cache_bytes(60 * GiB, 80 * GiB, 0.9, activation_bytes(hf, config, 2))
    assert budget == int(0.9 * 80 * GiB - 20 * GiB - activation_bytes(hf, config, 2))
    assert num == budget // kv_cache_bytes_per_block(hf, 16, torch.bfloat16) > 0


class AllocationSpy:
    """Records ``(shape, dtype)`` of every tensor made on a real device (not meta) while active."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        seen = self.seen = []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                seen.extend(
                    (tuple(t.shape), t.dtype) for t in tree_leaves(out) if isinstance(t, torch.Tensor) and not t.is_meta
                )
                return out

        self.mode = Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


@pytest.mark.parametrize("tied", [False, True])
def test_loader_builds_weights_in_the_target_dtype(tmp_path, tokenizer, tied):
    """With dtype=bfloat16 no float32 copy of a weight is ever allocated (the fused gate/up shape
    is ours alone; the same spy sees it when the module is built in float32 and cast), every
    parameter is bfloat16 and loaded, tied weights stay tied, and the RoPE tables stay float32."""
    from models import make_random_model
    from transformers import AutoModelForCausalLM

    from cb_serve.attention import TorchAttentionBackend
    from cb_serve.model_executor import loader

    directory = make_random_model(tmp_path, "llama", tokenizer, tie_word_embeddings=tied)
    source = loader.resolve_model_source(str(directory))
    config = loader.load_config(source)
    gate_up = (2 * config.intermediate_size, config.hidden_size)
    backend, cpu = TorchAttentionBackend(), torch.device("cpu")
    with AllocationSpy() as spy:
        model = loader.load_model(source, config, backend, torch.bfloat16, cpu, max_model_len=64)
    assert (gate_up, torch.float32) not in spy.seen
    assert (gate_up, torch.bfloat16) in spy.seen
    with AllocationSpy() as old_way:  # the detector sees a float32 build
        with cpu:
            MODELS["llama"](config, backend, model.rope_cos, model.rope_sin).to(torch.bfloat16)
    assert (gate_up, torch.float32) in old_way.seen

    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rope_cos.dtype == model.rope_sin.dtype == torch.float32
    assert (model.lm_head.weight is model.embed_tokens.weight) == tied
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).state_dict()
    assert torch.equal(model.embed_tokens.weight, hf["model.embed_tokens.weight"])
    assert torch.equal(
        model.layers[1].mlp.gate_up_proj.weight[: config.intermediate_size], hf["model.layers.1.mlp.gate_proj.weight"]
    )
    assert torch.equal(model.norm.weight, hf["model.norm.weight"])


def test_build_module_refuses_a_constructor_tensor_it_cannot_allocate():
    from cb_serve.model_executor.loader import build_module

    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)
            self.table = torch.arange(4.0)  # neither parameter nor buffer

    with pytest.raises(RuntimeError, match="register it as a buffer"):
        build_module(Odd, torch.bfloat16, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_loading_in_bfloat16_never_holds_a_float32_copy_on_the_gpu(random_model_dir):
    """The peak of device memory while loading is the bfloat16 weights (and the float32 RoPE
    tables), not a float32 build of them as well."""
    from cb_serve.attention import TorchAttentionBackend
    from cb_serve.model_executor import loader

    source = loader.resolve_model_source(str(random_model_dir("llama")))
    config = loader.load_config(source)
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    model = loader.load_model(source, config, TorchAttentionBackend(), torch.bfloat16, device, max_model_len=256)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    rope = 2 * model.rope_cos.numel() * 4
    assert torch.cuda.max_memory_allocated() - before <= weights + 2 * rope + (1 << 20)


# ---- issue 24 (5): the Triton tile plan is copied from pinned memory on CUDA ----


def test_tile_plan_copy_is_pinned_only_on_cuda(monkeypatch):
    import numpy as np

    from cb_serve.attention.base import host_to_device

    plan = np.arange(8, dtype=np.int32).reshape(4, 2)
    calls: list[tuple] = []
    to = torch.Tensor.to

    def pin_memory(self):
        calls.append(("pin",))
        return self

    def fake_to(self, device, non_blocking=False):
        calls.append(("to", torch.device(device).type, non_blocking))
        return to(self, "cpu")

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "to", fake_to)
    assert host_to_device(plan, torch.device("cpu")).tolist() == plan.tolist()
    assert calls == [("to", "cpu", True)]  # CPU and the interpreter: no pinning
    calls.clear()
    assert host_to_device(plan, torch.device("cuda", 0)).tolist() == plan.tolist()
    assert calls == [("pin",), ("to", "cuda", True)]


# ---- issue 24 (6): an engine's tensors are freed when it is dropped, by reference counting ----


@contextlib.contextmanager
def collector_off():
    """The garbage collector off: what the block frees, reference counting freed. Collected first:
    a cycle made while transformers imported a module as the engine loaded (``torch.fx.wrap`` keeps
    its own frame) holds every frame above it, the engine's constructor's too, until a collection."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.mark.parametrize("graphs", [False, True])
def test_del_llm_frees_its_tensors_without_the_garbage_collector(random_model_dir, tokenizer, graphs):
    """``del llm`` frees the engine, its weights, KV cache and graph runner at once (no cycle through
    ``DecodeGraphRunner.forward``), after steps with a constrained request (the grammar compiler's
    and bitmask filler's threads hold no part of the engine). With ``graphs``: the Triton backend
    (interpreted on CPU) and a DecodeGraphRunner as the CUDA path has one (capture off)."""
    from cb_serve.structured_outputs import StructuredOutputsParams

    if graphs and (not HAS_TRITON or os.environ.get("TRITON_INTERPRET") != "1"):
        pytest.skip("needs triton run by its interpreter (TRITON_INTERPRET=1, set by conftest without CUDA)")
    args = dict(max_model_len=128, num_gpu_blocks=32, block_size=16, max_num_seqs=4)
    llm = LLM(str(random_model_dir("llama")), attention_backend="triton" if graphs else "auto", **args)
    with collector_off():
        runner = llm.engine.runner
        if graphs:
            runner.graph_runner = DecodeGraphRunner(
                runner.decode_graph_forward, [1, 2, 4], 128, 16, llm.engine.device, capture=False
            )
        tensors = (runner.kv_caches[0], runner.model.embed_tokens.weight)
        refs = [weakref.ref(x) for x in (llm.engine, runner, runner.graph_runner or runner, *tensors)]
        del runner, tensors
        choice = StructuredOutputsParams(choice=["alpha", "beta"])
        params = [SamplingParams(max_tokens=3, temperature=0, structured_outputs=choice), SamplingParams(max_tokens=3)]
        outputs = llm.generate([tokenizer.encode("One"), tokenizer.encode("Two words")], params, use_tqdm=False)
        assert outputs[0].outputs[0].text in ("alpha", "beta") and len(outputs[1].outputs[0].token_ids) == 3
        del llm, outputs
        assert [ref() is None for ref in refs] == [True] * len(refs)


def test_shut_down_async_engine_is_freed_without_the_garbage_collector(random_model_dir):
    """After ``shutdown`` the engine thread has ended and let go of the AsyncLLM (its target is a
    bound method): dropping the AsyncLLM frees the engine and its KV cache."""
    from cb_serve.engine.async_llm import AsyncLLM

    async def run(engine: AsyncLLM) -> None:
        async for _ in engine.generate("hello", SamplingParams(max_tokens=3), "r1"):
            pass

    engine = AsyncLLM(
        EngineConfig.from_kwargs(model=str(random_model_dir("llama")), max_model_len=128, num_gpu_blocks=32)
    )
    with collector_off():
        asyncio.run(run(engine))
        refs = [weakref.ref(x) for x in (engine, engine.engine, engine.engine.runner.kv_caches[0])]
        engine.shutdown()
        del engine
        assert [ref() is None for ref in refs] == [True, True, True]


def test_graph_runner_does_not_keep_its_model_runner_alive():
    """The runner holds a bound-method forward weakly and says so once its object is gone; any
    other callable it holds as is."""

    class Owner:
        def forward(self, ids, pos, meta):
            return torch.zeros(ids.shape[0], 2)

    owner = Owner()
    owner.graphs = DecodeGraphRunner(owner.forward, [1, 2], 32, 16, torch.device("cpu"), capture=False)
    meta = decode_meta([3], [[1]], block_size=16)
    assert owner.graphs.run(torch.tensor([5]), torch.tensor([2]), meta).shape == (1, 2)
    graphs, ref = owner.graphs, weakref.ref(owner)
    del owner
    assert ref() is None
    with pytest.raises(RuntimeError, match="freed"):
        graphs.run(torch.tensor([5]), torch.tensor([2]), meta)
    plain = DecodeGraphRunner(
        lambda ids, pos, meta: torch.ones(ids.shape[0], 2), [1], 32, 16, torch.device("cpu"), capture=False
    )
    assert plain.run(torch.tensor([5]), torch.tensor([2]), meta).sum() == 2


def test_pinned_staging_waits_for_the_last_copy_before_refilling(monkeypatch):
    """Issue 24 (5): step metadata goes through one pinned buffer per dtype, kept across steps. A
    step that samples nothing ends without a host sync, so refilling the buffer first waits for the
    event recorded behind its previous copy (a new, larger buffer needs no wait)."""
    from cb_serve.model_executor.step_batch import HostStaging

    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: t)  # no CUDA here: plain memory
    waits = []

    class Event:
        def query(self) -> bool:  # the copy has not run yet (a done one is not waited for)
            return False

        def synchronize(self) -> None:
            waits.append(staging.pinned[torch.int64][:3].tolist())  # what the buffer held meanwhile

    staging = HostStaging(torch.device("cuda"))
    first = staging._stage(torch.tensor([1, 2, 3]))
    assert waits == [] and first.tolist() == [1, 2, 3]
    staging.copied[torch.int64] = Event()
    second = staging._stage(torch.tensor([7, 8, 9]))
    assert waits == [[1, 2, 3]], "refilled before the previous copy was known to have run"
    assert second.tolist() == [7, 8, 9] and second.data_ptr() == first.data_ptr()  # the same buffer
    staging._stage(torch.arange(5000))  # too long: a new buffer, no wait
    assert len(waits) == 1 and staging.pinned[torch.int64].numel() == 8192
