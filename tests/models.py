"""Small random-weight models (Llama, Qwen2, Mistral, Qwen3 shapes) saved as real HF model
directories, LoRA adapters of them made by PEFT, and the HF transformers oracle for greedy decoding."""

from __future__ import annotations

import json
from pathlib import Path

import torch

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    initializer_range=0.2,
    tie_word_embeddings=False,
)


HYBRID = dict(  # Qwen3.5 / Qwen3-Next: linear, full, linear attention; key and value head sizes differ
    num_hidden_layers=3,
    head_dim=16,
    layer_types=["linear_attention", "full_attention", "linear_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
    initializer_range=0.1,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
)


# Each tiny architecture the engine serves: its transformers config class and what it adds to
# ``TINY``. A new model family is one entry here; the exactness harness (``exactness.py``,
# ``tests/engine/test_hf_equivalence.py``) then checks it against HF under every scheduling setting.
ARCHS: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", {"rope_theta": 10000.0}),
    "qwen2": ("Qwen2Config", {}),
    "mistral": ("MistralConfig", {"sliding_window": 48, "head_dim": 16}),  # a window shorter than long prompts
    # q/k norms per head; layer 0 global, layer 1 a sliding window (``layer_types``)
    "qwen3": (
        "Qwen3Config",
        {"head_dim": 16, "use_sliding_window": True, "sliding_window": 40, "max_window_layers": 1},
    ),
    # (1 + w) norms, four per layer, q/k norms, scaled embedding, GELU-tanh, its own score scale; a
    # sliding layer then a global one, each with its own RoPE table
    "gemma3_text": (
        "Gemma3TextConfig",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            "sliding_window": 40,
            "layer_types": ["sliding_attention", "full_attention"],  # RoPE theta 10k and 1M (its defaults)
        },
    ),
    # Gemma 3's layer without q/k norms, one RoPE table, and soft-caps low enough to bite on random
    # weights: attention scores (|s| median ~5, max ~40 here) capped at 5, logits (std ~3, max ~13) at 8
    "gemma2": (
        "Gemma2Config",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            "sliding_window": 40,
            "layer_types": ["sliding_attention", "full_attention"],
            "attn_logit_softcapping": 5.0,
            "final_logit_softcapping": 8.0,
        },
    ),
    # Gemma 4: sliding (head 16, 2 KV heads) and global layers (head 32, 1 KV head: pages of equal width,
    # proportional RoPE turning 4 of 16 pairs, V = the K projection), the last two layers reading layers 2's
    # and 3's KV cache with a double-wide MLP, per-layer inputs (8 per layer), random layer scalars, a soft-cap
    "gemma4_text": (
        "Gemma4TextConfig",
        {
            "num_hidden_layers": 6,
            "head_dim": 16,
            "global_head_dim": 32,
            "num_global_key_value_heads": 1,
            "attention_k_eq_v": True,
            "sliding_window": 40,
            "layer_types": ["sliding_attention", "full_attention"] * 3,
            "num_kv_shared_layers": 2,
            "use_double_wide_mlp": True,
            "hidden_size_per_layer_input": 8,
            "vocab_size_per_layer_input": "vocab_size",  # one row per token (``tiny_config``)
            "final_logit_softcapping": 8.0,
        },
    ),
    # Gemma 4's MoE block beside the dense MLP (router with its own norm, input scale and per-expert scales)
    "gemma4_moe": (
        "Gemma4TextConfig",
        {
            "head_dim": 16,
            "global_head_dim": 32,
            "num_global_key_value_heads": 1,
            "attention_k_eq_v": True,  # (global layers take num_global_key_value_heads only with it)
            "sliding_window": 40,
            "layer_types": ["sliding_attention", "full_attention"],
            "hidden_size_per_layer_input": 0,
            "enable_moe_block": True,
            "num_experts": 8,
            "top_k_experts": 2,
            "moe_intermediate_size": 32,
        },
    ),
    # post-norms only, q/k norms over all heads' width
    "olmo2": ("Olmo2Config", {}),
    # no RoPE on every 2nd layer (NoPE), those layers sliding, biases on the attention projections
    "smollm3": (
        "SmolLM3Config",
        {
            "num_hidden_layers": 4,
            "no_rope_layer_interval": 2,
            "use_sliding_window": True,
            "sliding_window": 48,
            "attention_bias": True,
            "pad_token_id": None,  # (its default is past the tiny vocabulary: HF's embedding would refuse it)
        },
    ),
    # the four multipliers: embedding, residual, score scale, logits
    "granite": (
        "GraniteConfig",
        {"embedding_multiplier": 3.0, "residual_multiplier": 0.5, "attention_multiplier": 0.2, "logits_scaling": 4.0},
    ),
    # mixtures of experts (8 experts, top 2, each expert narrower than the dense MLP where the config has both)
    "mixtral": ("MixtralConfig", {"num_local_experts": 8, "num_experts_per_tok": 2, "head_dim": 16}),
    # a dense layer between two sparse ones (``mlp_only_layers``), the top 2 renormalized
    # Hybrid models: Gated DeltaNet layers (a state slot per sequence) between full-attention ones. A smaller
    # init than TINY's: HF's own chunked delta rule drifts ~1e-3 in float32 on large random weights.
    "qwen3_5_text": ("Qwen3_5TextConfig", {**HYBRID}),
    "qwen3_next": (
        "Qwen3NextConfig",
        {
            **HYBRID,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
            "mlp_only_layers": [1],
            "decoder_sparse_step": 1,
            "norm_topk_prob": True,
        },
    ),
    # every layer sparse, the top k always renormalized (no such config fields)
    "qwen3_5_moe_text": (
        "Qwen3_5MoeTextConfig",
        {
            **HYBRID,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
        },
    ),  # fmt: skip
    # Mamba2 layers (groups of heads sharing B and C, conv bias) around one attention layer, Granite's
    # multipliers, experts plus a shared MLP; scan chunks of 16 so chunked prefill splits them
    "granitemoehybrid": (
        "GraniteMoeHybridConfig",
        {
            "num_hidden_layers": 3,
            "layer_types": ["mamba", "attention", "mamba"],
            "intermediate_size": 32,
            "shared_intermediate_size": 48,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "mamba_n_heads": 8,
            "mamba_n_groups": 2,
            "mamba_d_state": 16,
            "mamba_d_head": 16,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
            "mamba_chunk_size": 16,
            "position_embedding_type": "rope",
            "embedding_multiplier": 2.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 0.25,
            "logits_scaling": 4.0,
            "initializer_range": 0.1,
        },
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {
            "num_hidden_layers": 3,
            "head_dim": 16,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "mlp_only_layers": [1],
            "norm_topk_prob": True,
        },
    ),
    # a shared expert beside the routed ones, gated per token; q/k/v biases
    "qwen2_moe": (
        "Qwen2MoeConfig",
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
        },
    ),
    # full-width q/k norms and a clip that bites (layer 0's |q|, |k|, |v| reach 3.5, 3.3, 5.3 here), the top 2
    # not renormalized
    "olmoe": ("OlmoeConfig", {"num_experts": 8, "num_experts_per_tok": 2, "clip_qkv": 2.0}),
    # sinks, a sliding layer then a global one, YaRN (its default: factor 32 from 4096), biased experts with
    # the clamped SwiGLU, a router with a bias taking the top 2 logits
    "gpt_oss": (
        "GptOssConfig",
        {
            "head_dim": 16,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "sliding_window": 40,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    # fused qkv / gate_up weights, partial rotary (8 of 16 dims) and LongRoPE: the harness's sequences
    # (at most 324 tokens) stay within the original 330 positions, where HF and the engine both use
    # the short factors (and LongRoPE's attention factor, from 1024 / 330); tests/features/test_phi3.py
    # covers the long factors and a sliding window
    "phi3": (
        "Phi3Config",
        {
            "head_dim": 16,
            "original_max_position_embeddings": 330,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
                "short_factor": [1.0, 1.3, 1.7, 2.2],
                "long_factor": [1.5, 2.5, 4.0, 6.0],
                "original_max_position_embeddings": 330,
            },
        },
    ),
}


