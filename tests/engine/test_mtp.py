"""MTP speculative decoding (issue 55): a Qwen3.5 / Qwen3-Next checkpoint's own multi-token-prediction layers
draft from the target's hidden states (``spec_decode/mtp.py``). Their drafts, a ``k > 1`` chain included, equal
vLLM's formula computed with HF's own decoder layer; greedy tokens with them equal those without, under the
stress settings with prefix caching; every block of both caches comes back."""

from __future__ import annotations

import json

import pytest
import torch
from models import STRESS_ENGINE_ARGS, add_mtp_layers, assert_same_greedy, make_random_model
from safetensors.torch import load_file
from spec_drafts import greedy_runs, soak, spec_prompts

from cb_serve import LLM

MTP = {"method": "mtp", "num_speculative_tokens": 3, "adaptive": False}


@pytest.fixture(scope="module")
def mtp_model_dir(tmp_path_factory, tokenizer):
    made = {}

    def make(arch: str, certain: bool = False):
        """``certain``: the target's and the MTP's final norms zeroed ((1 + w) with w = -1), so both always pick
        token 0: every draft is accepted."""
        if (arch, certain) not in made:
            d = add_mtp_layers(make_random_model(tmp_path_factory.mktemp(f"{arch}_mtp"), arch, tokenizer))
            if certain:
                from safetensors.torch import save_file

                state = load_file(d / "model.safetensors")
                for name in ("model.norm.weight", "mtp.norm.weight"):
                    state[name] = -torch.ones_like(state[name])
                save_file(state, d / "model.safetensors", metadata={"format": "pt"})
            made[arch, certain] = d
        return made[arch, certain]

    return make


class ReferenceMtp:
    """vLLM's MTP formula with HF's modules: ``fc([norm_e(embed(t[p + 1])) | norm_h(h[p])])``, HF's decoder layer
    (causal, RoPE at ``p``), the MTP norm, the target's LM head; the target's ``h`` from HF's model (its normed
    last hidden state); a chain's later rows take the previous row's output as ``h``."""

    def __init__(self, model_dir) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        config = self.model.config
        config._attn_implementation = "eager"
        state = load_file(model_dir / "model.safetensors")
        layer_idx = config.layer_types.index("full_attention")
        self.layer = hf.Qwen3_5DecoderLayer(config, layer_idx).eval()
        prefix = "mtp.layers.0."
        self.layer.load_state_dict({k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)})
        self.fc = torch.nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.fc.weight.data = state["mtp.fc.weight"]
        self.norms = {}
        for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            norm = hf.Qwen3_5RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            norm.weight.data = state[f"mtp.{name}.weight"]
            self.norms[name] = norm

    @torch.no_grad()
    def drafts(self, tokens: list[int], k: int) -> list[tuple[int, torch.Tensor]]:
        """The chain of ``k`` drafts after ``tokens`` (the target has computed all but the last), each with its
        logits."""
        m = self.model
        ids = torch.tensor(tokens)
        target = m.model(input_ids=ids[None]).last_hidden_state[0][:-1]  # rows 0 .. P
        inputs, hidden, out = list(tokens[1:]), [target[i] for i in range(len(target))], []
        for _ in range(k):
            e = self.norms["pre_fc_norm_embedding"](m.model.embed_tokens(torch.tensor(inputs)))
            x = self.fc(torch.cat([e, self.norms["pre_fc_norm_hidden"](torch.stack(hidden))], dim=-1))[None]
            n = x.shape[1]
            positions = torch.arange(n).view(1, 1, -1).expand(3, 1, -1)
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            rope = m.model.rotary_emb(x, positions)
            y = self.layer(x, position_embeddings=rope, attention_mask=mask, position_ids=torch.arange(n)[None])
            y = self.norms["norm"](y[0] if isinstance(y, tuple) else y)[0]
            logits = m.lm_head(y[-1])
            draft = int(logits.argmax())
            out.append((draft, logits))
            inputs.append(draft)
            hidden.append(y[-1])
        return out


