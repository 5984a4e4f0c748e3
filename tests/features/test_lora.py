"""Multi-LoRA serving in the engine: greedy outputs with an adapter equal HF transformers + PEFT
token for token; adapters of one step batched with each other and with the base model; slots
(``max_loras``) refilled in LRU order; the prefix cache keyed by adapter; bad adapters refused."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from models import (
    STRESS_ENGINE_ARGS,
    assert_greedy_match,
    assert_same_greedy,
    hf_greedy,
    make_adapter,
    make_random_model,
    stress_engine_args,
)
from safetensors.torch import save_file

from cb_serve import LLM, LoRARequest, SamplingParams
from cb_serve.errors import InvalidRequestError
from cb_serve.lora.layers import group_tokens

# Under STRESS_ENGINE_ARGS (40 blocks of 16 tokens) these preempt and prefill in chunks.
PROMPTS = [
    [1, 5, 9, 200, 33, 7] * 3,
    [4, 8, 15, 16, 23, 42] * 9,
    [300, 301, 302] * 50,
    list(range(100, 290)),
    [7, 700, 70, 7000] * 30,
    list(range(2000, 2100)),
]
MAX_TOKENS = [24, 16, 30, 20, 28, 32]


def peft_greedy(model_dir: Path, adapter: Path | None, prompts=PROMPTS, max_tokens=MAX_TOKENS):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    return hf_greedy(model, prompts, max_tokens)


@pytest.fixture(scope="module")
def adapters(random_model_dir, tmp_path_factory):
    """Per architecture: its model directory and four adapters (ranks 8 and 16; one rsLoRA, one on
    attention only, one on the MLP only)."""
    made = {}

    def make(arch: str):
        if arch not in made:
            model_dir = random_model_dir(arch)
            root = tmp_path_factory.mktemp(f"lora-{arch}")
            made[arch] = (
                model_dir,
                [
                    make_adapter(model_dir, root / "r8", 8, seed=1),
                    make_adapter(model_dir, root / "r16", 16, seed=2, use_rslora=True),
                    make_adapter(model_dir, root / "attn", 8, seed=3, targets=["q_proj", "k_proj", "v_proj", "o_proj"]),
                    make_adapter(model_dir, root / "mlp", 16, seed=4, targets=["gate_proj", "up_proj", "down_proj"]),
                ],
            )
        return made[arch]

    return make


def lora(path: Path, i: int) -> LoRARequest:
    return LoRARequest(path.name, i + 1, str(path))


def run(llm: LLM, prompts=PROMPTS, max_tokens=MAX_TOKENS, loras=None, logprobs=None):
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, logprobs=logprobs) for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize(
    "arch",
    [
        "llama",
        "qwen2",
        "mistral",
        "qwen3",
        "gemma3_text",
        "gemma2",
        "olmo2",
        "granite",
        "phi3",
        "gemma4_text",
    ],
)
def test_greedy_with_adapters_equals_hf_peft(arch, adapters):
    """Under chunked prefill and preemption; two adapters at ranks 8 and 16 on attention and MLP."""
    model_dir, paths = adapters(arch)
    llm = LLM(str(model_dir), enable_lora=True, max_loras=2, max_lora_rank=16, **stress_engine_args(arch))
    base = run(llm)
    for i, path in enumerate(paths[:2]):
        ours = run(llm, loras=lora(path, i))
        ref = peft_greedy(model_dir, path)
        for j, ((tokens, _), (ref_tokens, ref_logits)) in enumerate(zip(ours, ref)):
            assert_greedy_match(tokens, ref_tokens, ref_logits, f"{arch} {path.name} prompt {j}")
        assert [t for t, _ in ours] != [t for t, _ in base], "the adapter changed nothing"
    for (tokens, _), (ref_tokens, ref_logits) in zip(base, peft_greedy(model_dir, None)):
        assert_greedy_match(tokens, ref_tokens, ref_logits, f"{arch} base")
    stats = llm.engine.get_stats()
    assert stats.num_preemptions > 0 and stats.num_partial_prefills > 0
    assert stats.kv_blocks_used == 0


# Hybrid models (issue 55): adapters on their gated attention (q_proj's rows [q | gate] per head), dense MLPs and
# the recurrent layers' projections: Qwen3.5's in_proj parts, Qwen3-Next's per-key-head in_proj_qkvz / _ba
# (grouped as its checkpoint is), Granite 4's Mamba2 in_proj; each layer's out_proj.
HYBRID_TARGETS = {
    "qwen3_5_text": ["q_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj",
                     "gate_proj", "down_proj"],
    "qwen3_next": ["q_proj", "k_proj", "o_proj", "in_proj_qkvz", "in_proj_ba", "out_proj"],
    "qwen3_5_moe_text": ["q_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj"],
    "granitemoehybrid": ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "out_proj"],
}  # fmt: skip


@pytest.mark.parametrize("arch", list(HYBRID_TARGETS))
def test_adapters_on_hybrid_models_equal_hf_peft(arch, random_model_dir, tmp_path):
    """Under chunked prefill, preemption and prefix caching (the adapter salts its blocks' and snapshots' keys)."""
    model_dir = random_model_dir(arch)
    path = make_adapter(model_dir, tmp_path / arch, 8, seed=5, targets=HYBRID_TARGETS[arch])
    llm = LLM(str(model_dir), enable_lora=True, max_loras=1, max_lora_rank=8, **stress_engine_args(arch))
    try:
        base, ours = run(llm), run(llm, loras=lora(path, 0))
        for j, ((tokens, _), (ref_tokens, ref_logits)) in enumerate(zip(ours, peft_greedy(model_dir, path))):
            assert_greedy_match(tokens, ref_tokens, ref_logits, f"{arch} adapter prompt {j}")
        assert [t for t, _ in ours] != [t for t, _ in base], "the adapter changed nothing"
        stats = llm.engine.get_stats()
        assert stats.num_preemptions > 0 and stats.kv_blocks_used == 0 and stats.state_slots_used == 0
    finally:
        llm.engine.shutdown()


def test_adapters_on_a_mixture_of_experts_serve_its_attention(adapters):
    """Qwen3-MoE: an adapter on the attention projections equals PEFT; one on the experts (PEFT's
    ``target_parameters``) is refused, naming them."""
    model_dir, paths = adapters("qwen3_moe")
    llm = LLM(str(model_dir), enable_lora=True, max_loras=1, max_lora_rank=16, **stress_engine_args("qwen3_moe"))
    ours = run(llm, loras=lora(paths[2], 2))
    for j, ((tokens, _), (ref_tokens, ref_logits)) in enumerate(zip(ours, peft_greedy(model_dir, paths[2]))):
        assert_greedy_match(tokens, ref_tokens, ref_logits, f"qwen3_moe attention adapter, prompt {j}")
    with pytest.raises(InvalidRequestError, match="target_parameters"):
        run(llm, PROMPTS[:1], [4], [lora(paths[0], 0)])
    assert llm.engine.get_stats().kv_blocks_used == 0


def test_mixed_batch_of_four_adapters_and_the_base_equals_each_alone(adapters):
    model_dir, paths = adapters("llama")
    llm = LLM(str(model_dir), enable_lora=True, max_loras=4, max_lora_rank=16, num_gpu_blocks=256, max_model_len=400)
    choices = [lora(p, i) for i, p in enumerate(paths)] + [None]
    prompts = [PROMPTS[i % 4] for i in range(10)]
    max_tokens = [MAX_TOKENS[i % 4] for i in range(10)]
    loras = [choices[i % 5] for i in range(10)]
    mixed = run(llm, prompts, max_tokens, loras, logprobs=2)
    assert llm.engine.get_stats().max_batch_seqs == 10  # all in one running batch
    alone = [run(llm, [p], [m], [x], logprobs=2)[0] for p, m, x in zip(prompts, max_tokens, loras)]
    assert_same_greedy(mixed, alone, "mixed batch vs alone")
    assert len({tuple(t) for t, _ in mixed[:5]}) == 5  # four adapters and the base all differ


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_max_loras_2_with_4_adapters_every_request_finishes(adapters, async_scheduling):
    """Requests of four adapters through two slots: each waits for a slot holding nothing, and
    its tokens are those of its adapter alone; the slots' loads and evictions are counted. Under async
    scheduling too (slots loaded and evicted while a step is in flight)."""
    model_dir, paths = adapters("llama")
    args = dict(enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=2, async_scheduling=async_scheduling)
    llm = LLM(str(model_dir), **args, **STRESS_ENGINE_ARGS)
    loras = [lora(paths[i % 4], i % 4) for i in range(8)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(8)]
    max_tokens = [MAX_TOKENS[i % len(MAX_TOKENS)] for i in range(8)]
    seen: list[int] = []  # adapters among the running sequences after each step

    def adapters_running(stats, outs) -> None:
        seen.append(len({s.lora.key for s in llm.engine.scheduler.running if s.lora is not None}))

    llm.engine.add_step_listener(adapters_running)
    together = run(llm, prompts, max_tokens, loras, logprobs=2)
    stats = llm.engine.get_stats()
    assert stats.lora_loads >= 4 and stats.lora_evictions >= 2, stats
    assert max(seen) == 2 and stats.max_loras == 2 and stats.lora_slots_used <= 2
    assert stats.kv_blocks_used == 0
    fresh = LLM(str(model_dir), enable_lora=True, max_loras=4, max_lora_rank=16, **STRESS_ENGINE_ARGS)
    alone = [run(fresh, [p], [m], [x], logprobs=2)[0] for p, m, x in zip(prompts, max_tokens, loras)]
    assert_same_greedy(together, alone, "max_loras=2 vs each alone")


def test_prefix_cache_is_keyed_by_adapter(adapters):
    model_dir, paths = adapters("llama")
    llm = LLM(str(model_dir), enable_lora=True, max_loras=2, num_gpu_blocks=128, max_model_len=256)
    prompt, one = [list(range(200, 264))], [4]
    first = lora(paths[0], 0)

    def hits(loras) -> int:
        before = llm.engine.get_stats().prefix_cache_hits
        run(llm, prompt, one, loras)
        return llm.engine.get_stats().prefix_cache_hits - before

    assert hits([first]) == 0
    assert hits([first]) == 48  # 3 full blocks of 16 (the last token is always computed)
    assert hits([lora(paths[2], 2)]) == 0  # another adapter: no shared KV
    assert hits(None) == 0  # nor the base model
    assert hits(None) == 48
    renamed = LoRARequest(first.lora_name, first.lora_int_id, str(paths[2]))  # same name, other weights
    assert hits([renamed]) == 0


def test_bad_adapters_are_refused_before_anything_runs(adapters, random_model_dir, tmp_path, tokenizer):
    model_dir, paths = adapters("llama")
    llm = LLM(str(model_dir), enable_lora=True, max_loras=1, max_lora_rank=8, num_gpu_blocks=64, max_model_len=256)
    cases = {
        "not a directory": LoRARequest("x", 1, str(tmp_path / "missing")),
        "no adapter_config.json": LoRARequest("x", 1, str(tmp_path)),
        "above max_lora_rank=8": lora(paths[1], 1),
    }
    other_dir = tmp_path / "wide"
    make_random_model(other_dir, "llama", tokenizer, hidden_size=96)
    cases["another base model"] = LoRARequest("w", 1, str(make_adapter(other_dir, tmp_path / "wide-a", 4, 0)))
    cases["lm_head"] = LoRARequest("h", 1, str(make_adapter(model_dir, tmp_path / "head", 4, 0, ["lm_head"])))
    cases["use_dora"] = LoRARequest("d", 1, str(make_adapter(model_dir, tmp_path / "dora", 4, 0, use_dora=True)))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    (broken / "adapter_model.safetensors").write_bytes(b"not safetensors")
    cases["Cannot read the adapter weights"] = LoRARequest("b", 1, str(broken))
    half = tmp_path / "half"
    half.mkdir()
    (half / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    save_file(
        {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(4, 64)},
        half / "adapter_model.safetensors",
    )
    cases["lacks lora_B"] = LoRARequest("half", 1, str(half))
    experts = tmp_path / "experts"  # PEFT's names for an adapter on a mixture-of-experts layer's experts
    experts.mkdir()
    (experts / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    prefix = "base_model.model.model.layers.0.mlp.experts.0.gate_proj"
    save_file(
        {f"{prefix}.lora_A.weight": torch.ones(4, 64), f"{prefix}.lora_B.weight": torch.ones(32, 4)},
        experts / "adapter_model.safetensors",
    )
    cases["the experts of a mixture-of-experts layer"] = LoRARequest("e", 1, str(experts))
    for expected, request in cases.items():
        with pytest.raises(InvalidRequestError, match="(?i)" + re.escape(expected)) as info:
            run(llm, PROMPTS[:1], [4], [request])
        assert info.value.param == "lora_request"
    assert not llm.engine.has_unfinished_requests()
    assert run(llm, PROMPTS[:1], [4], [lora(paths[0], 0)])  # the engine serves on
    plain = LLM(str(model_dir), num_gpu_blocks=64, max_model_len=256)
    with pytest.raises(InvalidRequestError, match="enable_lora"):
        run(plain, PROMPTS[:1], [4], [lora(paths[0], 0)])
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, "/tmp")
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LLM(str(model_dir), enable_lora=True, max_loras=2, max_cpu_loras=1)


def test_token_groups_are_slices_when_contiguous():
    slots = np.asarray([-1, 0, 0, 1, 1, 1, 0, -1, 2])
    groups = dict(group_tokens(slots, torch.device("cpu")))
    assert groups[1] == slice(3, 6) and groups[2] == slice(8, 9)
    assert groups[0].tolist() == [1, 2, 6] and -1 not in groups
    assert group_tokens(np.asarray([-1, -1]), torch.device("cpu")) == []


def test_a_request_whose_adapter_has_no_slot_waits_holding_nothing():
    """max_loras=1: with adapter a running, b's request waits (no blocks) while base and a's
    requests behind it are admitted; b runs once a's sequences are done."""
    from cb_serve.engine.block_manager import BlockManager
    from cb_serve.engine.scheduler import Scheduler
    from cb_serve.lora.admission import LoRAAdmission
    from cb_serve.sequence import Sequence, SequenceStatus

    a, b = LoRARequest("a", 1, "/a"), LoRARequest("b", 2, "/b")
    scheduler = Scheduler(BlockManager(64, 16), 512, 8, 256, admission=LoRAAdmission(1))
    seqs = [Sequence(i, str(i), 0, [i + 1] * 20, SamplingParams(), 4, lora=x) for i, x in enumerate([a, b, None, a])]
    for seq in seqs:
        scheduler.add(seq)
    out = scheduler.schedule()
    assert out.seqs == [seqs[0], seqs[2], seqs[3]]
    assert list(scheduler.waiting) == [seqs[1]] and not seqs[1].block_table
    scheduler.update_after_step(out)
    for seq in (seqs[0], seqs[2], seqs[3]):
        scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
    assert scheduler.schedule().seqs == [seqs[1]]