def transformers_before(major: int, minor: int) -> bool:
    import transformers

    return tuple(int(x) for x in transformers.__version__.split(".")[:2]) < (major, minor)


def tiny_config(arch: str, vocab_size: int, **overrides):
    import transformers

    if arch not in ARCHS:
        raise ValueError(arch)
    config_class, extra = ARCHS[arch]
    if arch == "granitemoehybrid" and transformers_before(5, 23):
        # Before 5.23 transformers normalized Mamba2's gated RMSNorm over all groups at once (the engine, and
        # transformers since, normalize each group): with one group both agree
        extra = {**extra, "mamba_n_groups": 1}
    kwargs = {**TINY, **extra, **overrides}
    kwargs = {k: vocab_size if v == "vocab_size" else v for k, v in kwargs.items()}
    return getattr(transformers, config_class)(vocab_size=vocab_size, **kwargs)


def make_random_model(directory: Path, arch: str, tokenizer, seed: int = 0, **config_overrides) -> Path:
    """Saves a random-weight ``arch`` model plus ``tokenizer`` into ``directory``
    (``config_overrides``: e.g. ``max_position_embeddings`` for a longer context)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(arch, len(tokenizer), **config_overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # non-trivial norms and biases, so those code paths are exercised
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            elif name.endswith("scale"):  # Gemma 4's router: input and per-expert scales
                p.copy_(0.5 + torch.rand_like(p))
        for name, b in model.named_buffers():  # Gemma 4's per-layer output scale
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand_like(b))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def add_mtp_layers(directory: Path, num_layers: int = 1, seed: int = 0) -> Path:
    """Gives a random Qwen3.5 / Qwen3-Next checkpoint MTP layers (``mtp.*``, as the real checkpoints ship them and
    HF ignores at load): each a copy of the first full-attention layer's attention and norms and of a sparse layer's
    feed-forward under ``mtp.layers.{j}.``, made different with noise, plus ``fc`` and the three norms; the config's
    ``mtp_num_hidden_layers`` set."""
    from safetensors.torch import load_file, save_file

    config = json.loads((directory / "config.json").read_text())
    layer = config["layer_types"].index("full_attention")
    dense = config.get("mlp_only_layers", [])  # Qwen3-Next: the MTP layer has experts, as its sparse layers
    sparse = next((i for i in range(len(config["layer_types"])) if i not in dense), layer) if dense else layer
    path = directory / "model.safetensors"
    state = load_file(path)
    gen = torch.Generator().manual_seed(seed)
    for j in range(num_layers):
        for name, t in list(state.items()):
            for i, parts in (
                (layer, ("self_attn.", "input_layernorm.", "post_attention_layernorm.")),
                (sparse, ("mlp.",)),
            ):
                rest = name.removeprefix(f"model.layers.{i}.")
                if rest != name and rest.startswith(parts):
                    state[f"mtp.layers.{j}.{rest}"] = t + 0.02 * torch.randn(t.shape, generator=gen)
    hidden = config["hidden_size"]
    state["mtp.fc.weight"] = 0.05 * torch.randn(hidden, 2 * hidden, generator=gen)
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        state[f"mtp.{name}.weight"] = 0.1 * torch.randn(hidden, generator=gen)
    save_file(state, path, metadata={"format": "pt"})
    config["mtp_num_hidden_layers"] = num_layers
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Architectures whose checkpoints fuse projections (Phi-3): the module an adapter targets instead.
FUSED_TARGETS = {
    "phi3": {
        "q_proj": "qkv_proj",
        "k_proj": "qkv_proj",
        "v_proj": "qkv_proj",
        "gate_proj": "gate_up_proj",
        "up_proj": "gate_up_proj",
    }
}


def make_adapter(model_dir: Path, out: Path, rank: int, seed: int, targets=LORA_TARGETS, **lora_kwargs) -> Path:
    """A PEFT LoRA adapter of ``model_dir`` with random A and non-zero random B."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    fused = FUSED_TARGETS.get(base.config.model_type, {})
    targets = list(dict.fromkeys(fused.get(t, t) for t in targets))
    torch.manual_seed(seed)
    kwargs = dict(r=rank, lora_alpha=2 * rank, target_modules=targets, lora_dropout=0.0, init_lora_weights=False)
    get_peft_model(base, LoraConfig(**{**kwargs, **lora_kwargs})).save_pretrained(out)
    return out


