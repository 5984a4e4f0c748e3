"""The serving benchmark's client: a seeded trace of streamed ``/v1/completions`` requests against an
OpenAI-compatible server (token-id prompts, ``ignore_eos``), timed per token chunk, and the engine's
``/stats`` counters before and after."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Sequence
from typing import Any

import httpx

from cb_serve.benchmarks.server_control import server_root
from cb_serve.benchmarks.serving_stats import RequestResult
from cb_serve.benchmarks.workload import Workload, capped_output_lens, warmup_prompt

SCHEDULING_SHARE_NOTE = (
    "scheduling_seconds / step_seconds from the engine's /stats counters over the timed run "
    "(scheduling + building the batch's tensors, of the wall time inside engine steps)"
)
ENGINE_COUNTERS = (
    "num_steps",
    "prompt_tokens",
    "generation_tokens",
    "num_preemptions",
    "prefix_cache_hits",
    "step_seconds",
    "scheduling_seconds",
)


def greedy_stream_body(model: str, max_tokens: int, **prompt_or_messages: Any) -> dict[str, Any]:
    """A streamed, greedy request body for exactly ``max_tokens`` tokens (EOS ignored) that ends
    with a usage chunk; ``prompt=`` for completions, ``messages=`` for chat."""
    return {
        "model": model,
        **prompt_or_messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def stream_completion(
    client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int, headers: dict[str, str]
) -> RequestResult:
    """One streamed greedy completion of exactly ``max_tokens`` tokens: its TTFT, ITLs and latency."""
    result = RequestResult(len(prompt), max_tokens)
    body = greedy_stream_body(model, max_tokens, prompt=prompt)
    start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return result
            if not await _read_stream(response, result, start):
                return result
        result.latency_s = time.perf_counter() - start
        result.ok = result.completion_tokens == max_tokens
        if not result.ok:
            result.error = f"{result.completion_tokens} tokens generated, {max_tokens} requested"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


async def _read_stream(response: httpx.Response, result: RequestResult, start: float) -> bool:
    """Reads the server-sent events into ``result`` (token times, usage); False if an error chunk ended it."""
    last = start
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            result.error = chunk["error"].get("message", "error")
            return False
        if chunk.get("usage"):
            result.completion_tokens = chunk["usage"]["completion_tokens"]
        if not chunk.get("choices"):
            continue
        now = time.perf_counter()
        if result.ttft_s == 0.0:
            result.ttft_s = now - start
        else:
            result.itl_s.append(now - last)
        last = now
    return True


async def get_engine_stats(client: httpx.AsyncClient, base_url: str, headers: dict[str, str]) -> dict[str, Any] | None:
    """The engine counters of ``/stats`` (one replica), or None."""
    try:
        response = await client.get(f"{server_root(base_url)}/stats", headers=headers, timeout=30)
        return response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, json.JSONDecodeError):
        return None


def engine_delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any]:
    """What the engine did during the timed run, from two ``/stats`` snapshots."""
    out: dict[str, Any] = {"scheduling_share": None, "scheduling_share_note": SCHEDULING_SHARE_NOTE}
    if before is None or after is None:
        return {**out, "stats": "unavailable (/stats did not answer)"}
    for key in ENGINE_COUNTERS:
        if isinstance(before.get(key), (int, float)) and isinstance(after.get(key), (int, float)):
            out[key] = after[key] - before[key]
    if out.get("step_seconds"):
        out["scheduling_share"] = out.get("scheduling_seconds", 0.0) / out["step_seconds"]
    if out.get("num_steps"):
        out["mean_generated_tokens_per_step"] = out.get("generation_tokens", 0) / out["num_steps"]
    out["max_batch_seqs_since_start"] = after.get("max_batch_seqs")
    return out


async def run_benchmark(
    args: argparse.Namespace, model: str, workload: Workload, arrivals: Sequence[float]
) -> tuple[float, list[RequestResult], dict[str, Any]]:
    """The trace against ``args.base_url`` after ``args.warmup`` untimed requests: the wall seconds, each
    request's record and the engine's ``/stats`` deltas."""
    url = f"{args.base_url}/completions"
    headers = {"Authorization": f"Bearer {args.api_key}"}
    output_lens = capped_output_lens(workload, args.max_output_len)
    limit = args.max_concurrency or workload.num_requests
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=limit + 1)) as client:
        for _ in range(args.warmup):  # not timed: first-request costs (allocations, kernel builds) stay out
            warm = await stream_completion(client, url, model, warmup_prompt(workload), 8, headers)
            if not warm.ok:
                raise SystemExit(f"warmup request failed: {warm.error}")
        stats_before = await get_engine_stats(client, args.base_url, headers)
        semaphore = asyncio.Semaphore(limit)
        start = time.perf_counter()

        async def one(prompt: list[int], max_tokens: int, arrival: float) -> RequestResult:
            async with semaphore:
                sent = time.perf_counter() - start
                result = await stream_completion(client, url, model, prompt, max_tokens, headers)
            result.arrival_s, result.queue_s = arrival, max(0.0, sent - arrival)
            return result

        tasks = []
        for prompt, max_tokens, arrival in zip(workload.prompts, output_lens, arrivals):
            await asyncio.sleep(max(0.0, start + arrival - time.perf_counter()))
            tasks.append(asyncio.create_task(one(prompt, max_tokens, arrival)))
        results = await asyncio.gather(*tasks)
        duration_s = time.perf_counter() - start
        stats_after = await get_engine_stats(client, args.base_url, headers)
    return duration_s, list(results), engine_delta(stats_before, stats_after)
