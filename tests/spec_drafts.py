"""Speculative decoding's test helpers: the configurations, prompts drafts get accepted on, greedy runs with
logprobs, and a proposer that drafts a known continuation with a moving wrong draft."""

from __future__ import annotations

import itertools
import random

from cb_serve import SamplingParams
from cb_serve.spec_decode.proposer import DraftProposer

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
FIXED_K = {**NGRAM, "adaptive": False}  # every proposed draft is verified (the policy is tested on its own)


def spec_prompts(tokenizer) -> list[list[int]]:
    """Input-grounded prompts (a passage to repeat, a list to go on) so drafts get accepted, one
    longer than the stress budget (chunked prefill) and two sharing a prefix (prefix hits)."""
    passage = "The quick brown fox jumps over the lazy dog, and the dog sleeps on. " * 3
    texts = [
        f"Repeat exactly: {passage}\nRepeat exactly: The quick brown",
        "Count: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 1, 2, 3, 4,",
        f"Repeat exactly: {passage}\nAgain: The quick",
        "def add(a, b):\n    return a + b\n\ndef add(a, b):",
    ]
    texts += [f"{t} {t[:40]}" for t in texts]  # eight in all: more than the stress cache holds at once
    return [tokenizer.encode(t) for t in texts]


def greedy_runs(llm, prompts, **params):
    params = SamplingParams(**{"temperature": 0, "max_tokens": 96, "logprobs": 2, "ignore_eos": True, **params})
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], outs


class OracleProposer(DraftProposer):
    """Each prompt's reference continuation as drafts, with one draft wrong at a position that moves
    with every call: full, partial and no acceptance all happen (a random-weight model rarely
    repeats itself, so n-gram drafts would seldom be accepted). A prompt it does not know drafts
    nothing."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]]) -> None:
        self.continuations = continuations
        self.calls = itertools.count()

    def propose(self, seqs, num_drafts):
        drafts = []
        for seq, k in zip(seqs, num_drafts):
            future = self.continuations.get(tuple(seq.prompt_token_ids), [])[seq.num_output_tokens :][:k]
            wrong = next(self.calls) % (k + 2)  # k or k + 1: every draft right
            drafts.append([t if i != wrong else (t + 1) % 1000 for i, t in enumerate(future)])
        return drafts


def oracle_drafts(llm, prompts, ref) -> None:
    """``llm`` drafts the reference tokens ``ref`` of ``prompts`` (``OracleProposer``)."""
    llm.engine.speculator.proposer = OracleProposer({tuple(p): tokens for p, (tokens, _) in zip(prompts, ref)})


def draft_config(model: str, **extra) -> dict:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": 3, **extra}


def soak(engine, prompts: list[list[int]], ref: list, max_tokens: int, rounds: int = 3):
    """Each round: every prompt greedy (``ref``: its expected run) and seeded sampled, a third of the requests
    aborted at random steps (queued, prefilling, verifying), the invariants checked at every step; the greedy
    survivors equal their references; at the end the engine holds no block or state slot. Returns its stats."""
    from models import assert_same_greedy

    rng = random.Random(55)
    for rnd in range(rounds):
        ids = []
        for i, prompt in enumerate(prompts):
            greedy = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=2, ignore_eos=True)
            engine.add_request(f"g{rnd}-{i}", prompt, greedy)
            engine.add_request(f"s{rnd}-{i}", prompt, SamplingParams(temperature=0.9, seed=i, max_tokens=max_tokens))
            ids += [f"g{rnd}-{i}", f"s{rnd}-{i}"]
        doomed, done = set(rng.sample(ids, len(ids) // 3)), {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0]
            if doomed and rng.random() < 0.4:
                engine.abort_request(doomed.pop())
            engine.check_invariants()
        for i in range(len(prompts)):
            got = done.get(f"g{rnd}-{i}")
            if got is not None and got.finish_reason == "length":
                assert_same_greedy([(got.token_ids, got.logprobs)], [ref[i]], f"soak round {rnd} prompt {i}")
    stats = engine.get_stats()
    assert stats.kv_blocks_used == 0 and stats.state_slots_used == 0
    assert stats.state_snapshots_used <= stats.state_snapshots_total
    return stats