def hf_greedy(
    model_dir, prompts: list[list[int]], max_tokens: list[int], stop_at_eos: bool = False, logits_processor=None
):
    """Greedy continuations from HF ``model.generate`` (float32, one prompt at a time, no
    padding), with the logits of every step for the top-2 tie rule. ``logits_processor``:
    HF logits processors, for one prompt at a time."""
    from transformers import AutoModelForCausalLM

    if isinstance(model_dir, (str, Path)):
        from transformers import AutoConfig

        # Attention soft-capping (Gemma 2) is eager-only; transformers before 5.21 took SDPA and dropped it
        softcap = getattr(AutoConfig.from_pretrained(model_dir), "attn_logit_softcapping", None)
        kwargs = {"attn_implementation": "eager"} if softcap else {}
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kwargs)
    else:
        model = model_dir
    model.eval()
    if not stop_at_eos:
        model.generation_config.eos_token_id = None
    results = []
    for ids, m in zip(prompts, max_tokens):
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=m,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
                logits_processor=logits_processor,
            )
        results.append((out.sequences[0, len(ids) :].tolist(), torch.stack(out.logits)[:, 0]))
    return results


def assert_greedy_match(
    ours: list[int], ref: list[int], ref_logits: torch.Tensor, context: str = "", tie_tolerance: float = 1e-3
) -> bool:
    """Token-exact match, except: where the reference's top-2 logits are within rounding
    (``tie_tolerance``), a divergence is accepted if our token is the reference's
    second choice; the sequences then legitimately differ, so comparison stops there.
    Returns True if the outputs were identical."""
    for t, (a, b) in enumerate(zip(ours, ref)):
        if a == b:
            continue
        top = ref_logits[t].topk(2)
        gap = float(top.values[0] - top.values[1])
        assert a in top.indices.tolist() and gap <= tie_tolerance, (
            f"{context}: token {t} differs (ours {a}, HF {b}); HF top-2 {top.indices.tolist()} "
            f"with logit gap {gap:.2e} > tolerance {tie_tolerance}"
        )
        return False
    assert len(ours) == len(ref), f"{context}: {len(ours)} tokens, HF {len(ref)}"
    return True


