"""The benchmarks' seeded workload: real-text prompts, output lengths and (for serving) arrival times.

Prompts are windows of uniform length in ``PROMPT_LEN_RANGE`` tokens, cut at seeded random offsets from a
corpus of Python standard-library docstrings tokenized with the model's tokenizer; output lengths are
uniform in ``OUTPUT_LEN_RANGE``. The same ``seed`` gives the same workload (compare ``Workload.digest``).
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import math
import random
import statistics
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

# Standard-library modules whose docstrings (module, then public classes and functions by name) form the corpus.
CORPUS_MODULES = (
    "argparse",
    "asyncio",
    "collections",
    "concurrent.futures",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "email.message",
    "enum",
    "fractions",
    "functools",
    "heapq",
    "http.client",
    "inspect",
    "itertools",
    "json",
    "logging",
    "os",
    "pathlib",
    "pickle",
    "random",
    "re",
    "shutil",
    "socket",
    "statistics",
    "string",
    "subprocess",
    "tarfile",
    "textwrap",
    "threading",
    "typing",
    "unittest",
    "urllib.parse",
    "zipfile",
)
PROMPT_LEN_RANGE = (32, 512)
OUTPUT_LEN_RANGE = (16, 256)


def corpus_text() -> str:
    """Deterministic real English/technical text: stdlib docstrings in a fixed order."""
    parts: list[str] = []
    for name in CORPUS_MODULES:
        module = importlib.import_module(name)
        if doc := inspect.getdoc(module):
            parts.append(doc)
        for attr in sorted(vars(module)):
            obj = getattr(module, attr)
            is_api = inspect.isclass(obj) or inspect.isfunction(obj) or inspect.isbuiltin(obj)
            if attr.startswith("_") or not is_api or getattr(obj, "__module__", None) != module.__name__:
                continue
            if doc := inspect.getdoc(obj):
                parts.append(doc)
    return "\n\n".join(parts)


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]
    corpus_tokens: int
    digest: str  # sha256 of the prompts and output lengths, to compare runs

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)

    def summary(self) -> dict[str, Any]:
        lens = [len(p) for p in self.prompts]
        return {
            "num_requests": self.num_requests,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "prompt_len_mean": statistics.fmean(lens),
            "prompt_len_min": min(lens),
            "prompt_len_max": max(lens),
            "output_len_mean": statistics.fmean(self.output_lens),
            "output_len_min": min(self.output_lens),
            "output_len_max": max(self.output_lens),
            "corpus_tokens": self.corpus_tokens,
            "digest": self.digest,
        }


def make_workload(tokenizer, num_requests: int, seed: int) -> Workload:
    """``num_requests`` prompts and output lengths, fixed by ``seed``."""
    corpus = tokenizer(corpus_text(), add_special_tokens=False)["input_ids"]
    if len(corpus) <= PROMPT_LEN_RANGE[1]:
        raise RuntimeError(f"The corpus has only {len(corpus)} tokens.")
    rng = random.Random(seed)
    prompts, output_lens = [], []
    for _ in range(num_requests):
        length = rng.randint(*PROMPT_LEN_RANGE)
        offset = rng.randrange(len(corpus) - length + 1)
        prompts.append(list(corpus[offset : offset + length]))
        output_lens.append(rng.randint(*OUTPUT_LEN_RANGE))
    digest = hashlib.sha256(json.dumps([prompts, output_lens]).encode()).hexdigest()[:16]
    return Workload(prompts, output_lens, len(corpus), digest)


def warmup_prompt(workload: Workload) -> list[int]:
    """A short prompt for the untimed warmup request."""
    return workload.prompts[0][:16]


def capped_output_lens(workload: Workload, max_output_len: int) -> list[int]:
    return [min(n, max_output_len) for n in workload.output_lens]


# ---- arrival traces (serving) ----------------------------------------------------------------------------------
def arrival_gaps(num_requests: int, rate: float, seed: int) -> list[float]:
    """Seconds between consecutive arrivals (the first: after the start): exponential gaps (a Poisson
    process) at ``rate``/s."""
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    return [rng.expovariate(rate) for _ in range(num_requests)]


def arrival_times(num_requests: int, rate: float, seed: int) -> list[float]:
    """Each request's arrival, seconds after the start: the trace both systems serve."""
    return list(accumulate(arrival_gaps(num_requests, rate, seed)))
