"""How many KV-cache blocks an engine gets: from explicit settings, the CPU default, or what is
left of the device's memory after the weights and one step's activations."""

from __future__ import annotations

import gc

import torch

from cb_serve.config import EngineConfig
from cb_serve.config.layer_configs import kv_widths
from cb_serve.config.speculative import SpeculativeConfig
from cb_serve.kv_cache_interface import KVCacheLayout

CPU_DEFAULT_KV_CACHE_BYTES = 1 << 30


def kv_cache_bytes_per_block(
    hf_config, block_size: int, dtype: torch.dtype, layout: KVCacheLayout | None = None
) -> int:
    """One block id's bytes: a page of each of ``layout.group_size`` KV tensors (default: of every layer),
    each as wide as its widest layer (Gemma 4's layers differ, ``layer_configs``)."""
    widths = kv_widths(hf_config)
    tensors = range(len(widths)) if layout is None else layout.layer_tensors
    widest: dict[int, int] = {}
    for j, width in zip(tensors, widths):
        widest[j] = max(widest.get(j, 0), width)
    per_token = 2 * sum(widest.values())
    return per_token * block_size * torch.empty((), dtype=dtype).element_size()


def mtp_bytes_per_block(model, block_size: int, dtype: torch.dtype) -> int:
    """One block id's bytes in the KV cache of the checkpoint's MTP layers (``model.mtp``; 0 without them)."""
    mtp = getattr(model, "mtp", None)
    if mtp is None:
        return 0
    per_token = sum(2 * layer.self_attn.num_kv_heads * layer.self_attn.head_dim for layer in mtp.layers)
    return per_token * block_size * torch.empty((), dtype=dtype).element_size()


# Bytes per logit while the sampler runs, at its widest (a top-p step): the float32 logits, their
# log-softmax, the temperature-scaled and filtered copies, top-p's sorted values (4) and int64 order
# (8) with their softmax and cumulative sum, the drop masks and the uniform draws.
SAMPLER_BYTES_PER_LOGIT = 48
STEP_SLACK_BYTES = 512 << 20  # CUDA graphs' pool, kernel workspaces (cuBLAS), allocator slack


def logit_rows(config: EngineConfig) -> int:
    """The most logit rows one step samples: one per running sequence, and with speculative
    decoding one per draft position as well."""
    spec = config.speculative_config
    k = SpeculativeConfig.from_dict(spec).num_speculative_tokens if spec else 0
    return config.max_num_seqs * (1 + k)


def activation_bytes(hf_config, config: EngineConfig, dtype_size: int) -> int:
    """Upper bound on one step's transient memory: the widest activations of a full token budget
    (hidden state, fused q/k/v and gate/up outputs), the logits of every row the step samples
    (``logit_rows``) with the sampler's working set on them, and ``STEP_SLACK_BYTES``. The KV
    cache gets what is left; ``bench/gpu_check.sh`` measures a step's peak against this."""
    tokens = config.max_num_batched_tokens
    per_token = (4 * hf_config.hidden_size + 3 * hf_config.intermediate_size) * dtype_size
    logits = logit_rows(config) * hf_config.vocab_size * SAMPLER_BYTES_PER_LOGIT
    return tokens * per_token + logits + STEP_SLACK_BYTES