# Engine settings that force chunked prefill (budget < longest prompt), preemption (few
# blocks) and keep block-size edge cases (prompt lengths that are not multiples of 16).
STRESS_ENGINE_ARGS = dict(
    block_size=16, max_num_batched_tokens=64, num_gpu_blocks=40, max_model_len=400, max_num_seqs=8
)
# Architectures whose every layer has a sliding window hold only a window's blocks per sequence
# (``kv_cache_interface``): a smaller pool still makes the stress workload preempt.
STRESS_BLOCKS = {"mistral": 16}


def stress_engine_args(arch: str) -> dict:
    """``STRESS_ENGINE_ARGS`` with a KV pool that makes ``arch`` preempt."""
    return {**STRESS_ENGINE_ARGS, "num_gpu_blocks": STRESS_BLOCKS.get(arch, STRESS_ENGINE_ARGS["num_gpu_blocks"])}


LOGPROB_ATOL = 1e-3  # float32 reduction-order differences (another GEMM kernel or split, an all-reduce)
TOP_TWO_TIE = 1e-3  # a greedy pick may differ only where the reference's top two log-probabilities are this close


def assert_same_greedy(ours, ref, context: str, tie: float = TOP_TWO_TIE, atol: float = LOGPROB_ATOL) -> None:
    """``[(token_ids, logprobs)]`` of two greedy runs (logprobs >= 2 asked for): equal tokens, where a
    pick may differ only at a near-tie of the reference (top two within ``tie``: comparison stops
    there), and log-probabilities within ``atol`` (the defaults: for runs whose float32 sums differ
    only in order)."""
    for i, ((tokens, logprobs), (ref_tokens, ref_logprobs)) in enumerate(zip(ours, ref)):
        for t, (a, b) in enumerate(zip(tokens, ref_tokens)):
            top = sorted(ref_logprobs[t].values(), key=lambda lp: -lp.logprob)
            if a != b:
                assert top[0].logprob - top[1].logprob < tie, f"{context} prompt {i}: token {t} differs"
                break
            for token_id, lp in ref_logprobs[t].items():
                if token_id in logprobs[t]:
                    diff = abs(logprobs[t][token_id].logprob - lp.logprob)
                    assert diff <= atol, f"{context} prompt {i} token {t}: logprob off by {diff:.2e}"
        else:
            assert len(tokens) == len(ref_tokens), context


