"""Stop-flood benchmark: does one request carrying the most stop strings the server allows,
with the largest ``n``, slow down everyone else's stream?

Measures a normal stream's inter-token latency (ITL) four ways on the same server, each
``--repeats`` times, alternating:

- ``alone``;
- beside ``control_n1``: one more sequence, no stop strings;
- beside ``flood_n1``: one sequence carrying ``--stop-strings`` strings of ``--stop-len``
  characters that never match (the engine's caps: 64 strings of 512 characters);
- beside ``control_nmax``: ``n`` = the cap (16), no stop strings: what 16 more sequences in
  the batch cost, stop strings or not;
- beside ``flood_nmax``: ``n`` = 16 and the maximal stop strings.

Reports the median ITL of each and the ratios ``flood_n1 / alone`` (the issue's figure),
``flood_n1 / control_n1`` and ``flood_nmax / control_nmax`` (the stop strings' own cost), and
``control_nmax / alone`` (what 16 more sequences in the batch cost).

    .venv/bin/python bench/stop_flood.py --launch deploy/config.yaml --json bench/results/stop_flood.json
    .venv/bin/python bench/stop_flood.py --base-url http://127.0.0.1:8000/v1   # a running server
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import string
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from cb_serve.benchmarks.report import log
from cb_serve.benchmarks.server_control import launch, stop, wait_until_ready
from cb_serve.config import EngineConfig
from cb_serve.serve.protocol import MAX_N

DEFAULTS = EngineConfig()


async def stream(client: httpx.AsyncClient, url: str, body: dict[str, Any], started: asyncio.Event | None = None):
    """Streams one completion; returns the gaps between its content chunks (seconds)."""
    gaps: list[float] = []
    last = None
    async with client.stream("POST", url, json={**body, "stream": True}) as r:
        if r.status_code != 200:
            raise SystemExit(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise SystemExit(f"stream error: {chunk['error']}")
            now = time.perf_counter()
            if started is not None:
                started.set()
            if last is not None:
                gaps.append(now - last)
            last = now
    return gaps


async def measure(base_url: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    url = f"{base_url}/completions"
    normal = {
        "model": model,
        "prompt": "Write a long story about a lighthouse keeper.",
        "max_tokens": args.tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    rng = random.Random(0)
    stops = [
        "\u2603" + "".join(rng.choices(string.ascii_letters, k=args.stop_len - 1)) for _ in range(args.stop_strings)
    ]
    other = {
        "model": model,
        "prompt": "Tell me about the sea.",
        "temperature": 0.8,
        "max_tokens": 4 * args.tokens,
        "ignore_eos": True,
    }
    beside = {
        "control_n1": other,
        "flood_n1": {**other, "stop": stops},
        "control_nmax": {**other, "n": MAX_N},
        "flood_nmax": {**other, "n": MAX_N, "stop": stops},
    }
    itl: dict[str, list[float]] = {"alone": [], **{name: [] for name in beside}}
    async with httpx.AsyncClient(timeout=600, headers={"Authorization": f"Bearer {args.api_key}"}) as client:
        await stream(client, url, {**normal, "max_tokens": 8})  # warm-up
        for rep in range(args.repeats):
            itl["alone"] += await stream(client, url, normal)
            for name, body in beside.items():
                started = asyncio.Event()
                task = asyncio.create_task(stream(client, url, body, started))
                await asyncio.wait_for(started.wait(), timeout=300)  # its n sequences are decoding
                itl[name] += await stream(client, url, normal)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                await asyncio.sleep(1.0)
            log(
                f"repeat {rep + 1}: "
                + ", ".join(f"{k} p50 {1000 * statistics.median(v):.1f} ms" for k, v in itl.items())
            )
    p50 = {k: statistics.median(v) for k, v in itl.items()}
    return {
        "itl_p50_ms": {k: round(1000 * v, 2) for k, v in p50.items()},
        "itl_mean_ms": {k: round(1000 * statistics.fmean(v), 2) for k, v in itl.items()},
        "flood_n1_over_alone": round(p50["flood_n1"] / p50["alone"], 3),
        "flood_n1_over_control_n1": round(p50["flood_n1"] / p50["control_n1"], 3),
        "flood_nmax_over_control_nmax": round(p50["flood_nmax"] / p50["control_nmax"], 3),
        "control_nmax_over_alone": round(p50["control_nmax"] / p50["alone"], 3),
        "stop_strings": args.stop_strings,
        "stop_len": args.stop_len,
        "n": MAX_N,
        "tokens": args.tokens,
        "repeats": args.repeats,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--launch", metavar="CONFIG", help="Start `serve run CONFIG` first and stop it after.")
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--tokens", type=int, default=64, help="Tokens of the normal stream.")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--stop-strings", type=int, default=DEFAULTS.max_stop_strings)
    parser.add_argument("--stop-len", type=int, default=DEFAULTS.max_stop_string_len)
    parser.add_argument("--json", type=Path, help="Write the result here.")
    args = parser.parse_args(argv)
    proc = launch(args.launch, Path("/tmp/stop_flood_serve.log")) if args.launch else None
    try:
        model = wait_until_ready(args.base_url, args.api_key, 600, proc)
        result = asyncio.run(measure(args.base_url, model, args))
    finally:
        if proc is not None:
            stop(proc)
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
