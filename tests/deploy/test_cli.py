"""``cb-serve generate``: every engine argument has a flag and help; bad input exits cleanly."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

from cb_serve import EngineConfig, SamplingParams


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cb_serve.cli", *args], capture_output=True, text=True, timeout=300)


def test_help_lists_every_engine_argument():
    out = run_cli("generate", "--help")
    assert out.returncode == 0
    for f in dataclasses.fields(EngineConfig):
        assert "--" + f.name.replace("_", "-") in out.stdout, f.name


def test_generate_with_a_model_directory(random_model_dir):
    out = run_cli(
        "generate",
        "--model",
        str(random_model_dir("llama")),
        "--prompt",
        "Hello",
        "--prompt",
        "World",
        "--max-tokens",
        "5",
        "--ignore-eos",
        "--json",
        "--max-model-len",
        "256",
    )
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["prompt"] for r in rows] == ["Hello", "World"]
    assert all(len(r["token_ids"]) == 5 and r["finish_reason"] == "length" for r in rows)


def test_bad_input_is_a_clean_error(random_model_dir):
    out = run_cli("generate", "--model", str(random_model_dir("llama")), "--prompt", "x", "--top-p", "2")
    assert out.returncode == 2 and "top_p must be in (0, 1]" in out.stderr and "Traceback" not in out.stderr
    out = run_cli("generate", "--model", "/no/such/model", "--prompt", "x")
    assert out.returncode == 2 and "does not exist" in out.stderr and "Traceback" not in out.stderr


def generated(out: subprocess.CompletedProcess) -> list[list[int]]:
    assert out.returncode == 0, out.stderr
    return [json.loads(line)["token_ids"] for line in out.stdout.splitlines()]


def test_chat_flag_applies_the_chat_template(random_model_dir, tiny_llm):
    """``--chat`` wraps each prompt as a user message: the same tokens as ``LLM.chat``."""
    model = str(random_model_dir("llama"))
    out = run_cli("generate", "--model", model, "--prompt", "Hi there", "--chat", "--max-tokens", "6", "--json")
    expected = tiny_llm.chat([{"role": "user", "content": "Hi there"}], SamplingParams(temperature=0, max_tokens=6))
    assert generated(out) == [expected[0].outputs[0].token_ids]
    plain = run_cli("generate", "--model", model, "--prompt", "Hi there", "--max-tokens", "6", "--json")
    assert generated(plain) != generated(out), "--chat made no difference"


def test_cpu_ops_can_be_turned_off(random_model_dir):
    """``CB_SERVE_CPU_OPS=0``: a warning, the PyTorch path, and the same greedy tokens."""
    args = ("generate", "--model", str(random_model_dir("llama")), "--prompt", "Hello", "--max-tokens", "8", "--json")
    env = {**os.environ, "CB_SERVE_CPU_OPS": "0"}
    off = subprocess.run(
        [sys.executable, "-m", "cb_serve.cli", *args], capture_output=True, text=True, timeout=300, env=env
    )
    assert "CPU kernels disabled (CB_SERVE_CPU_OPS=0); using the PyTorch path" in off.stderr, off.stderr
    assert generated(off) == generated(run_cli(*args))


def test_stopping_serve_run_escalates_until_it_ends(monkeypatch):
    """``cb-serve serve`` stops ``serve run`` with SIGINT, then SIGTERM, then SIGKILL to its
    process group, each after a bounded wait: a child that ignores the first two still ends."""
    import signal
    import time

    from cb_serve import cli

    monkeypatch.setattr(cli, "STOP_WAITS_S", {signal.SIGINT: 0.5, signal.SIGTERM: 0.5})
    stubborn = "import signal, time; [signal.signal(s, signal.SIG_IGN) for s in (2, 15)]; print('up', flush=True)"
    stubborn += "; time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", stubborn], start_new_session=True, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "up\n"
    started = time.monotonic()
    assert cli.stop_serve_run(proc) == -signal.SIGKILL
    assert time.monotonic() - started < 10
