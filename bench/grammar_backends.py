"""llguidance vs xgrammar on this CPU, for issue 23's choice of a structured-outputs backend.

Schemas: ``tests/json_schemas.py``'s ``SCHEMAS`` (``--schemas N``: the first N), plus with
``--extra-vendored`` a few real-world schemas that the ``check-jsonschema`` package vendors from
schemastore.org (when it is installed; cb-serve does not depend on it), plus with ``--hostile`` the
``HOSTILE_SCHEMAS`` (compile phase only, reported apart). Tokenizer and model: the built-in default
(SmolLM2-135M-Instruct) unless ``--model``.

Both backends get the same JSON layout: no free whitespace, separators ``", "`` and ``": "``
(``--whitespace flexible``: each backend's arbitrary-whitespace mode instead). Other options are each
library's default (xgrammar's ``strict_mode=True`` forbids properties a schema does not list;
llguidance follows the schema's own ``additionalProperties``; the suite sets it false almost everywhere).
llguidance refuses a schema with a keyword it does not implement (``not``, ``if``/``then``/``else``,
``uniqueItems``, ...) or a ``oneOf`` whose branches it cannot prove disjoint; xgrammar compiles such a
schema and ignores what it does not implement. ``--llg-lenient`` makes llguidance do the same
(JsonCompileOptions ``lenient``, ``coerce_one_of``).

1. Compile, cold. In a worker process per backend (restarted after a timeout or a crash, so a schema
   that hangs or kills its compiler is reported and the rest still run), after one untimed warm-up
   compile of a trivial schema, for each schema: from the schema's JSON text to a ready matcher, with a
   fresh compiler and no cache (xgrammar: a new ``GrammarCompiler(cache_enabled=False)`` built before the
   clock starts; llguidance has no grammar cache). Also "compile + first mask": llguidance builds its
   lexer lazily, so its first mask carries work that xgrammar does ahead in compilation. The
   tokenizer-level setup (llguidance ``LLTokenizer``, xgrammar ``TokenizerInfo``) is built once per
   process and reported apart. p50/p90/p99/max over the schemas (numpy's linear percentiles); each
   failure with its error; ``--compile-timeout`` seconds per schema.
2. Masks, on real token sequences: the model (HF transformers, float32, greedy, KV cache) generates up
   to ``--max-tokens`` tokens per schema and backend, prompted through its chat template to produce JSON
   for the schema (the schema's text is in the prompt when it is under 6,000 characters), with the
   backend's mask applied to every step's logits by the backend's own functions. The sequence is then
   replayed on a fresh matcher (compiled again) with no forward pass in between, timing each call apart:
   the bitmask fill, the apply to a (1, vocab) float32 copy of real logits, and the accept of the token
   (on 2 cores, a forward pass's OpenMP workers keep spinning for a while after it returns and slow what
   runs next; the fill timed during generation, right after each forward pass, is reported too as
   "interleaved"). p50/p99/max over all tokens of all schemas, the stop token's step included. When
   the grammar terminated (the stop token was accepted), the output is checked with ``jsonschema`` (the
   validator of the draft the schema declares, with its format checker): the report gives the fraction
   that validates, and whether both backends produced the same token ids (where not: the first step
   where they differ, in the JSON result; the masks differ, e.g. llguidance admits only the canonical
   tokenization of forced text such as a key, xgrammar any tokenization).

API used (installed sources under .venv/lib/python3.11/site-packages/):
  llguidance 1.9.1
    llguidance/hf.py        ``from_tokenizer(hf_tokenizer, n_vocab)`` -> ``LLTokenizer``
    llguidance/_lib.pyi     ``LLMatcher.grammar_from_json_schema(schema, defaults=JsonCompileOptions)``
                            (options ``whitespace_flexible``, ``item_separator``, ``key_separator``);
                            ``LLMatcher(tokenizer, grammar, log_level=0)``, which never raises: a bad
                            schema leaves it in an error state, read with ``is_error()`` / ``get_error()``;
                            ``consume_token(token)`` (True for the stop token only in an
                            accepting state: "terminated" here = the stop token was accepted)
    llguidance/torch.py     ``allocate_token_bitmask``, ``fill_next_token_bitmask(matcher, bitmask, 0)``
                            (``unsafe_compute_mask_ptr`` into the int32 row), ``apply_token_bitmask_inplace``
                            (a ``torch.compile``'d kernel: its first call compiles, timed apart as warm-up)
  xgrammar 0.2.8
    xgrammar/tokenizer_info.py  ``TokenizerInfo.from_huggingface(tokenizer, vocab_size=...)``
    xgrammar/compiler.py    ``GrammarCompiler(info, max_threads=..., cache_enabled=False)``,
                            ``compile_json_schema(text, any_whitespace=..., separators=...)`` (raises
                            RuntimeError on a bad schema or regex)
    xgrammar/matcher.py     ``GrammarMatcher(compiled)``, ``fill_next_token_bitmask(bitmask, 0)``,
                            ``accept_token(token)`` (likewise for the stop token), ``allocate_token_bitmask``,
                            ``apply_token_bitmask_inplace`` (on CPU tensors: the C++ kernel of
                            xgrammar/kernels/apply_token_bitmask_inplace_cpu.py)

Run from the repository root on an otherwise idle machine (the full run: ~10 min on 2 cores):
    .venv/bin/python bench/grammar_backends.py --out bench/results/grammar_backends.json
    .venv/bin/python bench/grammar_backends.py --schemas 4 --max-tokens 24     # smoke test
    .venv/bin/python bench/grammar_backends.py --extra-vendored --hostile --out /tmp/gb.json
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import inspect
import json
import multiprocessing as mp
import os
import platform
import resource
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

BACKENDS = ("llguidance", "xgrammar")
# Schemastore schemas vendored by check-jsonschema (check_jsonschema/builtin_schemas/vendor/*.json).
VENDORED = (
    "github-workflows",
    "github-actions",
    "dependabot",
    "readthedocs",
    "github-issue-forms",
    "codecov",
    "citation-file-format",
    "taskfile",
)
PROMPT_SCHEMA_CHARS = 6000
TRIVIAL_SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})


# ----------------------------------------------------------------------------------------------------------
# The two backends behind one small interface.


class CompileError(Exception):
    pass


class LLGuidanceBackend:
    name = "llguidance"

    def __init__(self, hf_tokenizer: Any, vocab_size: int, whitespace: str, threads: int, lenient: bool) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self._llg = llguidance
        self._torch = llguidance.torch
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)
        if whitespace == "compact":
            self.options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        else:
            self.options = {"whitespace_flexible": True}
        if lenient:  # ignore keywords it does not implement and read oneOf as anyOf, as xgrammar does
            self.options.update(lenient=True, coerce_one_of=True)
        self.vocab_size = vocab_size

    def new_compiler(self) -> None:
        return None  # nothing cached across matchers: every LLMatcher builds its grammar from scratch

    def compile(self, schema_text: str, compiler: Any = None) -> Any:
        grammar = self._llg.LLMatcher.grammar_from_json_schema(schema_text, defaults=self.options)
        matcher = self._llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise CompileError(matcher.get_error())
        return matcher

    def allocate(self) -> Any:
        return self._torch.allocate_token_bitmask(1, self.vocab_size)

    def fill(self, matcher: Any, bitmask: Any) -> None:
        self._torch.fill_next_token_bitmask(matcher, bitmask, 0)

    def apply(self, logits: Any, bitmask: Any) -> None:
        self._torch.apply_token_bitmask_inplace(logits, bitmask)

    def accept(self, matcher: Any, token: int) -> bool:
        return matcher.consume_token(token)

    def error(self, matcher: Any) -> str:
        return matcher.get_error()


class XGrammarBackend:
    name = "xgrammar"

    def __init__(self, hf_tokenizer: Any, vocab_size: int, whitespace: str, threads: int, lenient: bool) -> None:
        import xgrammar

        self._xgr = xgrammar
        self.info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size)
        if whitespace == "compact":
            self.options = {"any_whitespace": False, "separators": (", ", ": ")}
        else:
            self.options = {"any_whitespace": True}
        self.vocab_size = vocab_size
        self.threads = threads

    def new_compiler(self) -> Any:
        return self._xgr.GrammarCompiler(self.info, max_threads=self.threads, cache_enabled=False)

    def compile(self, schema_text: str, compiler: Any = None) -> Any:
        compiler = compiler if compiler is not None else self.new_compiler()
        try:
            compiled = compiler.compile_json_schema(schema_text, **self.options)
        except RuntimeError as e:
            raise CompileError(str(e).strip()) from e
        return self._xgr.GrammarMatcher(compiled)

    def allocate(self) -> Any:
        return self._xgr.allocate_token_bitmask(1, self.vocab_size)

    def fill(self, matcher: Any, bitmask: Any) -> None:
        matcher.fill_next_token_bitmask(bitmask, 0)

    def apply(self, logits: Any, bitmask: Any) -> None:
        self._xgr.apply_token_bitmask_inplace(logits, bitmask)

    def accept(self, matcher: Any, token: int) -> bool:
        return matcher.accept_token(token)

    def error(self, matcher: Any) -> str:
        return ""


BACKEND_CLASSES = {"llguidance": LLGuidanceBackend, "xgrammar": XGrammarBackend}


def make_backend(name: str, hf_tokenizer: Any, vocab_size: int, args: argparse.Namespace) -> Any:
    return BACKEND_CLASSES[name](hf_tokenizer, vocab_size, args.whitespace, args.threads, args.llg_lenient)


# ----------------------------------------------------------------------------------------------------------
# Environment, schemas, statistics.


def cpu_info() -> dict[str, Any]:
    model = platform.processor() or "unknown"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        model = next(
            (line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), model
        )
    except (OSError, subprocess.SubprocessError):
        pass
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    return {
        "model_name": model,
        "amx_bf16": "amx_bf16" in flags,
        "avx512f": "avx512f" in flags,
        "logical_cpus": os.cpu_count(),
    }


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in ("llguidance", "xgrammar", "torch", "transformers", "jsonschema"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = "absent"
    return out


def vendored_schemas(names: tuple[str, ...] = VENDORED) -> list[tuple[str, dict]]:
    """Schemastore schemas shipped inside the check-jsonschema package; [] when it is not installed."""
    try:
        from importlib.resources import files

        root = files("check_jsonschema.builtin_schemas.vendor")
    except ModuleNotFoundError:
        print("--extra-vendored: check-jsonschema is not installed; no vendored schemas", file=sys.stderr)
        return []
    out = []
    for name in names:
        path = root / f"{name}.json"
        if path.is_file():
            out.append((f"vendored:{name}", json.loads(path.read_text(encoding="utf-8"))))
    return out


def pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summary(values: list[float]) -> dict[str, Any]:
    return {
        "n": len(values),
        "p50": pct(values, 50),
        "p90": pct(values, 90),
        "p99": pct(values, 99),
        "max": max(values) if values else None,
        "mean": float(np.mean(values)) if values else None,
    }


def fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def load_hf_tokenizer(model: str | None) -> Any:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from cb_serve.model_executor.loader import load_tokenizer, resolve_model_source

    return load_tokenizer(resolve_model_source(model))


def model_vocab_size(model: str | None) -> int:
    from cb_serve.model_executor.loader import load_config, resolve_model_source

    return int(load_config(resolve_model_source(model)).vocab_size)


# ----------------------------------------------------------------------------------------------------------
# 1. Compile, cold, in worker processes.


def _compile_worker(backend_name: str, args: argparse.Namespace, items: list[tuple[str, str]], conn: Any) -> None:
    try:
        hf_tok = load_hf_tokenizer(args.model)
        vocab = model_vocab_size(args.model)
        t = time.perf_counter()
        backend = make_backend(backend_name, hf_tok, vocab, args)
        setup_s = time.perf_counter() - t
        bitmask = backend.allocate()
        backend.fill(backend.compile(TRIVIAL_SCHEMA, backend.new_compiler()), bitmask)  # warm-up, untimed
        conn.send(("ready", setup_s))
        for name, text in items:
            compiler = backend.new_compiler()
            result: dict[str, Any] = {}
            t0 = time.perf_counter()
            try:
                matcher = backend.compile(text, compiler)
                t1 = time.perf_counter()
                backend.fill(matcher, bitmask)
                t2 = time.perf_counter()
                result = {"ok": True, "compile_ms": 1e3 * (t1 - t0), "compile_first_mask_ms": 1e3 * (t2 - t0)}
                if backend.error(matcher):
                    result = {"ok": False, "error": backend.error(matcher), "ms_to_error": 1e3 * (t2 - t0)}
            except Exception as e:  # each library's own error for a schema it refuses
                result = {
                    "ok": False,
                    "error": f"{type(e).__name__}: {e}",
                    "ms_to_error": 1e3 * (time.perf_counter() - t0),
                }
            result["max_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            conn.send(("result", name, result))
            del compiler
    except Exception:
        conn.send(("fatal", traceback.format_exc()))
    finally:
        conn.close()


def measure_compile(backend_name: str, items: list[tuple[str, str]], args: argparse.Namespace) -> dict[str, Any]:
    """Compile every item in worker processes; a timeout or crash is that schema's failure."""
    ctx = mp.get_context("spawn")
    results: dict[str, dict[str, Any]] = {}
    setup_s: float | None = None
    remaining = list(items)
    while remaining:
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_compile_worker, args=(backend_name, args, remaining, child), daemon=True)
        proc.start()
        child.close()
        if not parent.poll(600):
            proc.kill()
            raise RuntimeError(f"{backend_name}: the compile worker did not start in 600 s")
        kind, *payload = parent.recv()
        if kind == "fatal":
            raise RuntimeError(f"{backend_name} compile worker failed:\n{payload[0]}")
        setup_s = payload[0] if setup_s is None else setup_s
        while remaining:
            name = remaining[0][0]
            if not parent.poll(args.compile_timeout):
                proc.kill()
                results[name] = {"ok": False, "error": f"timeout: no result in {args.compile_timeout:g} s"}
                print(f"  {backend_name}: {name}: timed out after {args.compile_timeout:g} s", flush=True)
                remaining.pop(0)
                break
            try:
                kind, *payload = parent.recv()
            except EOFError:
                proc.join(5)
                results[name] = {"ok": False, "error": f"compiler process died (exit code {proc.exitcode})"}
                print(f"  {backend_name}: {name}: the compiler process died ({proc.exitcode})", flush=True)
                remaining.pop(0)
                break
            if kind == "fatal":
                raise RuntimeError(f"{backend_name} compile worker failed:\n{payload[0]}")
            got_name, result = payload
            assert got_name == name, (got_name, name)
            results[name] = result
            remaining.pop(0)
        proc.join(10)
        if proc.is_alive():
            proc.kill()
        parent.close()
    ok = [r for r in results.values() if r["ok"]]
    return {
        "tokenizer_setup_s": setup_s,
        "compile_ms": summary([r["compile_ms"] for r in ok]),
        "compile_first_mask_ms": summary([r["compile_first_mask_ms"] for r in ok]),
        "compiled": len(ok),
        "failed": len(results) - len(ok),
        "per_schema": results,
    }


