"""Issue 51 (7): no Triton compile after start-up, checked without a GPU. The staged step inputs start
aligned whatever the batch size; the kernels keep the batch-dependent arguments (a block table's width,
the KV splits, the index arrays read one element at a time) out of Triton's specialization; warm-up
runs the split-KV classes too; and the compile counter reads each kernel's per-device cache."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest

from cb_serve.model_executor import jit_compiles
from cb_serve.model_executor.step_batch import INT32_FIELDS, INT64_FIELDS, aligned_offsets
from cb_serve.model_executor.warm_up import dummy_batch, warm_up_long_contexts

triton_kernels = pytest.importorskip("cb_serve.attention.triton_kernels")
pytestmark = pytest.mark.skipif(triton_kernels.triton is None, reason="needs triton")

UNSPECIALIZED = {
    "_write_kv_kernel": ((), triton_kernels.WRITE_KV_UNSPECIALIZED_ALIGNMENT),
    "_paged_attention_kernel": (
        triton_kernels.ATTENTION_UNSPECIALIZED,
        triton_kernels.ATTENTION_UNSPECIALIZED_ALIGNMENT,
    ),
    "_combine_splits_kernel": (triton_kernels.COMBINE_UNSPECIALIZED, triton_kernels.COMBINE_UNSPECIALIZED_ALIGNMENT),
}


def test_every_staged_field_starts_aligned_at_any_batch_size():
    for rows in [*range(1, 40), 64, 255, 256, 257]:
        check_aligned(rows, width=1 + rows % 7)


def check_aligned(rows: int, width: int) -> None:
    sizes = {  # a decode step of ``rows`` sequences, in a model of three KV-cache groups
        "input_ids": rows, "positions": rows, "slot_mappings": 3 * rows, "logits_indices": rows,
        "cu_seqlens_q": rows + 1, "cu_seqlens_k": rows + 1, "seqused_k": rows,
        "block_tables": 3 * rows * width, "state_slots": rows, "prev_token_index": rows, "prev_token_rows": rows,
    }  # fmt: skip
    for fields, itemsize in ((INT64_FIELDS, 8), (INT32_FIELDS, 4)):
        offsets, total = aligned_offsets([sizes[f] for f in fields])
        ends = [o + sizes[f] for o, f in zip(offsets, fields)]
        assert all(o * itemsize % 64 == 0 for o in offsets), "each field starts 64-byte aligned"
        assert all(end <= nxt for end, nxt in zip(ends, offsets[1:])) and ends[-1] <= total, "no overlap"
        assert total - sum(sizes[f] for f in fields) < 16 * len(fields)


def test_the_unspecialized_arguments_are_the_kernels_parameters():
    for name, (ints, pointers) in UNSPECIALIZED.items():
        fn = getattr(triton_kernels, name)
        params = inspect.signature(getattr(fn, "fn", fn)).parameters  # the interpreter's wrapper keeps .fn
        assert set(ints) | set(pointers) <= set(params), name


def test_the_compiled_kernels_leave_them_unspecialized():
    """Under the real JIT (no interpreter: a subprocess), each kernel's parameters carry the flags."""
    names = list(UNSPECIALIZED)
    code = (
        "import json, sys\n"
        "from cb_serve.attention import triton_kernels as k\n"
        "print(json.dumps({n: [[p.name for p in getattr(k, n).params if p.do_not_specialize],"
        " [p.name for p in getattr(k, n).params if p.do_not_specialize_on_alignment]] for n in sys.argv[1:]}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code, *names], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    flags = json.loads(out.stdout)
    for name, (ints, pointers) in UNSPECIALIZED.items():
        assert flags[name] == [list(ints), list(pointers)], name


def test_warm_up_reaches_the_split_kv_classes():
    """The long-context batches put a decode row and a prefill chunk at the end of the longest context
    (their KV is what gets split), in blocks the KV cache has."""
    assert warm_up_long_contexts(2048) == [[1], [24]] and warm_up_long_contexts(8) == [[1], [8]]
    for query_lens in warm_up_long_contexts(64):
        batch = dummy_batch(query_lens, block_size=16, num_blocks=64, max_model_len=1024, num_groups=2, context=1024)
        assert batch.seq_lens == [1024]
        positions = batch.arrays["positions"]
        assert positions[-1] == 1023 and len(positions) == query_lens[0]
        assert batch.arrays["block_tables"].shape == (2, 1, 64)
        assert (batch.arrays["slot_mappings"] // 16 < 64).all()
    small_pool = dummy_batch([1], block_size=16, num_blocks=8, max_model_len=1024, context=1024)  # all sliding
    assert small_pool.arrays["block_tables"].max() < 8 and small_pool.arrays["slot_mappings"].max() < 8 * 16
    short = dummy_batch([1, 1, 24], block_size=16, num_blocks=64, max_model_len=1024)
    assert short.seq_lens == [17, 17, 24]  # the classes before: unchanged


def test_the_compile_counter_reads_each_kernels_device_cache(monkeypatch):
    assert jit_compiles.num_triton_compiles() == 0  # interpreted, or not imported: nothing compiled here

    class Compiled:  # a JITFunction's shape since Triton 3.3: device -> (kernel cache, ...)
        def __init__(self, counts: list[int]) -> None:
            self.device_caches = {d: ({i: None for i in range(n)}, {}, None) for d, n in enumerate(counts)}

    fake = types.ModuleType("fake_kernels")
    fake.a, fake.b, fake.not_a_kernel = Compiled([2, 1]), Compiled([3]), np.zeros(3)
    monkeypatch.setitem(sys.modules, jit_compiles.KERNEL_MODULES[1], fake)
    assert jit_compiles.num_triton_compiles() == 6


def test_before_triton_3_2_pointers_leave_alignment_out_through_do_not_specialize(monkeypatch):
    def old_jit(fn=None, *, version=None, do_not_specialize=None, debug=None, noinline=None):  # Triton 3.0's keywords
        return fn

    assert triton_kernels.jit_options(("n",), ("p",)) == {
        "do_not_specialize": ("n",),
        "do_not_specialize_on_alignment": ("p",),
    }
    monkeypatch.setattr(triton_kernels.triton, "jit", old_jit)
    assert triton_kernels.jit_options(("n",), ("p",)) == {"do_not_specialize": ("n", "p")}
