"""``cb-serve`` command line: ``generate`` (offline inference) and ``serve`` (``serve run`` with a
graceful stop on SIGTERM)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from cb_serve.config import EngineConfig


def _sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling arguments")
    g.add_argument(
        "--max-tokens", type=int, default=64, help="Most tokens to generate per prompt (default: %(default)s)"
    )
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy. (default: %(default)s)")
    g.add_argument("--top-p", type=float, default=1.0, help="Nucleus sampling mass (default: %(default)s)")
    g.add_argument(
        "--top-k", type=int, default=-1, help="Sample among the k most likely tokens; -1 = off. (default: %(default)s)"
    )
    g.add_argument(
        "--min-p", type=float, default=0.0, help="Drop tokens below min_p x the top probability. (default: %(default)s)"
    )
    g.add_argument("--sampling-seed", type=int, default=None, help="Per-request sampling seed. (default: %(default)s)")
    g.add_argument("--n", type=int, default=1, help="Completions per prompt (default: %(default)s)")
    g.add_argument("--stop", action="append", default=None, help="Stop string (repeatable). (default: %(default)s)")
    g.add_argument(
        "--ignore-eos",
        action="store_true",
        help="Keep generating past the end-of-sequence token. (default: %(default)s)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cb-serve", description="Continuous-batching LLM engine.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="Generate completions offline.")
    gen.add_argument("--prompt", action="append", required=True, help="A prompt (repeatable).")
    gen.add_argument("--chat", action="store_true", help="Wrap each prompt as a user message in the chat template.")
    gen.add_argument("--json", action="store_true", help="Print one JSON object per completion.")
    _sampling_args(gen)
    EngineConfig.add_cli_args(gen)
    srv = sub.add_parser(
        "serve",
        help="Run `serve run CONFIG`; on SIGTERM or Ctrl-C, first delete the applications gracefully (streams "
        "in flight finish within graceful_shutdown_timeout_s), then stop. `serve run` alone cuts them.",
    )
    srv.add_argument("config", nargs="?", default="deploy/config.yaml", help="Ray Serve config file.")
    bench = sub.add_parser("bench", help="Benchmarks.").add_subparsers(dest="bench_command", required=True)
    bench_serve = bench.add_parser(
        "serve",
        help="Serving benchmark against an OpenAI-compatible server (flags as `vllm bench serve`'s).",
        description="Sends a seeded workload to the server's /v1/completions (streaming) and reports request "
        "and token throughput, TTFT, ITL, TPOT and end-to-end latency; --compare-hf serves the same trace with "
        "HF transformers afterwards. See cb_serve/benchmarks/serve.py for what is measured.",
    )
    from cb_serve.benchmarks.serve_args import add_cli_args

    add_cli_args(bench_serve)
    return parser


def serve_run_gcs_address(session: int) -> str | None:
    """The GCS address of the Ray instance that ``serve run`` (the leader of ``session``) started: its
    raylet's ``--gcs-address``, None when it started none (it joined ``RAY_ADDRESS``'s cluster)."""
    import psutil

    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if os.getsid(proc.info["pid"]) != session:
                continue
        except OSError:
            continue
        args = " ".join(proc.info["cmdline"] or ()).split()
        if args and Path(args[0]).name == "raylet":
            found = [a.split("=", 1)[1] for a in args if a.startswith("--gcs-address=")]
            if found:
                return found[0]
    return None


def drain_serve_applications(address: str | None = None) -> None:
    """Deletes every Serve application of the Ray instance at ``address`` (default: the one ``ray``
    finds, ``RAY_ADDRESS`` first), waiting for it: the proxies stay up while each replica stops taking
    requests and its streams finish (graceful_shutdown_timeout_s)."""
    import ray
    from ray import serve

    ray.init(address=address or "auto", log_to_driver=False, logging_level="ERROR")
    try:
        for name in list(serve.status().applications):
            serve.delete(name)
    finally:
        ray.shutdown()


# After the drain: how long `serve run` gets to stop on SIGINT, then on SIGTERM, before SIGKILL.
STOP_WAITS_S = {signal.SIGINT: 60.0, signal.SIGTERM: 15.0}


def _default_sigint() -> None:
    """In the child, before exec: SIGINT back to its default (under a shell's ``&``, ``nohup`` or
    some supervisors it is ignored, and ``serve run`` would inherit that and never stop)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def stop_serve_run(proc: subprocess.Popen) -> int:
    """SIGINT (``serve run``'s own clean stop), then SIGTERM, then SIGKILL to its process group,
    each after a bounded wait: the command always ends."""
    for signum, wait_s in STOP_WAITS_S.items():
        proc.send_signal(signum)
        try:
            return proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            print(f"cb-serve: serve run did not stop within {wait_s:.0f} s of {signum.name}", file=sys.stderr)
    os.killpg(proc.pid, signal.SIGKILL)
    return proc.wait()


def cmd_serve(args: argparse.Namespace) -> int:
    serve_bin = shutil.which("serve", path=str(Path(sys.executable).parent)) or "serve"
    stopping: list[int] = []

    def stop_gracefully(signum: int, _frame: object) -> None:
        stopping.append(signum)

    # The handlers first: a signal that comes while the child starts is not lost.
    signal.signal(signal.SIGTERM, stop_gracefully)
    signal.signal(signal.SIGINT, stop_gracefully)
    # Its own session: a terminal's Ctrl-C reaches only this process, which drains, then stops it.
    proc = subprocess.Popen([serve_bin, "run", args.config], start_new_session=True, preexec_fn=_default_sigint)
    while proc.poll() is None and not stopping:
        time.sleep(0.2)
    if proc.poll() is None:
        try:  # the instance this `serve run` started, not another on the machine (`ray`'s "auto" guesses)
            drain_serve_applications(serve_run_gcs_address(proc.pid))
        except Exception as e:  # noqa: BLE001 - still stop the server
            print(f"cb-serve: draining the applications failed ({e}); stopping anyway", file=sys.stderr)
        return stop_serve_run(proc)
    return proc.wait()


def cmd_generate(args: argparse.Namespace) -> int:
    from cb_serve import LLM, SamplingParams

    try:
        params = SamplingParams(
            n=args.n,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            seed=args.sampling_seed,
            max_tokens=args.max_tokens,
            stop=args.stop,
            ignore_eos=args.ignore_eos,
        )
        llm = LLM(**vars(EngineConfig.from_cli_args(args)))
        if args.chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params, use_tqdm=False)
        else:
            outputs = llm.generate(args.prompt, params, use_tqdm=False)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for prompt, out in zip(args.prompt, outputs):
        for c in out.outputs:
            if args.json:
                print(
                    json.dumps(
                        {
                            "prompt": prompt,
                            "index": c.index,
                            "text": c.text,
                            "token_ids": c.token_ids,
                            "finish_reason": c.finish_reason,
                        }
                    )
                )
            else:
                print(f"--- {prompt!r} [{c.index}] ({c.finish_reason}, {len(c.token_ids)} tokens)\n{c.text}")
    return 0


def cmd_bench_serve(args: argparse.Namespace) -> int:
    try:
        from cb_serve.benchmarks import serve
    except ImportError as e:
        print(f"error: the serving benchmark needs {e.name}: pip install 'cb-serve[bench]'", file=sys.stderr)
        return 2
    serve.check_systems(argparse.ArgumentParser(prog="cb-serve bench serve"), args)
    serve.run(args)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "bench":
        return cmd_bench_serve(args)
    if args.command == "generate":
        return cmd_generate(args)
    if args.command == "serve":
        return cmd_serve(args)
    return 1


if __name__ == "__main__":
    sys.exit(main())