def test_the_cpu_kernel_and_the_gemm_path_add_the_same():
    """``cpu_ops.lora_apply`` (all adapters in one call) against the gathered-GEMM path, on tokens of
    three adapters (one contiguous run, two scattered), base tokens and an empty slot."""
    from cb_serve import cpu_ops
    from cb_serve.lora.layers import LoRABatch, LoRALinear
    from cb_serve.model_executor.layers.linear import Linear

    if not cpu_ops.available():
        pytest.skip("no C++ toolchain: the CPU kernels did not build")
    torch.manual_seed(0)
    slots = [0, 0, 0, -1, 1, 3, 1, -1, 3, 2, 0, 0, 0, 1, 3, 0]  # 7 tokens of slot 0: 4 at once, then 3 alone
    for k, n in [(96, 160), (40, 50)]:  # outputs a whole number of the kernel's column chunks, and not
        batch = LoRABatch()
        layer = LoRALinear(Linear(k, n, bias=False), batch, max_loras=4, max_rank_rows=24)
        for slot, rank in [(0, 24), (1, 7), (3, 16)]:
            layer.set_slot(slot, (torch.randn(rank, k), torch.randn(rank, n)))
        batch.set_groups(np.asarray(slots), torch.device("cpu"))
        x = torch.randn(len(slots), k)
        kernel = layer(x)
        layer.use_cpu_kernel = False
        grouped = layer(x)
        torch.testing.assert_close(kernel, grouped, rtol=1e-5, atol=1e-4)
        base = layer.base(x)
        assert torch.equal(kernel[[3, 7, 9]], base[[3, 7, 9]])  # the base model's and the empty slot's rows


