"""Where cb-serve's greedy tokens are not HF's, is it a float32 tie?

Runs cb-serve (the engine arguments ``bench/throughput.py`` takes, the same defaults) on the throughput
workload, then HF transformers (float32) teacher-forced on each prompt plus cb-serve's output, one
forward per request, no padding: at every generated position, HF's top logit against the logit of
cb-serve's token. Where cb-serve's token is not HF's argmax, two kinds of tie explain it:

- **logit tie**: HF's top logit and cb-serve's token's within ``--tie`` (float32 summation-order noise, the
  exactness tests' ``TOP_TWO_TIE``);
- **routing tie** (mixture of experts): in some layer, for that token or one before it (whose keys and values
  it reads), the last chosen expert and the next one have router probabilities within ``--routing-tie`` of
  each other (relative), so float32 rounding may pick either, and the layer's output, hence the logits,
  move by far more than rounding.

    .venv/bin/python bench/greedy_ties.py --model <HF directory> --out bench/results/ties.json  # ~3 min
"""

from __future__ import annotations

import argparse
import sys

import throughput
import torch

from cb_serve import LLM, SamplingParams
from cb_serve.benchmarks.hf_baseline import load_hf_model
from cb_serve.benchmarks.report import log, write_json
from cb_serve.benchmarks.workload import make_workload


def routing_gaps(model, ids: list[int]) -> tuple[float, float, int]:
    """Over the MoE layers (``mlp.gate``, top ``num_experts_per_tok``), the relative gap between the router
    probabilities of the k-th and (k+1)-th experts: the last token's least, every token's least and its
    position."""
    gaps: list[torch.Tensor] = []
    k = getattr(model.config, "num_experts_per_tok", 0)

    def hook(module, args, out) -> None:
        logits = out[0] if isinstance(out, tuple) else out
        probs = torch.softmax(logits.reshape(-1, logits.shape[-1]).float(), -1).sort(descending=True).values
        gaps.append((probs[:, k - 1] - probs[:, k]) / probs[:, k - 1])

    gates = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")] if k else []
    handles = [g.register_forward_hook(hook) for g in gates]
    try:
        model(torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    if not gaps:
        return 1.0, 1.0, -1
    least = torch.stack(gaps).min(dim=0).values  # per position
    return float(least[-1]), float(least.min()), int(least.argmin())


def main() -> None:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--tie", type=float, default=1e-3)
    parser.add_argument("--routing-tie", type=float, default=1e-4)
    parser.add_argument("--out")
    ours, rest = parser.parse_known_args()
    args = throughput.parse_args(rest, description=__doc__)
    llm = LLM(**throughput.engine_kwargs(args))
    workload = make_workload(llm.engine.tokenizer, args.num_requests, args.seed)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in workload.output_lens]
    outputs = [list(o.outputs[0].token_ids) for o in llm.generate(workload.prompts, params, use_tqdm=False)]
    source, dtype = llm.engine.source, llm.engine.dtype
    llm.engine.shutdown()
    del llm
    model = load_hf_model(source, dtype)
    rows = []
    with torch.inference_mode():
        for i, (prompt, tokens) in enumerate(zip(workload.prompts, outputs)):
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
            gaps = logits.max(dim=1).values - logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
            at = int(gaps.argmax())
            row = {"request": i, "tokens": len(tokens), "not_argmax": int((gaps > 0).sum()), "max_gap": float(gaps[at])}
            if row["not_argmax"]:
                last, least, where = routing_gaps(model, prompt + tokens[:at])
                row |= {"at": at, "routing_gap": last, "context_routing_gap": least, "context_position": where}
            rows.append(row)
    routing = {r["request"]: min(r.get("routing_gap", 1.0), r.get("context_routing_gap", 1.0)) for r in rows}
    explained = [r for r in rows if r["max_gap"] <= ours.tie or routing[r["request"]] <= ours.routing_tie]
    log(
        f"{len(rows)} requests, {sum(r['tokens'] for r in rows)} tokens; "
        f"{sum(1 for r in rows if r['not_argmax'])} with a token that is not HF's teacher-forced argmax"
    )
    for r in rows:
        if r["not_argmax"]:
            log(
                f"    request {r['request']}: token {r['at']}, logit gap {r['max_gap']:.2e}, routing gap "
                f"{r['routing_gap']:.1e} (context: {r['context_routing_gap']:.1e} at {r['context_position']})"
            )
    log(
        f"all explained by ties (logit <= {ours.tie:g}, routing <= {ours.routing_tie:g}): {len(explained) == len(rows)}"
    )
    write_json(
        ours.out,
        {
            "command": " ".join(sys.argv),
            "tie": ours.tie,
            "routing_tie": ours.routing_tie,
            "rows": rows,
            "all_ties": len(explained) == len(rows),
        },
    )


if __name__ == "__main__":
    main()
