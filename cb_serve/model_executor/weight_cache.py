"""Disk caches of what loading a GGUF model recomputes identically each time: the test suite and every
Ray Serve replica load the same files many times, and two steps dominate the load:

- transformers dequantizing the GGUF file into float weights (``gguf_state_dict``): kept as a safetensors
  file beside the parsed config and tokenizer (``gguf_cache``), keyed by the file's path, size and
  modification time and the dtype, and read back lazily (``checkpoint.LazyCheckpoint``);
- recovering a dequantized weight's 4- or 8-bit groups (``exact_quant.find_quant_groups``, for the low-bit
  GEMM kernels; for Gemma's Q4_K weights even the probe of a weight's first rows takes about a second): kept
  per weight, keyed by a hash of its bytes (content-addressed: no entry goes stale), found or not. Only
  inside ``cached_quant_groups()`` (the loader's, for GGUF models): hashing a large float model's every
  weight would cost more than the probe that rejects it.

Under ``$CB_SERVE_CACHE_DIR`` (default ``~/.cache/cb_serve/gguf``; empty: off). Entries are written whole
(a temporary name renamed into place); one that fails to read is recomputed and replaced."""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import logging
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch

from cb_serve.cpu_ops import exact_quant
from cb_serve.model_executor import gguf_cache
from cb_serve.model_executor.layers.checkpoint import LazyCheckpoint
from cb_serve.model_executor.layers.linear import quant_groups_from

logger = logging.getLogger(__name__)
WEIGHTS = "model.safetensors"


def _write_atomically(path: Path, write: Callable[[str], None]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, scratch = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        os.close(fd)
        write(scratch)
        os.replace(scratch, path)
    except OSError as e:  # a read-only or full disk: go on without the cache
        logger.warning("could not cache %s: %s", path, e)


_CACHED = contextvars.ContextVar("cb_serve_cached_quant_groups", default=False)


@contextlib.contextmanager
def cached_quant_groups() -> Iterator[None]:
    """Within it, ``find_quant_groups`` reads and writes the disk cache, and ``Linear.prepare_for_cpu`` finds
    a weight's groups through it."""
    token = _CACHED.set(True)
    try:
        with quant_groups_from(find_quant_groups):
            yield
    finally:
        _CACHED.reset(token)


def find_quant_groups(weight: torch.Tensor) -> exact_quant.QuantGroups | None:
    """``exact_quant.find_quant_groups(weight)``, from the cache where an earlier load looked for them."""
    root = gguf_cache.cache_root()
    cacheable = weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
    if root is None or not _CACHED.get() or not cacheable:
        return exact_quant.find_quant_groups(weight)
    from safetensors.torch import load_file, save_file

    data = weight.detach().contiguous()
    digest = hashlib.blake2b(repr((tuple(data.shape), str(data.dtype))).encode(), digest_size=20)
    digest.update(memoryview(data.numpy()).cast("B"))
    path = root / "quant-groups" / f"{digest.hexdigest()}.safetensors"
    if path.is_file():
        try:
            parts = load_file(str(path))
            gguf_cache.mark_used(path)
            return exact_quant.QuantGroups(parts["q"], parts["d"], parts.get("m")) if parts else None
        except Exception as e:  # noqa: BLE001 - a damaged entry: recompute and replace it
            logger.warning("the cached quantization groups at %s did not load (%s)", path, e)
    groups = exact_quant.find_quant_groups(weight)
    parts = {} if groups is None else {"q": groups.q, "d": groups.d}
    if groups is not None and groups.m is not None:
        parts["m"] = groups.m
    _write_atomically(path, lambda scratch: save_file({k: v.contiguous() for k, v in parts.items()}, scratch))
    return groups


def gguf_state_dict(
    stamp: tuple[str, int, int] | None, dtype: torch.dtype, load: Callable[[], Mapping[str, torch.Tensor]]
) -> Mapping:
    """``load()`` (the HF state dict transformers makes of a GGUF file), or the cached copy of it, read lazily.
    Tensors sharing memory (tied embeddings) are kept once, under their first name."""
    from safetensors.torch import save_file

    def save(state: Mapping[str, torch.Tensor], directory: str) -> None:
        seen, unique = set(), {}
        for name, tensor in state.items():
            if tensor.data_ptr() not in seen:
                seen.add(tensor.data_ptr())
                unique[name] = tensor.contiguous()
        save_file(unique, str(Path(directory) / WEIGHTS))

    def reload(directory: str) -> Mapping:
        return LazyCheckpoint([Path(directory) / WEIGHTS], dtype)

    return gguf_cache.cached(stamp, f"weights-{str(dtype).removeprefix('torch.')}", load, save, reload)