def test_the_gemm_path_equals_hf_peft(adapters):
    """The path non-CPU devices (and non-float32 weights) take, on the engine."""
    model_dir, paths = adapters("qwen2")
    llm = LLM(str(model_dir), enable_lora=True, max_loras=2, max_lora_rank=16, **STRESS_ENGINE_ARGS)
    for layer in llm.engine.lora.layers.values():
        layer.use_cpu_kernel = False
    ours = run(llm, loras=lora(paths[3], 3))
    for j, ((tokens, _), (ref_tokens, ref_logits)) in enumerate(zip(ours, peft_greedy(model_dir, paths[3]))):
        assert_greedy_match(tokens, ref_tokens, ref_logits, f"gemm path prompt {j}")


def test_a_waiting_adapter_is_not_starved_by_a_stream_of_another():
    """max_loras=1 and a new request for adapter a every step, behind one for b: b waits at most
    ``MAX_LORA_WAIT_STEPS`` admissions, then a's newer requests wait until a's running ones drain."""
    from cb_serve.engine.block_manager import BlockManager
    from cb_serve.engine.scheduler import Scheduler
    from cb_serve.lora.admission import MAX_LORA_WAIT_STEPS, LoRAAdmission
    from cb_serve.sequence import Sequence, SequenceStatus

    a, b = LoRARequest("a", 1, "/a"), LoRARequest("b", 2, "/b")
    scheduler = Scheduler(BlockManager(512, 16), 512, 16, 256, admission=LoRAAdmission(1))

    def request(i: int, adapter: LoRARequest) -> Sequence:
        seq = Sequence(i, str(i), 0, [i % 50 + 1] * 8, SamplingParams(), 3, lora=adapter)
        scheduler.add(seq)
        return seq

    request(0, a)
    waiting_b = request(1, b)
    for step in range(4 * MAX_LORA_WAIT_STEPS):
        request(2 + step, a)
        out = scheduler.schedule()
        if waiting_b in out.seqs:
            break
        assert len({s.lora.key for s in scheduler.running}) <= 1
        scheduler.update_after_step(out)
        for seq in list(scheduler.running):
            if seq.num_computed_tokens == seq.num_tokens:
                seq.append_token(7, 0.0)
                if seq.num_output_tokens >= 3:
                    scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
    else:
        raise AssertionError("b never got a slot")
    assert MAX_LORA_WAIT_STEPS < step < MAX_LORA_WAIT_STEPS + 8


def test_a_held_adapter_is_not_read_again(adapters):
    model_dir, paths = adapters("llama")
    llm = LLM(str(model_dir), enable_lora=True, max_loras=2, max_lora_rank=16, num_gpu_blocks=64, max_model_len=256)
    first = lora(paths[0], 0)
    before = run(llm, PROMPTS[:1], [6], [first])
    manager = llm.engine.lora
    assert llm.engine.read_lora(first) is manager.loaded[first.key]  # held: no second read
    assert first.key in manager.slots
    reads = manager.counters.num_reads
    assert run(llm, PROMPTS[:1], [6], [first]) == before  # held and in its slot: the same tokens
    assert manager.counters.num_reads == reads
