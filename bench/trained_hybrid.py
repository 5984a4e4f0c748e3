"""A tiny Qwen3.5 that has learned something, for the speculation item of ``bench/hybrid_bench.py`` (issue 55).

Drafts are accepted only where the target's next tokens can be foreseen, which a random-weight model's never can
(its n-gram drafts find nothing, and an MTP head trained on its output does not generalize). So this trains one:
Qwen3.5's layer pattern (three Gated DeltaNet layers to one gated-attention layer, partial RoPE) at a tiny width,
**with one MTP layer trained beside it** as Qwen3.5 ships one (vLLM's formula: ``fc([norm(embed(t[p + 1])) |
norm(h[p])])``, one decoder layer, its norm, the shared LM head, predicting ``t[p + 2]``), on text every machine
here has: the Python standard library's own sources. A few minutes on 2 cores; cached by its settings (the cache
beside the benchmark's other models). The model is weak: its greedy text falls into repeats, which n-gram drafts
follow; the MTP head has learned the same text and drafts from the target's hidden state.

The checkpoint is HF's ``save_pretrained`` of ``Qwen3_5ForCausalLM`` with the ``mtp.*`` tensors added and
``mtp_num_hidden_layers: 1``, as the published Qwen3.5 checkpoints carry them (HF ignores them at load).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sysconfig
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from cb_serve.benchmarks.report import log

SETTINGS = {
    "hidden_size": 256,
    "layers": 4,  # L L L F
    "heads": 4,
    "kv_heads": 2,
    "head_dim": 64,
    "intermediate_size": 768,
    "steps": 500,
    "batch": 8,
    "seq_len": 128,
    "lr": 3e-3,
    "mtp_loss_weight": 0.5,
    "seed": 0,
}


def stdlib_files() -> list[Path]:
    """The standard library's top-level modules, in a fixed order: the training text (all but every tenth file) and
    the held-out text (every tenth)."""
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def token_stream(tokenizer, files: list[Path], limit: int) -> torch.Tensor:
    ids: list[int] = []
    for path in files:
        ids += tokenizer.encode(path.read_text(errors="replace"))
        if len(ids) >= limit:
            break
    return torch.tensor(ids[:limit])


def held_out_prompt(tokenizer, length: int) -> list[int]:
    """``length`` tokens of held-out source (a file the model never trained on)."""
    held = [p for i, p in enumerate(stdlib_files()) if i % 10 == 0]
    return token_stream(tokenizer, held, 50 * length)[-length:].tolist()


def qwen3_5_config(tokenizer) -> Any:
    from transformers import Qwen3_5TextConfig

    s = SETTINGS
    return Qwen3_5TextConfig(
        hidden_size=s["hidden_size"],
        num_hidden_layers=s["layers"],
        layer_types=["linear_attention"] * (s["layers"] - 1) + ["full_attention"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        head_dim=s["head_dim"],
        linear_num_key_heads=s["heads"],
        linear_num_value_heads=s["heads"],
        linear_key_head_dim=s["head_dim"],
        linear_value_head_dim=s["head_dim"],
        linear_conv_kernel_dim=4,
        intermediate_size=s["intermediate_size"],
        vocab_size=len(tokenizer),
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


class MtpHead(torch.nn.Module):
    """Qwen3.5's MTP layer, from HF's own modules."""

    def __init__(self, config) -> None:
        from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

        super().__init__()
        size = config.hidden_size
        self.fc = torch.nn.Linear(2 * size, size, bias=False)
        self.pre_fc_norm_embedding = hf.Qwen3_5RMSNorm(size, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = hf.Qwen3_5RMSNorm(size, eps=config.rms_norm_eps)
        self.layers = torch.nn.ModuleList([hf.Qwen3_5DecoderLayer(config, config.layer_types.index("full_attention"))])
        self.norm = hf.Qwen3_5RMSNorm(size, eps=config.rms_norm_eps)

    def forward(self, model, next_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Logits for ``t[p + 2]`` from ``t[p + 1]`` (``next_ids``) and the target's normed ``h[p]``."""
        e = self.pre_fc_norm_embedding(model.model.embed_tokens(next_ids))
        x = self.fc(torch.cat([e, self.pre_fc_norm_hidden(hidden)], dim=-1))
        batch, n = x.shape[:2]
        positions = torch.arange(n).view(1, 1, -1).expand(3, batch, -1)
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        rope = model.model.rotary_emb(x, positions)
        y = self.layers[0](x, position_embeddings=rope, attention_mask=mask, position_ids=positions[0])
        return model.lm_head(self.norm(y[0] if isinstance(y, tuple) else y))


def train(directory: Path, tokenizer) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    s = SETTINGS
    torch.manual_seed(s["seed"])
    config = qwen3_5_config(tokenizer)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    mtp = MtpHead(config)
    train_files = [p for i, p in enumerate(stdlib_files()) if i % 10 != 0]
    data = token_stream(tokenizer, train_files, s["steps"] * s["batch"] * s["seq_len"])
    params = [*model.parameters(), *mtp.parameters()]
    optimizer = torch.optim.AdamW(params, lr=s["lr"], betas=(0.9, 0.95), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=s["lr"], total_steps=s["steps"], pct_start=0.1)
    gen = torch.Generator().manual_seed(s["seed"])
    start, losses = time.perf_counter(), []
    for step in range(s["steps"]):
        starts = torch.randint(0, len(data) - s["seq_len"] - 1, (s["batch"],), generator=gen)
        ids = torch.stack([data[i : i + s["seq_len"]] for i in starts.tolist()])
        out = model.model(input_ids=ids)
        hidden = out.last_hidden_state
        logits = model.lm_head(hidden)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        mtp_logits = mtp(model, ids[:, 1:-1], hidden[:, :-2])
        mtp_loss = F.cross_entropy(mtp_logits.flatten(0, 1), ids[:, 2:].flatten())
        optimizer.zero_grad()
        (loss + s["mtp_loss_weight"] * mtp_loss).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        losses.append((float(loss), float(mtp_loss)))
        if step % 50 == 0 or step == s["steps"] - 1:
            log(f"trained hybrid: step {step}, loss {loss:.2f}, MTP loss {mtp_loss:.2f}")
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    _add_mtp(directory, mtp)
    return {"train_s": time.perf_counter() - start, "loss": losses[-1][0], "mtp_loss": losses[-1][1]}


def _add_mtp(directory: Path, mtp: MtpHead) -> None:
    from safetensors.torch import load_file, save_file

    path = directory / "model.safetensors"
    state = load_file(path)
    state.update({f"mtp.{name}": t.detach().contiguous() for name, t in mtp.state_dict().items()})
    save_file(state, path, metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["mtp_num_hidden_layers"] = 1
    (directory / "config.json").write_text(json.dumps(config, indent=2))


def trained_hybrid(cache_dir: Path, tokenizer) -> Path:
    """The trained checkpoint's directory (trained once per settings)."""
    key = hashlib.sha256(json.dumps([SETTINGS, len(tokenizer)], sort_keys=True).encode()).hexdigest()[:12]
    directory = cache_dir / f"trained-{key}"
    if (directory / "config.json").is_file():
        return directory
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    stats = train(tmp, tokenizer)
    (tmp / "training.json").write_text(json.dumps({"settings": SETTINGS, **stats}, indent=2))
    tmp.rename(directory)
    return directory