# ----------------------------------------------------------------------------------------------------------
# 2. Masks on the model's own greedy tokens.


def prompt_ids(tokenizer: Any, name: str, schema: dict) -> list[int]:
    text = json.dumps(schema)
    if len(text) > PROMPT_SCHEMA_CHARS:
        title = schema.get("title") or name
        what = f'a realistic "{title}" document. {schema.get("description", "")}'.strip()
    else:
        what = f"this JSON schema, with realistic values:\n{text}"
    messages = [
        {"role": "system", "content": "You reply with one JSON value and nothing else."},
        {"role": "user", "content": f"Write a JSON instance of {what}"},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def validate(schema: dict, text: str) -> tuple[bool, str]:
    from jsonschema.validators import validator_for

    try:
        instance = json.loads(text)
    except json.JSONDecodeError as e:
        return False, f"not JSON: {e}"
    cls = validator_for(schema)
    errors = sorted(cls(schema, format_checker=cls.FORMAT_CHECKER).iter_errors(instance), key=lambda e: e.path)
    if errors:
        return (
            False,
            f"{len(errors)} error(s), first at /{'/'.join(map(str, errors[0].path))}: {errors[0].message[:200]}",
        )
    return True, ""


def _cache_kwarg(model: Any) -> str:
    """The forward pass's KV-cache keyword: ``cache`` in transformers 5, ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _step(model: Any, token: int, cache: Any, key: str) -> tuple[Any, Any]:
    """One decode step: the (1, vocab) contiguous float32 logits and the cache."""
    import torch

    with torch.inference_mode():
        out = model(input_ids=torch.tensor([[token]]), use_cache=True, **{key: cache})
    return _last_logits(out), getattr(out, key)


def _last_logits(out: Any) -> Any:
    import torch

    # A fresh contiguous normal tensor: llguidance's torch.compile'd apply recompiles on a new stride.
    logits = torch.empty(1, out.logits.shape[-1], dtype=torch.float32)
    logits.copy_(out.logits[:, -1, :])
    return logits


def generate(model: Any, backend: Any, matcher: Any, first_logits: Any, cache: Any, eos: set[int], args) -> dict:
    """Greedy decoding under the backend's mask; also times the mask calls, interleaved with the forward passes."""
    import torch

    bitmask = backend.allocate()
    logits = first_logits.clone()
    fill_us: list[float] = []
    sequence: list[int] = []  # every accepted token, the stop token included
    terminated, error = False, ""
    for step in range(args.max_tokens):
        t0 = time.perf_counter()
        backend.fill(matcher, bitmask)
        fill_us.append(1e6 * (time.perf_counter() - t0))
        backend.apply(logits, bitmask)
        token = int(torch.argmax(logits[0]))
        if not backend.accept(matcher, token):
            error = f"token {token} refused at step {step}: {backend.error(matcher)}"
            break
        sequence.append(token)
        if token in eos:
            terminated = True
            break
        if step + 1 < args.max_tokens:
            logits, cache = _step(model, token, cache, _cache_kwarg(model))
    return {"sequence": sequence, "terminated": terminated, "error": error, "fill_us_interleaved": fill_us}


def replay(backend: Any, schema_text: str, sequence: list[int], base_logits: Any) -> dict[str, list[float]]:
    """The mask calls alone, on a fresh matcher, over the generated sequence: fill, apply (to a copy of real
    logits), accept, each timed apart; no forward pass in between (its worker threads would share the cores)."""
    matcher = backend.compile(schema_text)
    bitmask = backend.allocate()
    logits = base_logits.clone()
    fill_us, apply_us, accept_us = [], [], []
    time.sleep(0.05)  # let the forward pass's OpenMP workers go idle
    for token in sequence:
        logits.copy_(base_logits)
        t0 = time.perf_counter()
        backend.fill(matcher, bitmask)
        t1 = time.perf_counter()
        backend.apply(logits, bitmask)
        t2 = time.perf_counter()
        ok = backend.accept(matcher, token)
        t3 = time.perf_counter()
        if not ok:
            raise RuntimeError(f"{backend.name}: replay refused token {token}")
        fill_us.append(1e6 * (t1 - t0))
        apply_us.append(1e6 * (t2 - t1))
        accept_us.append(1e6 * (t3 - t2))
    return {"fill_us": fill_us, "apply_us": apply_us, "accept_us": accept_us}


def first_divergence(tokenizer: Any, a: list[int], b: list[int]) -> dict[str, Any] | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return {
                "step": i,
                "prefix": tokenizer.decode(a[:i])[-60:],
                BACKENDS[0]: tokenizer.decode([x]),
                BACKENDS[1]: tokenizer.decode([y]),
            }
    return None if len(a) == len(b) else {"step": min(len(a), len(b)), "note": "one sequence is a prefix of the other"}


def measure_generation(
    schemas: list[tuple[str, dict]], compiled_ok: dict[str, set[str]], args: argparse.Namespace
) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from cb_serve.model_executor.loader import resolve_model_source

    tokenizer = load_hf_tokenizer(args.model)
    src = resolve_model_source(args.model)
    model = AutoModelForCausalLM.from_pretrained(src.path, dtype=torch.float32, **src.hf_kwargs()).eval()
    vocab = int(model.config.vocab_size)
    eos = {int(tokenizer.eos_token_id)}
    backends = {name: make_backend(name, tokenizer, vocab, args) for name in BACKENDS}

    apply_warmup_s = {}
    for name, backend in backends.items():  # llguidance's apply is torch.compile'd: its first call compiles
        logits, bitmask = torch.randn(1, vocab), backend.allocate()
        t = time.perf_counter()
        backend.apply(logits, bitmask)
        apply_warmup_s[name] = time.perf_counter() - t
        for _ in range(3):
            backend.apply(logits, bitmask)

    key = _cache_kwarg(model)
    per_schema: dict[str, dict[str, Any]] = {name: {} for name in BACKENDS}
    for i, (sname, schema) in enumerate(schemas):
        schema_text = json.dumps(schema)
        ids = prompt_ids(tokenizer, sname, schema)
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([ids]), use_cache=True)
        first_logits, prefill_cache = _last_logits(out), getattr(out, key)
        sequences = {}
        for bname, backend in backends.items():
            if sname not in compiled_ok[bname]:
                per_schema[bname][sname] = {"skipped": "did not compile"}
                continue
            matcher = backend.compile(schema_text)
            r = generate(model, backend, matcher, first_logits, copy.deepcopy(prefill_cache), eos, args)
            r.update(replay(backend, schema_text, r["sequence"], first_logits))
            body = r["sequence"][:-1] if r["terminated"] else r["sequence"]
            text = tokenizer.decode(body)
            valid, why = validate(schema, text) if r["terminated"] else (None, "")
            sequences[bname] = r["sequence"]
            r.update(text=text, n_tokens=len(r["sequence"]), valid=valid, invalid_reason=why, prompt_tokens=len(ids))
            per_schema[bname][sname] = r
        same = len(sequences) == len(BACKENDS) and len({tuple(s) for s in sequences.values()}) == 1
        divergence = first_divergence(tokenizer, *sequences.values()) if len(sequences) == 2 else None
        for bname in sequences:
            per_schema[bname][sname].update(same_tokens_as_other_backend=same, first_divergence=divergence)
        print(
            f"  [{i + 1}/{len(schemas)}] {sname}: "
            + "; ".join(
                f"{b} {r.get('n_tokens', 0)} tok"
                + (" term" if r.get("terminated") else "")
                + (" valid" if r.get("valid") else " INVALID" if r.get("valid") is False else "")
                for b, r in ((b, per_schema[b][sname]) for b in BACKENDS)
            )
            + ("; same tokens" if same else ""),
            flush=True,
        )

    result: dict[str, Any] = {}
    for bname in BACKENDS:
        runs = [r for r in per_schema[bname].values() if "skipped" not in r]
        terminated = [r for r in runs if r["terminated"]]
        result[bname] = {
            "schemas_run": len(runs),
            "tokens": sum(r["n_tokens"] for r in runs),
            "fill_us": summary([x for r in runs for x in r["fill_us"]]),
            "fill_us_interleaved": summary([x for r in runs for x in r["fill_us_interleaved"]]),
            "apply_us": summary([x for r in runs for x in r["apply_us"]]),
            "accept_us": summary([x for r in runs for x in r["accept_us"]]),
            "apply_warmup_s": apply_warmup_s[bname],
            "terminated": len(terminated),
            "valid": sum(1 for r in terminated if r["valid"]),
            "refused_tokens": sum(1 for r in runs if r["error"]),
            "per_schema": per_schema[bname],
        }
    return result


