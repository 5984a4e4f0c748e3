"""Warm-up forward passes at start-up, one per shape class of a prefill step, so that the first
requests do not wait for the attention kernels' just-in-time compilation: Triton compiles one
kernel per set of compile-time constants (its query-tile size follows the longest query of the
step, and a split-KV variant runs where there are few tiles), each on its first launch. Decode
steps are warmed by the CUDA-graph capture; mixed steps (decode rows beside a prefill chunk) here, and a
decode row and a prefill chunk at the longest context (their KV split over several programs), which
eager steps meet (models run without graphs, long decode rows beside a prefill). Nothing else about a
batch picks a variant: ``attention/triton_kernels.py`` keeps the batch-dependent arguments out of
Triton's specialization, and the staged inputs are aligned (``step_batch.aligned_offsets``)."""

from __future__ import annotations

import numpy as np
import torch

from cb_serve.model_executor.model_runner import ModelRunner
from cb_serve.model_executor.step_batch import StepBatch


def warm_up_query_lens(max_num_tokens: int, max_model_len: int) -> list[list[int]]:
    """The batches to run, as each row's query length (decode rows, of length 1, first): short,
    middling and long single prompts, the longest the token budget and context allow, and a mixed
    step of two decode rows and a prefill chunk."""
    longest = min(max_num_tokens, max_model_len)
    singles = sorted({min(n, longest) for n in (7, 33, 130, longest)})
    mixed = [1, 1, min(24, max(1, max_num_tokens - 2))]
    return [[n] for n in singles] + ([mixed] if max_num_tokens >= 3 else [])


def warm_up_long_contexts(max_num_tokens: int) -> list[list[int]]:
    """The batches to run at the longest context: a decode row and a prefill chunk whose KV ranges are
    long enough to be split over several programs (the split variants; the ones above are too short)."""
    return [[1], [min(24, max_num_tokens)]]


def dummy_batch(
    query_lens: list[int],
    block_size: int,
    num_blocks: int,
    max_model_len: int,
    num_groups: int = 1,
    context: int | None = None,
) -> StepBatch:
    """A step over made-up rows: each row has as much context as its query (a decode row: 16 tokens
    before it), or ``context`` tokens in all (at most ``max_model_len``), in blocks 0, 1, ... (rows share
    them, and a row longer than the pool wraps around it: the KV written is garbage, overwritten before
    any request reads it, as every block's is; every KV-cache group the same) and samples its last token."""
    num_decodes = sum(1 for n in query_lens if n == 1)
    seq_lens = [min(max_model_len, max(n, context or (17 if n == 1 else n))) for n in query_lens]
    width = -(-max(seq_lens) // block_size)  # blocks past the pool's wrap around (a sliding model's may be small)
    q = np.asarray(query_lens, dtype=np.int64)
    cu_q = np.concatenate([[0], np.cumsum(q)])
    cu_k = np.concatenate([[0], np.cumsum(seq_lens)])
    row = np.repeat(np.arange(len(q)), q)
    positions = np.arange(cu_q[-1]) - cu_q[:-1][row] + (np.asarray(seq_lens) - q)[row]
    arrays = {
        "input_ids": np.zeros(cu_q[-1], dtype=np.int64),
        "positions": positions,
        "slot_mappings": np.tile(positions % (num_blocks * block_size), (num_groups, 1)),  # block i: i % num_blocks
        "logits_indices": cu_q[1:] - 1,
        "cu_seqlens_q": cu_q,
        "cu_seqlens_k": cu_k,
        "seqused_k": np.asarray(seq_lens),
        "block_tables": np.tile(np.arange(width) % num_blocks, (num_groups, len(q), 1)),
        "state_slots": np.full(len(q), -1, dtype=np.int32),  # recurrent layers: the scratch slot (the last)
    }
    return StepBatch(num_decodes, list(query_lens), seq_lens, arrays)


@torch.inference_mode()
def warm_up(runner: ModelRunner, max_num_tokens: int, max_model_len: int) -> None:
    """Runs ``runner``'s forward pass and logits on each of ``warm_up_query_lens``'s batches (one
    rank: tensor-parallel ranks would each have to run the same batches in step)."""
    shapes = [(q, None) for q in warm_up_query_lens(max_num_tokens, max_model_len)]
    shapes += [(q, max_model_len) for q in warm_up_long_contexts(max_num_tokens)]
    for query_lens, context in shapes:
        num_groups = len(runner.kv_layout.groups)
        batch = dummy_batch(query_lens, runner.block_size, runner.num_blocks, max_model_len, num_groups, context)
        if runner.lora is not None:  # every row on the base model
            rows = np.repeat(np.arange(len(query_lens)), query_lens)
            runner.lora.set_active_loras([None] * len(query_lens), rows, runner.device)
        runner.compute_logits(runner.to_device(batch))
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
