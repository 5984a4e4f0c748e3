"""What a replica's prefix-cache report costs: bytes, accuracy, CPU and staleness of the alternatives.

Every engine replica tells the request routers what its prefix cache holds through Ray Serve's routing
stats (``record_routing_stats``, polled by the controller every ``routing_stats_period_s`` and broadcast to
every router as the latest value). At a realistic cache of ``--num-blocks`` (100,000) full KV blocks of
``--block-size`` (16) tokens, all cached, and a churn of ``--prefill-tok-s`` (20,000) prefilled tokens/s
(``prefill / block_size`` new full blocks cached per second and as many evicted), this measures:

1. bytes per report of (a) every cached hash's 8-byte prefix, (b) its 4-byte prefix, (c) the sorted 4-byte
   prefixes zlib-compressed, (d) our Bloom digest (``CountingBloom.digest()``, the ``PrefixDigest`` bits and
   its pickled ``to_dict()``), (e) per-period deltas (added + evicted hashes x 8 bytes);
2. the Bloom digest's false-positive rate (``--probes`` non-member hashes) with the cache full and half full;
3. CPU time of ``CountingBloom.digest/add/remove``, ``PrefixDigest.hit_blocks`` (a 4,000-token prompt)
   and ``PrefixDigest.from_dict``, and of building the alternatives;
4. staleness: how old the digest a router uses can be (formula and numbers, with Ray Serve's real constants).

Hashes are random 32-byte strings: chained SHA-256 block hashes are indistinguishable from them. No Ray is
started; its constants are read from its source. Run (a few seconds, one core)::

    .venv/bin/python bench/digest_size.py --out bench/results/digest_size.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pickle
import re
import statistics
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from cb_serve.benchmarks.cpu_accounting import Timer
from cb_serve.cpu_ops import cpu_model_and_flags
from cb_serve.prefix_hash import (
    BITS_PER_BLOCK,
    HASH_BYTES,
    NUM_PROBES,
    CountingBloom,
    PrefixDigest,
    prefix_block_hashes,
    probe_words,
)

DELTA_NOTE = (
    "deltas need a reliable, ordered per-consumer channel (each router must see every delta, and a new or "
    "restarted router needs the whole state); Serve's routing stats are a latest-value broadcast (the "
    "controller keeps only the newest report per replica, a router that misses one sees only the next), so "
    "each delta report would have to carry a keyframe of (a)/(b) size anyway, or every report be one"
)


# ---- helpers ------------------------------------------------------------------------------------------------
def cpu_info() -> dict[str, Any]:
    """CPU model and whether it has AMX (Linux ``/proc/cpuinfo``)."""
    model, flags = cpu_model_and_flags()
    return {
        "model_name": model,
        "amx": any(f.startswith("amx") for f in flags),
        "amx_flags": sorted(f for f in flags if f.startswith("amx")),
        "num_cpus": os.cpu_count(),
    }


def random_hashes(rng: np.random.Generator, n: int) -> bytes:
    """``n`` concatenated 32-byte hashes."""
    return rng.bytes(n * HASH_BYTES)


def split(hashes: bytes) -> list[bytes]:
    return [hashes[i : i + HASH_BYTES] for i in range(0, len(hashes), HASH_BYTES)]


def median_s(fn: Callable[[], object], repeats: int, number: int = 1) -> float:
    """Median over ``repeats`` of the seconds one call of ``fn`` takes (each repeat times ``number`` calls)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        times.append((time.perf_counter() - start) / number)
    return statistics.median(times)


def held(digest: PrefixDigest, hashes: bytes) -> np.ndarray:
    """Per hash, whether the digest holds it (the test ``PrefixDigest.hit_blocks`` applies to each block)."""
    positions = probe_words(hashes) % np.uint32(digest.num_bits)
    table = np.frombuffer(digest.bits, dtype=np.uint8)
    return ((table[positions >> 3] >> (positions & 7).astype(np.uint8)) & 1).all(axis=1)


def expected_fp(num_entries: int, num_bits: int) -> float:
    return float((1 - np.exp(-NUM_PROBES * num_entries / num_bits)) ** NUM_PROBES)