# ----------------------------------------------------------------------------------------------------------
# Report.


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return out + ["| " + " | ".join(row) + " |" for row in rows]


def report(res: dict[str, Any]) -> str:
    cpu = res["cpu"]
    amx = "yes" if cpu["amx_bf16"] else "no"
    lines = [
        f"CPU: {cpu['model_name']} ({cpu['logical_cpus']} logical CPUs), amx_bf16: {amx}",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in res["versions"].items()),
        f"Settings: {json.dumps(res['settings'])}",
        "",
        "Compile, cold (schema text -> ready matcher; ms over the schemas that compiled):",
        "",
    ]
    rows = []
    for b, c in res["compile"].items():
        s, f = c["compile_ms"], c["compile_first_mask_ms"]
        rows.append(
            [b, str(c["compiled"] + c["failed"]), str(c["compiled"]), str(c["failed"])]
            + [fmt(s[k], 2) for k in ("p50", "p90", "p99", "max")]
            + [fmt(f[k], 2) for k in ("p50", "p99", "max")]
            + [fmt(c["tokenizer_setup_s"], 2)]
        )
    header = ["backend", "schemas", "compiled", "failed", "p50", "p90", "p99", "max"]
    lines += table(header + ["+first mask p50", "p99", "max", "tokenizer setup s"], rows)
    gen = res.get("generation", {})
    if gen:
        lines += [
            "",
            f"Masks over the model's greedy tokens (µs per call; up to {res['settings']['max_tokens']} tokens "
            "per schema). Replayed on a fresh matcher with no forward pass between the calls; 'fill, "
            "interleaved' is the fill timed during generation, right after each forward pass:",
            "",
        ]
        rows = []
        for b, g in gen.items():
            rows.append(
                [b, str(g["schemas_run"]), str(g["tokens"])]
                + [fmt(g[m][k]) for m in ("fill_us", "accept_us", "apply_us") for k in ("p50", "p99", "max")]
                + [fmt(g["apply_warmup_s"], 2), fmt(g["fill_us_interleaved"]["p50"])]
                + [fmt(g["fill_us_interleaved"]["p99"]), f"{g['terminated']}/{g['schemas_run']}"]
                + [f"{g['valid']}/{g['terminated']}"]
            )
        header = ["backend", "schemas", "tokens"]
        header += [f"{m} {k}" for m in ("fill", "accept", "apply") for k in ("p50", "p99", "max")]
        header += ["apply warm-up s", "fill, interleaved p50", "p99", "terminated", "valid / terminated"]
        lines += table(header, rows)
    lines += [
        "",
        "Per schema (compile ms, cold; tokens generated, T = terminated, V = validates; "
        "same = identical token ids from both backends):",
        "",
    ]
    rows = []
    for name in res["schema_names"]:
        row, same = [name], "-"
        for b in BACKENDS:
            c = res["compile"][b]["per_schema"].get(name, {})
            row.append(fmt(c.get("compile_ms"), 2) if c.get("ok") else "FAIL")
            g = gen.get(b, {}).get("per_schema", {}).get(name)
            if not g or "skipped" in g:
                row.append("-")
                continue
            flag = ("T" if g["terminated"] else "") + ("V" if g["valid"] else "")
            row.append(f"{g['n_tokens']} {flag}".strip())
            same = "yes" if g.get("same_tokens_as_other_backend") else "no"
        rows.append(row + [same])
    lines += table(["schema"] + [f"{b} {what}" for b in BACKENDS for what in ("compile ms", "tokens")] + ["same"], rows)
    failures = [
        (b, n, r["error"]) for b, c in res["compile"].items() for n, r in c["per_schema"].items() if not r["ok"]
    ]
    for b, g in gen.items():
        for n, r in g["per_schema"].items():
            if r.get("error"):
                failures.append((b, n, f"generation: {r['error']}"))
            elif r.get("valid") is False:
                failures.append((b, n, f"output does not validate: {r['invalid_reason']}"))
    if failures:
        lines += ["", "Failures:"] + [f"- {b} / {n}: {e[:400]}" for b, n, e in failures]
    if res.get("hostile"):
        lines += ["", "Hostile schemas (compile only; ms to a matcher or to the error):", ""]
        rows = []
        for name in res["hostile"][BACKENDS[0]]["per_schema"]:
            row = [name]
            for b in BACKENDS:
                r = res["hostile"][b]["per_schema"][name]
                if r["ok"]:
                    row.append(
                        f"compiled: {fmt(r['compile_ms'], 1)} ms (+first mask {fmt(r['compile_first_mask_ms'], 1)})"
                    )
                else:
                    took = f" after {fmt(r['ms_to_error'], 1)} ms" if "ms_to_error" in r else ""
                    row.append(f"refused{took}: {r['error'][:120]}".replace("\n", " ").replace("|", "/"))
            rows.append(row)
        lines += table(["schema", *BACKENDS], rows)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--schemas", type=int, default=None, help="only the first N schemas of the suite")
    p.add_argument("--max-tokens", type=int, default=96, help="tokens generated per schema and backend")
    p.add_argument("--extra-vendored", action="store_true", help="add schemastore schemas vendored by check-jsonschema")
    p.add_argument("--hostile", action="store_true", help="also compile HOSTILE_SCHEMAS (reported apart)")
    p.add_argument("--compile-only", action="store_true", help="skip the generation (mask) phase")
    p.add_argument("--compile-timeout", type=float, default=120.0, help="seconds per schema in the compile phase")
    p.add_argument("--whitespace", choices=("compact", "flexible"), default="compact")
    p.add_argument(
        "--llg-lenient",
        action="store_true",
        help="llguidance: ignore keywords it does not implement (not, if/then/else, uniqueItems...) and read oneOf "
        "as anyOf, as xgrammar does silently; by default it refuses such schemas",
    )
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="xgrammar compiler threads")
    p.add_argument("--model", default=None, help="model for tokenizer and generation (default: the built-in)")
    p.add_argument("--out", type=Path, default=None, help="write the JSON result here")
    args = p.parse_args(argv)

    from schemas import HOSTILE_SCHEMAS, SCHEMAS

    schemas = list(SCHEMAS[: args.schemas] if args.schemas is not None else SCHEMAS)
    if args.extra_vendored:
        schemas += vendored_schemas()
    res: dict[str, Any] = {
        "cpu": cpu_info(),
        "versions": versions(),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("out",)},
        "schema_names": [n for n, _ in schemas],
    }
    print(f"CPU: {res['cpu']['model_name']}, amx_bf16: {res['cpu']['amx_bf16']}; {len(schemas)} schemas", flush=True)
    items = [(n, json.dumps(s)) for n, s in schemas]
    res["compile"], res["wall_s"] = {}, {}
    t = time.perf_counter()
    for b in BACKENDS:
        print(f"compile, cold: {b}", flush=True)
        res["compile"][b] = measure_compile(b, items, args)
    res["wall_s"]["compile"] = time.perf_counter() - t
    if args.hostile:
        res["hostile"] = {}
        hostile_items = [(n, json.dumps(s)) for n, s in HOSTILE_SCHEMAS]
        for b in BACKENDS:
            print(f"compile, hostile schemas: {b}", flush=True)
            res["hostile"][b] = measure_compile(b, hostile_items, args)
    if not args.compile_only:
        print("masks on generated tokens", flush=True)
        ok = {b: {n for n, r in res["compile"][b]["per_schema"].items() if r["ok"]} for b in BACKENDS}
        t = time.perf_counter()
        res["generation"] = measure_generation(schemas, ok, args)
        res["wall_s"]["generation"] = time.perf_counter() - t
    text = report(res)
    print()
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1) + "\n")
        print(f"\nwrote {args.out}")
    return res


if __name__ == "__main__":
    main()
