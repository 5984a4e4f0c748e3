"""The DRAM bandwidth bound of decode steps: how close each decode-only engine step came to reading its
bytes at the machine's DRAM read bandwidth.

- ``read_bandwidth`` measures that bandwidth: a large float32 tensor read by read-only reductions with
  all torch threads, best of several repeats of each method.
- A decode step reads (``step_bytes``) every weight layout its ``Linear`` forwards stream at its batch
  size (``Linear.bytes_read(rows)``; the LM head sees the rows that need logits), the embedding rows of
  its tokens, the norms' weights, and each sequence's KV cache over its context. Activations, the new
  K/V written, RoPE table rows and the sampler's logits are left out (small next to those at decode).
- ``decode_steps`` joins the engine's ``StepStats`` of decode-only steps (no prefill tokens) with the
  batch inspector's step records (``LLMEngine.inspect("steps")``), which hold each scheduled sequence's
  computed tokens after the step: the KV positions its attention read.
- ``decode_bound`` reports the fraction (bytes / step seconds) / read bandwidth over those steps.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cb_serve import StepStats
from cb_serve.benchmarks.report import log
from cb_serve.model_executor.layers.embedding import VocabParallelEmbedding
from cb_serve.model_executor.layers.linear import Linear
from cb_serve.model_executor.layers.moe import FusedMoE
from cb_serve.stats import ExpertLoad

READ_BYTES = 1 << 30
READ_REPS = 5
# Read-only ways to stream a tensor once (``x``: the flat float32 tensor); the best rate counts.
READ_METHODS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "torch.sum": torch.sum,
    "torch.amax": torch.amax,
    "torch.dot(x, x)": lambda x: torch.dot(x, x),
}


def read_bandwidth(num_bytes: int = READ_BYTES, reps: int = READ_REPS) -> dict[str, Any]:
    """DRAM read bandwidth in GB/s: a ``num_bytes`` float32 tensor read by each of ``READ_METHODS``
    ``reps`` times after one untimed read, the best rate of each method; ``gb_s`` and ``method``: the best."""
    x = torch.ones(num_bytes // 4, dtype=torch.float32)
    per_method: dict[str, float] = {}
    for name, read in READ_METHODS.items():
        read(x)
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            read(x)
            best = min(best, time.perf_counter() - t0)
        per_method[name] = x.nbytes / best / 1e9
    method = max(per_method, key=per_method.__getitem__)
    return {
        "gb_s": per_method[method],
        "method": method,
        "per_method_gb_s": per_method,
        "bytes": x.nbytes,
        "reps": reps,
        "threads": torch.get_num_threads(),
    }


@dataclass(frozen=True)
class DecodeStep:
    """One decode-only engine step: its time, rows and each sequence's context."""

    duration_s: float
    num_tokens: int  # rows through the projections
    num_logit_rows: int  # rows through the LM head: the tokens that need logits
    context_lens: tuple[int, ...]  # per sequence: the KV positions its attention read (new token included)
    execute_s: float = 0.0  # of duration_s, the execute phase (forward, logits, sampling); 0: unknown
    experts_hit: tuple[int, ...] = ()  # per MoE layer in model order: distinct experts its tokens went to


def kv_bytes_per_token(hf_config: Any, kv_dtype: torch.dtype) -> int:
    """KV-cache bytes of one token over all layers: K and V of every KV head."""
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    per_token = hf_config.num_hidden_layers * 2 * hf_config.num_key_value_heads * head_dim
    return per_token * torch.empty((), dtype=kv_dtype).element_size()


def experts_hit(load: ExpertLoad | None) -> tuple[int, ...]:
    """Per MoE layer of a step's ``ExpertLoad``: how many experts got at least one token (() if none)."""
    return () if load is None else tuple(int(n) for n in (load.counts > 0).sum(axis=1))


def expert_bytes(module: FusedMoE, hit: int | None) -> int:
    """Bytes of ``module``'s expert weights (and biases; its router is a child module) that a forward
    routing tokens to ``hit`` of its experts reads; all of them when ``hit`` is None."""
    stacked = sum(p.nbytes for p in module.parameters(recurse=False))  # [local experts, ...] each
    local = len(module.experts)
    return stacked if hit is None else stacked * min(hit, local) // local


def weight_bytes(
    model: nn.Module, num_tokens: int, num_logit_rows: int, experts_hit: Sequence[int] | None = None
) -> int:
    """Bytes of weights a forward of ``num_tokens`` rows reads: each ``Linear``'s ``bytes_read`` (the
    model's ``lm_head`` at ``num_logit_rows``), the embedding rows of the tokens, each ``FusedMoE``'s
    experts that ``experts_hit`` names for its layer (None: every expert), every other parameter (norms,
    routers) whole."""
    lm_head = getattr(model, "lm_head", None)
    hits = iter(experts_hit or ())
    total = 0
    for module in model.modules():
        if isinstance(module, Linear):
            total += module.bytes_read(num_logit_rows if module is lm_head else num_tokens)
        elif isinstance(module, VocabParallelEmbedding):
            total += module.bytes_read(num_tokens)
        elif isinstance(module, nn.Embedding):
            total += num_tokens * module.embedding_dim * module.weight.element_size()
        elif isinstance(module, FusedMoE):
            total += expert_bytes(module, next(hits, None) if experts_hit is not None else None)
        else:
            total += sum(p.nbytes for p in module.parameters(recurse=False))
    return total


def step_bytes(model: nn.Module, step: DecodeStep, kv_per_token: int) -> tuple[int, int]:
    """(weight bytes, KV bytes) that ``step`` read (of a mixture of experts: the experts it hit)."""
    weights = weight_bytes(model, step.num_tokens, step.num_logit_rows, step.experts_hit or None)
    return weights, kv_per_token * sum(step.context_lens)