def encoder_bytes(mm_config, config: EngineConfig, dtype_size: int, capacity: int, batch: int) -> int:
    """Upper bound on what a model that reads images holds beside a step's activations (CUDA sizing): the
    encoder cache full (``capacity`` embeddings as wide as the text model) and one encoder call's activations,
    ``batch`` images of the most patches an image can have, each patch's widest activations (residual, q/k/v,
    MLP; the towers' attention is ``scaled_dot_product_attention``, whose CUDA kernels keep no score matrix).
    An image's patches: a fixed square (``image_size / patch_size``, SigLIP), else (patch grids of any size,
    Qwen3-VL) at most one step's token budget of merged tokens, ``spatial_merge_size ** 2`` patches each (an
    image's tokens are computed in one step)."""
    vision, text = mm_config.vision_config, getattr(mm_config, "text_config", mm_config)
    if getattr(vision, "image_size", None):
        patches = (vision.image_size // vision.patch_size) ** 2
    else:
        patches = config.max_num_batched_tokens * vision.spatial_merge_size**2
    per_patch = (4 * vision.hidden_size + 3 * vision.intermediate_size) * dtype_size
    return capacity * text.hidden_size * dtype_size + batch * patches * per_patch


def cuda_kv_cache_bytes(free: int, total: int, utilization: float, activations: int) -> int:
    """KV-cache bytes on a device with ``free`` of ``total`` bytes free (after loading the model):
    the engine may use ``utilization * total`` in all, of which other processes' and our own
    current use (``total - free``) and the step's ``activations`` are taken first."""
    budget = min(free, utilization * total - (total - free)) - activations
    return max(0, int(budget))


def free_device_memory(device: torch.device) -> tuple[int, int]:
    """``(free, total)`` bytes of a CUDA device, once unreachable tensors are freed and the caching
    allocator has handed back the blocks it merely keeps (the loader's temporaries): ``mem_get_info``
    asks the driver, which counts cached blocks as used."""
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)


def num_kv_blocks(
    config: EngineConfig,
    hf_config,
    block_size: int,
    max_model_len: int,
    kv_cache_dtype: torch.dtype,
    dtype: torch.dtype,
    device: torch.device,
    mirror_bytes_per_block: int = 0,
    layout: KVCacheLayout | None = None,
    state_bytes: int = 0,
    encoder: int = 0,
) -> int:
    """``num_gpu_blocks``, else ``kv_cache_memory``, else (CUDA) free device memory, else 1 GiB, less
    ``state_bytes`` (recurrent layers' state slots, ``engine/state_slots.py``), in blocks;
    raises if that cannot hold one ``max_model_len`` sequence (in each KV-cache group of ``layout``:
    a sliding group holds only its window and a step's chunk). ``mirror_bytes_per_block``: a second
    cache with as many blocks shares the memory (a draft model's, ``spec_decode.draft_model``); ``encoder``:
    the images' memory (``encoder_bytes``), taken from free device memory with the step's activations."""
    layout = layout or KVCacheLayout.from_windows([None] * hf_config.num_hidden_layers)
    per_block = kv_cache_bytes_per_block(hf_config, block_size, kv_cache_dtype, layout) + mirror_bytes_per_block
    if config.num_gpu_blocks:
        num = config.num_gpu_blocks
    elif config.kv_cache_memory:
        num = max(0, config.kv_cache_memory - state_bytes) // per_block
    elif device.type == "cuda":
        free, total = free_device_memory(device)
        activations = activation_bytes(hf_config, config, dtype.itemsize) + encoder
        budget = cuda_kv_cache_bytes(free, total, config.gpu_memory_utilization, activations)
        num = max(0, budget - state_bytes) // per_block
    else:
        num = max(0, CPU_DEFAULT_KV_CACHE_BYTES - state_bytes) // per_block
    need = layout.blocks_per_sequence(max_model_len, block_size, min(max_model_len, config.max_num_batched_tokens))
    if num < need:
        groups = f" over its {len(layout.groups)} KV-cache groups" if len(layout.groups) > 1 else ""
        states = f" (recurrent states take {state_bytes / 2**30:.2f} GiB: lower max_num_seqs, num_state_snapshots"
        states += " or num_speculative_tokens)"
        raise ValueError(
            f"The KV cache holds {num} blocks of {block_size} tokens ({layout.group_size} layers each), fewer than one "
            f"max_model_len={max_model_len} sequence needs{groups} ({need}). Raise the KV cache "
            f"size or lower max_model_len{states if state_bytes else ''}."
        )
    return num