def test_mtp_drafts_equal_the_reference_chain(mtp_model_dir, tokenizer):
    """Every draft chain of the engine's first steps (prefill catch-up, then chains of 3 over the MTP's own cache)
    is the reference's, up to a near-tie of its logits."""
    model = mtp_model_dir("qwen3_5_text")
    llm = LLM(str(model), speculative_config=MTP, max_model_len=256)
    proposer = llm.engine.speculator.proposer
    seen = []
    propose = proposer.propose

    def recording(seqs, num_drafts):
        drafts = propose(seqs, num_drafts)
        seen.extend((list(s.token_ids), d) for s, d in zip(seqs, drafts) if d)
        return drafts

    proposer.propose = recording
    try:
        greedy_runs(llm, spec_prompts(tokenizer)[:2], max_tokens=6)
        assert len(seen) >= 8, seen
        ref, same = ReferenceMtp(model), 0
        for tokens, drafts in seen[::3]:
            expected = ref.drafts(tokens, len(drafts))
            for j, (ours, (theirs, logits)) in enumerate(zip(drafts, expected)):
                if ours != theirs:
                    gap = float(logits.max() - logits[ours])
                    assert gap < 1e-3, f"draft {j} after {len(tokens)} tokens: {ours} against {theirs} (gap {gap})"
                    break  # the chain goes on from another token
                same += 1
        assert same >= 2 * len(seen[::3]), same  # chains compared, not only first drafts
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("arch, certain", [("qwen3_5_text", False), ("qwen3_next", False), ("qwen3_5_text", True)],
                         ids=["qwen3_5_text", "qwen3_next", "qwen3_5_text-all-accepted"])  # fmt: skip
def test_mtp_greedy_equals_greedy_without(arch, certain, mtp_model_dir, tokenizer):
    """Under chunked prefill, preemption and prefix hits (checked): the same greedy tokens; drafts rejected (random
    MTP layers) or all accepted (both heads certain of token 0); every block of both caches comes back."""
    model = str(mtp_model_dir(arch, certain))
    prompts = spec_prompts(tokenizer)
    ref_llm = LLM(model, **STRESS_ENGINE_ARGS)
    ref, _ = greedy_runs(ref_llm, prompts)
    ref_llm.engine.shutdown()
    llm = LLM(model, speculative_config=MTP, **STRESS_ENGINE_ARGS)
    try:
        ours, _ = greedy_runs(llm, prompts)
        assert_same_greedy(ours, ref, f"{arch} with MTP drafts")
        counters, stats = llm.engine.speculator.counters, llm.engine.get_stats()
        assert counters.num_draft_tokens > 0, counters
        if certain:
            assert counters.num_accepted_tokens == counters.num_draft_tokens, counters
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
        proposer = llm.engine.speculator.proposer
        assert stats.kv_blocks_used == 0 and proposer.blocks.num_used_blocks == 0 and not proposer.shadows
    finally:
        llm.engine.shutdown()


def test_mtp_needs_the_layers_and_one_rank(random_model_dir, mtp_model_dir):
    with pytest.raises(ValueError, match="MTP layers"):
        LLM(str(random_model_dir("qwen3_5_text")), speculative_config=MTP, max_model_len=128)
    with pytest.raises(ValueError, match="one rank"):
        LLM(str(mtp_model_dir("qwen3_5_text")), speculative_config=MTP, max_model_len=128, tensor_parallel_size=2)
    config = json.loads((mtp_model_dir("qwen3_5_text") / "config.json").read_text())
    assert config["mtp_num_hidden_layers"] == 1


def test_mtp_soak_with_aborts_returns_both_caches(mtp_model_dir, tokenizer):
    """The soak of ``test_hybrid_spec_decode`` with MTP drafts on Qwen3-Next (its MoE MTP layer): every block of
    the target's cache and of the MTP's comes back, and no shadow is left."""
    model = str(mtp_model_dir("qwen3_next"))
    prompts = spec_prompts(tokenizer)[:4]
    ref_llm = LLM(model, **STRESS_ENGINE_ARGS)
    ref, _ = greedy_runs(ref_llm, prompts, max_tokens=48)
    ref_llm.engine.shutdown()
    llm = LLM(model, speculative_config=MTP, **STRESS_ENGINE_ARGS)
    try:
        soak(llm.engine, prompts, ref, 48, rounds=2)
        proposer = llm.engine.speculator.proposer
        assert llm.engine.speculator.counters.num_draft_tokens > 0
        assert proposer.blocks.num_used_blocks == 0 and not proposer.shadows
    finally:
        llm.engine.shutdown()