def ray_serve_constants() -> dict[str, Any]:
    """Ray Serve's control-loop and routing-stats constants, read from its source (importing Ray is not
    needed), with the environment overrides they honour."""
    spec = importlib.util.find_spec("ray")
    out: dict[str, Any] = {"source": None}
    if spec is None or not spec.submodule_search_locations:
        return out
    path = Path(next(iter(spec.submodule_search_locations))) / "serve" / "_private" / "constants.py"
    try:
        text = path.read_text()
    except OSError:
        return out
    out["source"] = str(path)
    m = re.search(r"CONTROL_LOOP_INTERVAL_S\s*=\s*get_env_float\w*\(\s*\"(\w+)\",\s*([\d.]+)", text)
    if m:
        env, default = m.group(1), float(m.group(2))
        out["CONTROL_LOOP_INTERVAL_S"] = float(os.environ.get(env, default))
        out["CONTROL_LOOP_INTERVAL_S_env"] = env
        out["CONTROL_LOOP_INTERVAL_S_default"] = default
    for name in ("DEFAULT_REQUEST_ROUTING_STATS_PERIOD_S", "DEFAULT_REQUEST_ROUTING_STATS_TIMEOUT_S"):
        m = re.search(rf"^{name}\s*=\s*([\d.]+)", text, re.MULTILINE)
        if m:
            out[name] = float(m.group(1))
    return out