def hf_rotary(config):
    """HF's own rotary module for ``config`` (None without RoPE), built without the model's weights."""
    from transformers import AutoModel, AutoModelForCausalLM

    with torch.device("meta"):
        try:
            skeleton = AutoModelForCausalLM.from_config(config).model
        except ValueError:  # a text model transformers has no *ForCausalLM for (Qwen3-VL's)
            skeleton = AutoModel.from_config(config)
    return None if skeleton.rotary_emb is None else type(skeleton.rotary_emb)(config=config)


def hf_rope_tables(config, max_positions: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The reference for ``layers/rope_tables.py``: HF's rotary module asked for each layer type's table as
    the newest token at each position sees it (LongRoPE: short factors below
    ``original_max_position_embeddings``, long ones from it on), widened to rotate-half's tables where HF's
    cover half the dims (gpt-oss), narrower ones zero-padded; None without RoPE."""
    rotary = hf_rotary(config)
    if rotary is None:
        return None
    x, positions = torch.zeros(1), torch.arange(max_positions)[None]
    if hasattr(rotary, "mrope_section"):  # M-RoPE: a text token's three positions (``[3, batch, positions]``)
        positions = positions[None].expand(3, 1, -1)
    layer_types = sorted(set(config.layer_types)) if isinstance(rotary.rope_type, dict) else [None]
    tables = []
    for kind in layer_types:
        args = () if kind is None else (kind,)
        cos, sin = (y[0].float() for y in rotary(x, positions, *args))
        params = config.rope_parameters if kind is None else config.rope_parameters[kind]
        short = params.get("original_max_position_embeddings") if params.get("rope_type") == "longrope" else None
        if short and short < max_positions:  # HF took the long factors for all of them
            cos[:short], sin[:short] = (y[0].float() for y in rotary(x, positions[..., :short], *args))
        if config.model_type == "gpt_oss":
            cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
        tables.append((cos, sin))
    width = max(cos.shape[-1] for cos, _ in tables)
    pad = lambda ys: torch.stack([torch.nn.functional.pad(y, (0, width - y.shape[-1])) for y in ys])  # noqa: E731
    return pad([cos for cos, _ in tables]), pad([sin for _, sin in tables])


def greedy_outputs(model_dir, prompts: list[list[int]], params, **engine_args) -> list[tuple[list[int], list[dict]]]:
    """``[(token_ids, logprobs)]`` of one engine over ``prompts`` (the stress settings plus ``engine_args``), the
    engine shut down after: what ``assert_same_greedy`` compares."""
    from cb_serve import LLM

    llm = LLM(str(model_dir), **STRESS_ENGINE_ARGS, **engine_args)
    try:
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.engine.shutdown()
