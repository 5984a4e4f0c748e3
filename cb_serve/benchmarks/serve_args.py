"""The serving benchmark's flags (``cb-serve bench serve``), apart from the benchmark so that the
command line parses without its dependencies (httpx)."""

from __future__ import annotations

import argparse
import math
import os

from cb_serve.benchmarks.hf_baseline import HF_STATIC_BATCH_SIZE


def add_cli_args(parser: argparse.ArgumentParser, default_systems: str = "cb-serve") -> None:
    """The benchmark's flags; where ``vllm bench serve`` has one for the same thing, its name."""
    parser.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000",
        help="The server's URL, with or without /v1 (default: %(default)s).",
    )
    parser.add_argument("--model", help="Model name to request (default: the first of /v1/models).")
    parser.add_argument("--api-key", default=os.environ.get("CB_SERVE_API_KEY", "none"), help="Bearer key.")
    parser.add_argument("--tokenizer", default="default", help="Tokenizer for the prompts (default: built-in model's).")
    parser.add_argument(
        "--num-prompts", "--num-requests", dest="num_requests", type=int, default=64, help="Requests (default: 64)."
    )
    parser.add_argument("--seed", type=int, default=0, help="Workload and arrival-time seed (default: 0).")
    parser.add_argument("--request-rate", type=float, default=math.inf, help="Requests/s, Poisson (default: inf).")
    parser.add_argument("--max-concurrency", type=int, help="Most requests in flight (default: no limit).")
    parser.add_argument("--max-output-len", type=int, default=1 << 30, help="Cap on each output length.")
    parser.add_argument("--warmup", type=int, default=1, help="Untimed requests first (default: 1).")
    parser.add_argument("--request-timeout", type=float, default=1800.0, help="Seconds per request.")
    parser.add_argument("--launch", metavar="CONFIG", help="Start `serve run CONFIG` first and stop it after.")
    parser.add_argument("--launch-timeout", type=float, default=600.0, help="Seconds to wait for the server.")
    parser.add_argument(
        "--systems",
        default=default_systems,
        help="Comma-separated: cb-serve,hf (default: %(default)s); hf = HF transformers serving the same trace.",
    )
    parser.add_argument("--compare-hf", action="store_true", help="Add the HF baseline (needs --launch).")
    parser.add_argument("--skip-hf", action="store_true", help="Only cb-serve (same as --systems cb-serve).")
    parser.add_argument("--hf-model", default="default", help="HF baseline's model (default: the built-in one).")
    parser.add_argument("--hf-batch-size", type=int, default=HF_STATIC_BATCH_SIZE, help="HF's largest batch.")
    parser.add_argument(
        "--hf-threads",
        type=int,
        help="HF's torch threads (default: the cb-serve replica's, from --launch's config or deploy/config.yaml).",
    )
    parser.add_argument("--save-result", action="store_true", help="Write the results to a JSON file.")
    parser.add_argument("--result-dir", default=".", help="Directory of --save-result's file (default: .).")
    parser.add_argument(
        "--result-filename",
        help="File name for --save-result (default: cb-serve-{rate}qps[-concurrency{n}]-{model}-{date}.json).",
    )
    parser.add_argument("--json", metavar="OUT", help="Write config, per-request records and results to OUT.")
    parser.add_argument("--trace-out", metavar="PATH", help="Save cb-serve's /debug/trace of the run's end here.")
    parser.add_argument("--trace-seconds", type=float, default=10.0, help="Seconds of trace to save (default 10).")
    parser.add_argument("--screenshot", metavar="PNG", help="Screenshot /inspect (headless Chromium) mid-run.")
    parser.add_argument("--screenshot-after", type=float, default=20.0, help="Seconds into the run (default 20).")