def decode_steps(stats: Sequence[StepStats], records: Sequence[dict[str, Any]], first_step_id: int) -> list[DecodeStep]:
    """The decode-only steps among ``stats`` (consecutive engine steps from ``first_step_id``) that have an
    inspector record (``LLMEngine.inspect("steps")`` dicts) with the same sequences."""
    by_id = {r["step"]: r for r in records}
    steps = []
    for step_id, s in enumerate(stats, start=first_step_id):
        record = by_id.get(step_id)
        if s.num_prefill_tokens or record is None or len(record["seqs"]) != s.num_seqs:
            continue
        contexts = tuple(q["computed_after"] for q in record["seqs"])
        # Every decode row samples (a draft's row too), so the LM head sees them all.
        n = s.num_scheduled_tokens
        steps.append(DecodeStep(s.duration_s, n, n, contexts, s.phases.execute_s, experts_hit(s.expert_load)))
    return steps


def decode_bound(
    model: nn.Module, kv_per_token: int, steps: Sequence[DecodeStep], read_gb_s: float
) -> dict[str, Any] | None:
    """Over ``steps``: median, p10 and p90 of (bytes read / step seconds) / ``read_gb_s``, the median of
    the same over the execute phase alone, and the bytes and time of the step at the median; None without
    steps."""
    if not steps:
        return None
    rows, execute = [], []
    for step in steps:
        weights, kv = step_bytes(model, step, kv_per_token)
        rows.append(((weights + kv) / step.duration_s / (read_gb_s * 1e9), weights, kv, step))
        if step.execute_s > 0:
            execute.append((weights + kv) / step.execute_s / (read_gb_s * 1e9))
    rows.sort(key=lambda row: row[0])
    fractions = [row[0] for row in rows]
    deciles = statistics.quantiles(fractions, n=10, method="inclusive") if len(rows) > 1 else fractions * 9
    fraction, weights, kv, median = rows[len(rows) // 2]
    bound = {
        "decode_steps": len(rows),
        "read_gb_s": read_gb_s,
        "fraction_median": statistics.median(fractions),
        "fraction_p10": deciles[0],
        "fraction_p90": deciles[-1],
        "execute_fraction_median": statistics.median(execute) if execute else None,
        "median_step": {
            "fraction": fraction,
            "weights_mb": weights / 1e6,
            "kv_mb": kv / 1e6,
            "step_ms": median.duration_s * 1e3,
            "execute_ms": median.execute_s * 1e3,
            "num_seqs": len(median.context_lens),
            "mean_context": statistics.fmean(median.context_lens),
            "gb_s": (weights + kv) / median.duration_s / 1e9,
        },
        "counted": "weights streamed per Linear.bytes_read(rows) incl. LM head, embedding rows, norms, routers, "
        "the experts each step's tokens hit; KV of every sequence's context; not activations, K/V writes, RoPE "
        "rows, logits",
    }
    moe = next((m for m in model.modules() if isinstance(m, FusedMoE)), None)
    if moe is not None and median.experts_hit:
        bound["moe"] = moe_summary(model, moe.num_experts, [row[3] for row in rows], median)
    return bound


def moe_summary(model: nn.Module, num_experts: int, steps: Sequence[DecodeStep], median: DecodeStep) -> dict[str, Any]:
    """A mixture of experts' decode steps: experts hit per layer (mean over layers) over the steps and in
    the median step, and that step's weight bytes against what reading every expert would take."""
    hit = [statistics.fmean(s.experts_hit) for s in steps if s.experts_hit]
    rows = (median.num_tokens, median.num_logit_rows)
    return {
        "num_experts": num_experts,
        "mean_experts_hit_per_layer": statistics.fmean(hit),
        "median_step_experts_hit_per_layer": statistics.fmean(median.experts_hit),
        "median_step_active_weights_mb": weight_bytes(model, *rows, median.experts_hit) / 1e6,
        "median_step_all_experts_weights_mb": weight_bytes(model, *rows) / 1e6,
    }


def print_decode_bound(bound: dict[str, Any] | None, decode_only_steps: int) -> None:
    """One line: the fraction of the DRAM read bound over the decode steps, and the median step's bytes."""
    if bound is None:
        log(f"decode DRAM bound: no decode step with an inspector record (of {decode_only_steps} decode-only steps)")
        return
    m, execute = bound["median_step"], bound["execute_fraction_median"]
    log(
        f"decode steps at {bound['fraction_median']:.1%} of the DRAM read bound {bound['read_gb_s']:.1f} GB/s "
        f"(median; p10 {bound['fraction_p10']:.1%}, p90 {bound['fraction_p90']:.1%}; execute phase alone "
        f"{'n/a' if execute is None else f'{execute:.1%}'}; {bound['decode_steps']} of {decode_only_steps} "
        f"decode-only steps); median step: {m['num_seqs']} seqs, {m['weights_mb']:.1f} MB weights + "
        f"{m['kv_mb']:.1f} MB KV in {m['step_ms']:.2f} ms (execute {m['execute_ms']:.2f} ms) = {m['gb_s']:.1f} GB/s"
    )
    moe = bound.get("moe")
    if moe:
        log(
            f"    mixture of experts: the median step's tokens hit {moe['median_step_experts_hit_per_layer']:.1f} of "
            f"{moe['num_experts']} experts per layer (all decode steps: {moe['mean_experts_hit_per_layer']:.1f}): "
            f"{moe['median_step_active_weights_mb']:.1f} MB of active-parameter weights read (every expert: "
            f"{moe['median_step_all_experts_weights_mb']:.1f} MB)"
        )