# ---- the measurements -----------------------------------------------------------------------------------------
def measure(args: argparse.Namespace) -> dict[str, Any]:
    rng = np.random.default_rng(args.seed)
    n, bs = args.num_blocks, args.block_size
    blocks_per_s = args.prefill_tok_s / bs
    churn_per_period = round(blocks_per_s * args.period_s)  # blocks cached (and as many evicted) per period

    cached_blob = random_hashes(rng, n)
    cached = split(cached_blob)

    # -- CountingBloom filled with the whole cache: add() per block
    bloom = CountingBloom(n, bs)
    start = time.perf_counter()
    for h in cached:
        bloom.add(h)
    add_us = (time.perf_counter() - start) / n * 1e6

    # -- churn: one period's evictions then as many new blocks, a few periods in a row (remove + add per block)
    churn_periods = args.churn_periods
    new_blob = random_hashes(rng, churn_per_period * churn_periods)
    new = split(new_blob)
    live = list(cached)
    remove_s = add2_s = 0.0
    for p in range(churn_periods):
        evicted, live = live[:churn_per_period], live[churn_per_period:]  # LRU: the oldest go first
        added = new[p * churn_per_period : (p + 1) * churn_per_period]
        start = time.perf_counter()
        for h in evicted:
            bloom.remove(h)
        remove_s += time.perf_counter() - start
        start = time.perf_counter()
        for h in added:
            bloom.add(h)
        add2_s += time.perf_counter() - start
        live += added
    remove_us = remove_s / (churn_per_period * churn_periods) * 1e6
    churned = bloom.digest()
    assert bloom.num_entries == n
    # A counting filter after churn must equal one built from scratch over what is cached now.
    fresh = CountingBloom(n, bs)
    for h in live:
        fresh.add(h)
    churn_exact = bool((fresh.counts == bloom.counts).all())
    max_count = int(bloom.counts.max())

    # ---- 1. bytes per report
    live_blob = b"".join(live)
    words = np.frombuffer(live_blob, dtype=np.uint8).reshape(n, HASH_BYTES)
    prefix8 = np.ascontiguousarray(words[:, :8]).tobytes()
    prefix4 = np.ascontiguousarray(words[:, :4]).tobytes()
    sorted4 = np.sort(np.frombuffer(prefix4, dtype=">u4")).astype(">u4")  # big-endian: sorted bytes share heads
    sorted4_bytes = sorted4.tobytes()
    zlib4 = zlib.compress(sorted4_bytes, args.zlib_level)
    gaps = np.diff(sorted4.astype(np.int64), prepend=0).astype("<u4")
    zlib_gaps = zlib.compress(gaps.tobytes(), args.zlib_level)
    digest_dict_pickled = pickle.dumps(churned.to_dict(), protocol=pickle.HIGHEST_PROTOCOL)
    delta_bytes = 2 * churn_per_period * 8
    sizes: dict[str, dict[str, Any]] = {
        "a_prefix8_list": {"bytes": len(prefix8), "pickled_list_bytes": len(pickle.dumps(prefix_list(prefix8, 8)))},
        "b_prefix4_list": {"bytes": len(prefix4), "pickled_list_bytes": len(pickle.dumps(prefix_list(prefix4, 4)))},
        "c_sorted4_zlib": {"bytes": len(zlib4), "level": args.zlib_level},
        "c2_sorted4_gaps_zlib": {"bytes": len(zlib_gaps), "note": "extra: sorted, gap-encoded, then zlib"},
        "d_bloom_digest": {
            "bits_bytes": len(churned.bits),
            "pickled_to_dict_bytes": len(digest_dict_pickled),
            "bits_per_block": BITS_PER_BLOCK,
            "num_probes": NUM_PROBES,
        },
        "e_delta_per_period": {
            "bytes": delta_bytes,
            "added": churn_per_period,
            "evicted": churn_per_period,
            "note": DELTA_NOTE,
        },
    }

    # ---- 2. false positives: full cache, and half of it
    probes = random_hashes(rng, args.probes)
    fp_full = float(held(churned, probes).mean())
    half = CountingBloom(n, bs)
    for h in live[: n // 2]:
        half.add(h)
    half_digest = half.digest()
    fp_half = float(held(half_digest, probes).mean())
    # The vectorized test is hit_blocks' own: check it against hit_blocks one hash at a time on a sample.
    sample = probes[: 2000 * HASH_BYTES]
    assert [churned.hit_blocks(h) for h in split(sample)] == held(churned, sample).astype(int).tolist()
    assert held(churned, live_blob).all() and churned.hit_blocks(live_blob[: 250 * HASH_BYTES]) == 250
    fp = {
        "probes": args.probes,
        "full": {"entries": n, "measured": fp_full, "expected": expected_fp(n, churned.num_bits)},
        "half": {"entries": n // 2, "measured": fp_half, "expected": expected_fp(n // 2, half_digest.num_bits)},
        "fill_ratio_full": float((bloom.counts > 0).mean()),
        "counting_bloom_after_churn_equals_rebuild": churn_exact,
        "churn_blocks_applied": churn_per_period * churn_periods,
        "max_counter": max_count,
    }

    # ---- 3. CPU time
    prompt_blocks = args.prompt_tokens // bs
    prompt_hit = live_blob[: prompt_blocks * HASH_BYTES]  # every block held: hit_blocks reads them all
    prompt_cold = probes[: prompt_blocks * HASH_BYTES]  # the first block misses (mostly)
    d = churned.to_dict()
    tokens = rng.integers(0, 150_000, size=args.prompt_tokens + 1).tolist()
    cpu = {
        "bloom_digest_ms": median_s(bloom.digest, args.repeats) * 1e3,
        "bloom_add_us_per_block": add_us,
        "bloom_add_us_per_block_churn": add2_s / (churn_per_period * churn_periods) * 1e6,
        "bloom_remove_us_per_block": remove_us,
        "hit_blocks_us_prompt_all_held": median_s(lambda: churned.hit_blocks(prompt_hit), args.repeats, 50) * 1e6,
        "hit_blocks_us_prompt_cold": median_s(lambda: churned.hit_blocks(prompt_cold), args.repeats, 50) * 1e6,
        "prompt_blocks": prompt_blocks,
        "prefix_block_hashes_us_prompt": median_s(lambda: prefix_block_hashes(tokens, bs), args.repeats, 5) * 1e6,
        "from_dict_us": median_s(lambda: PrefixDigest.from_dict(d), args.repeats, 50) * 1e6,
        "pickle_dumps_digest_us": median_s(lambda: pickle.dumps(d), args.repeats, 50) * 1e6,
        "pickle_loads_digest_us": median_s(lambda: pickle.loads(digest_dict_pickled), args.repeats, 50) * 1e6,
        # The controller builds a RunningReplicaInfo per replica for each broadcast; its __post_init__ hashes
        # str(routing_stats), i.e. the repr of the whole report.
        "controller_str_report_ms_d": median_s(lambda: str({"prefix_cache": d}), args.repeats) * 1e3,
        "controller_str_report_chars_d": len(str({"prefix_cache": d})),
        "controller_str_report_ms_a": median_s(lambda: str({"prefix_cache": prefix8}), args.repeats) * 1e3,
        "build_a_prefix8_ms": median_s(lambda: b"".join(h[:8] for h in live), args.repeats) * 1e3,
        "build_c_sorted4_zlib_ms": median_s(
            lambda: zlib.compress(np.sort(np.frombuffer(prefix4, dtype=">u4")).tobytes(), args.zlib_level),
            args.repeats,
        )
        * 1e3,
        "churn_cpu_per_s_ms": (add2_s + remove_s) / (churn_periods * args.period_s) * 1e3,
    }
    cpu["churn_cpu_share_of_one_core"] = cpu["churn_cpu_per_s_ms"] / 1e3

    # ---- 4. staleness
    ray = ray_serve_constants()
    loop_s = ray.get("CONTROL_LOOP_INTERVAL_S", 0.1)
    jitter = 1.1  # deployment_state._should_record_routing_stats: period * random.uniform(0.9, 1.1)
    p, step = args.period_s, args.step_s
    interval_max = jitter * p + loop_s  # a new poll starts on the first control-loop tick after the jittered period
    age_report = interval_max + step  # snapshot taken after the step following the previous read
    age_arrival = age_report + loop_s  # the controller picks the finished call up on a later tick, then broadcasts
    age_used_max = age_arrival + interval_max  # a router keeps it until the next report arrives
    interval_mean = p + loop_s / 2
    age_used_mean = (interval_mean - step / 2) + loop_s / 2 + interval_mean / 2
    staleness = {
        "period_s": p,
        "step_s": step,
        "control_loop_interval_s": loop_s,
        "poll_jitter": "period x uniform(0.9, 1.1), checked every control-loop tick",
        "interval_max_s": interval_max,
        "digest_age_in_report_max_s": age_report,
        "digest_age_at_router_arrival_max_s": age_arrival,
        "digest_age_when_used_max_s": age_used_max,
        "digest_age_when_used_mean_s": age_used_mean,
        "blocks_changed_in_max_age": blocks_per_s * age_used_max,
        "blocks_changed_in_max_age_frac_of_cache": blocks_per_s * age_used_max / n,
        "formula": (
            "I = 1.1*P + L (jittered poll period, started on a control-loop tick); age in report <= I + S "
            "(refreshed after the step following the previous read); at router <= I + S + L (picked up on a later "
            "tick, long-poll broadcast); when used <= 2*I + S + L (kept until the next report arrives)"
        ),
        "ray_constants": ray,
    }
    return {
        "config": {
            "num_blocks": n,
            "block_size": bs,
            "prefill_tok_s": args.prefill_tok_s,
            "blocks_per_s_cached_and_evicted": blocks_per_s,
            "churn_per_period": churn_per_period,
            "period_s": p,
            "seed": args.seed,
        },
        "bytes_per_report": sizes,
        "false_positive_rate": fp,
        "cpu_time": cpu,
        "staleness": staleness,
    }


def prefix_list(blob: bytes, width: int) -> list[bytes]:
    """The prefixes as a Python list of ``bytes``, as a report would pickle them."""
    return [blob[i : i + width] for i in range(0, len(blob), width)]


# ---- output -----------------------------------------------------------------------------------------------------
def print_table(r: dict[str, Any]) -> None:
    cfg, s, fp, cpu, st = r["config"], r["bytes_per_report"], r["false_positive_rate"], r["cpu_time"], r["staleness"]
    print(f"CPU: {r['cpu']['model_name']}  amx={r['cpu']['amx']} {' '.join(r['cpu']['amx_flags'])}")
    print(
        f"cache {cfg['num_blocks']:,} blocks x {cfg['block_size']} tokens, all cached; churn "
        f"{cfg['blocks_per_s_cached_and_evicted']:,.0f} blocks/s cached + evicted "
        f"({cfg['churn_per_period']} each per {cfg['period_s']} s period)"
    )
    print("\n1. bytes per report (per replica, per period)")
    rows = [
        (
            "(a) 8-byte prefixes",
            s["a_prefix8_list"]["bytes"],
            f"pickled list {s['a_prefix8_list']['pickled_list_bytes']:,}",
        ),
        (
            "(b) 4-byte prefixes",
            s["b_prefix4_list"]["bytes"],
            f"pickled list {s['b_prefix4_list']['pickled_list_bytes']:,}",
        ),
        ("(c) sorted 4-byte, zlib", s["c_sorted4_zlib"]["bytes"], f"level {s['c_sorted4_zlib']['level']}"),
        ("(c') sorted 4-byte gaps, zlib", s["c2_sorted4_gaps_zlib"]["bytes"], "extra"),
        (
            "(d) Bloom digest",
            s["d_bloom_digest"]["pickled_to_dict_bytes"],
            f"bits {s['d_bloom_digest']['bits_bytes']:,}; pickled to_dict() shown",
        ),
        ("(e) delta per period", s["e_delta_per_period"]["bytes"], "needs a reliable channel, see note"),
    ]
    for name, size, note in rows:
        print(f"  {name:<31} {size:>10,} B  {size / 1024:>8.1f} KiB  {note}")
    print(f"  note (e): {DELTA_NOTE}.")
    print("\n2. Bloom false-positive rate")
    for key in ("full", "half"):
        v = fp[key]
        print(
            f"  {v['entries']:>7,} entries: measured {v['measured']:.4%} ({fp['probes']:,} probes), "
            f"expected {v['expected']:.4%}"
        )
    print(
        f"  bits set when full {fp['fill_ratio_full']:.3f}; after {fp['churn_blocks_applied']:,} evictions+adds the "
        f"counting filter equals a rebuild: {fp['counting_bloom_after_churn_equals_rebuild']}; "
        f"max counter {fp['max_counter']}"
    )
    print("\n3. CPU time (median)")
    print(f"  CountingBloom.digest()                 {cpu['bloom_digest_ms']:8.3f} ms")
    print(
        f"  CountingBloom.add (fill / churn)       {cpu['bloom_add_us_per_block']:8.2f} / "
        f"{cpu['bloom_add_us_per_block_churn']:.2f} us per block"
    )
    print(f"  CountingBloom.remove                   {cpu['bloom_remove_us_per_block']:8.2f} us per block")
    print(f"  churn add+remove at this rate          {cpu['churn_cpu_per_s_ms']:8.2f} ms CPU per s")
    print(
        f"  hit_blocks, {cpu['prompt_blocks']} blocks all held         {cpu['hit_blocks_us_prompt_all_held']:8.1f} us"
    )
    print(f"  hit_blocks, {cpu['prompt_blocks']} blocks, cold             {cpu['hit_blocks_us_prompt_cold']:8.1f} us")
    print(
        f"  prefix_block_hashes, 4,000 tokens      {cpu['prefix_block_hashes_us_prompt']:8.1f} us (router, per prompt)"
    )
    print(f"  PrefixDigest.from_dict                 {cpu['from_dict_us']:8.1f} us")
    print(
        f"  pickle dumps / loads of to_dict()      {cpu['pickle_dumps_digest_us']:8.1f} / "
        f"{cpu['pickle_loads_digest_us']:.1f} us"
    )
    print(
        f"  controller str(report) (d) / (a)       {cpu['controller_str_report_ms_d']:8.2f} / "
        f"{cpu['controller_str_report_ms_a']:.2f} ms per replica per broadcast "
        f"({cpu['controller_str_report_chars_d']:,} chars for (d); RunningReplicaInfo hashes str(routing_stats))"
    )
    print(f"  build (a) from 100k hashes             {cpu['build_a_prefix8_ms']:8.2f} ms")
    print(f"  build (c) sort + zlib                  {cpu['build_c_sorted4_zlib_ms']:8.2f} ms")
    print("\n4. staleness")
    ray = st["ray_constants"]
    print(
        f"  Ray Serve: CONTROL_LOOP_INTERVAL_S = {ray.get('CONTROL_LOOP_INTERVAL_S')} "
        f"(env {ray.get('CONTROL_LOOP_INTERVAL_S_env')}), DEFAULT_REQUEST_ROUTING_STATS_PERIOD_S = "
        f"{ray.get('DEFAULT_REQUEST_ROUTING_STATS_PERIOD_S')} (cb_serve sets routing_stats_period_s = {st['period_s']})"
    )
    print(
        f"  P = {st['period_s']} s, S (engine step) = {st['step_s']} s, "
        f"L (control loop) = {st['control_loop_interval_s']} s"
    )
    print(f"  {st['formula']}")
    print(
        f"  I = {st['interval_max_s']:.2f} s; in report <= {st['digest_age_in_report_max_s']:.2f} s; at router <= "
        f"{st['digest_age_at_router_arrival_max_s']:.2f} s; when used <= {st['digest_age_when_used_max_s']:.2f} s "
        f"(mean ~{st['digest_age_when_used_mean_s']:.2f} s)"
    )
    print(
        f"  blocks changed within the max age: {st['blocks_changed_in_max_age']:,.0f} "
        f"({st['blocks_changed_in_max_age_frac_of_cache']:.2%} of the cache)"
    )
    t = r["timer"]
    print(f"\nown CPU {t['own_cpu_s']:.1f} s, foreign CPU share {t['foreign_cpu_share']}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-blocks", type=int, default=100_000)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prefill-tok-s", type=float, default=20_000.0, help="new tokens prefilled (and cached) per s")
    parser.add_argument("--period-s", type=float, default=0.5, help="routing_stats_period_s")
    parser.add_argument("--step-s", type=float, default=0.1, help="one engine step (2,048 tokens at 20k tokens/s)")
    parser.add_argument("--churn-periods", type=int, default=10, help="periods of churn applied to the filter")
    parser.add_argument("--probes", type=int, default=200_000, help="non-member hashes probed for false positives")
    parser.add_argument("--prompt-tokens", type=int, default=4_000)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--zlib-level", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)

    with Timer() as timer:
        result = measure(args)
    result["cpu"] = cpu_info()
    result["timer"] = timer.to_json()
    result["python"] = sys.version.split()[0]
    result["numpy"] = np.__version__
    print_table(result)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
