"""A mixture-of-experts block, the sparse counterpart of ``GatedMLP``: a router picks each token's
experts (``moe_router``), and the experts run batched by expert (``fused_experts``).

Under tensor parallelism each rank holds a slice of every expert's intermediate columns, or, with
expert parallelism, whole experts (``TensorParallelShard.experts``); either way every rank routes every
token (the router is replicated) and the ranks' partial outputs are summed (``all_reduce``), which is
vLLM's combine when tokens are not split across data-parallel ranks. A down-projection bias is added
once: by the driver under tensor parallelism, by each expert's owner under expert parallelism.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from cb_serve import cpu_ops
from cb_serve.distributed.group import TensorParallelGroup
from cb_serve.distributed.sharding import TensorParallelShard
from cb_serve.model_executor.layers import fused_experts_triton
from cb_serve.model_executor.layers.checkpoint import materialize
from cb_serve.model_executor.layers.fused_experts import (
    CpuExpertGemm,
    ExpertGemm,
    TorchExpertGemm,
    count_per_expert,
    fused_experts,
    route_pairs,
)
from cb_serve.model_executor.layers.mlp import GatedMLP
from cb_serve.model_executor.layers.moe_router import RouterSpec, select_experts
from cb_serve.model_executor.layers.moe_weights import read_experts, read_router

ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "swiglu_oai")


@dataclass(frozen=True)
class MoESpec:
    router: RouterSpec
    intermediate_size: int  # of each expert
    activation: str = "silu"  # silu / gelu_pytorch_tanh: act(gate) * up; swiglu_oai: gpt-oss's clamped form
    expert_bias: bool = False  # biases on both expert projections (gpt-oss)
    interleaved: bool = False  # gpt-oss's checkpoint layout (``moe_weights``)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"Unsupported expert activation {self.activation!r} (supported: {', '.join(ACTIVATIONS)})."
            )
        assert self.intermediate_size > 0, self.intermediate_size


def swiglu_oai(h: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss: ``(clamp(up) + 1) * gate * sigmoid(alpha * gate)`` with the gate clamped above (HF's op order)."""
    gate, up = h.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def gated(act: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return act(gate) * up


def activation_fn(spec: MoESpec, use_cpu_ops: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """``[P, 2I]`` (gate columns, then up) -> ``[P, I]``; the C++ kernels (bit-equal to eager) where they run."""
    if spec.activation == "swiglu_oai":
        return functools.partial(swiglu_oai, alpha=spec.swiglu_alpha, limit=spec.swiglu_limit)
    if use_cpu_ops and cpu_ops.available():
        return cpu_ops.silu_and_mul if spec.activation == "silu" else cpu_ops.gelu_tanh_and_mul
    act = F.silu if spec.activation == "silu" else functools.partial(F.gelu, approximate="tanh")
    return functools.partial(gated, act)


def expert_gemm(device: torch.device, dtype: torch.dtype, use_cpu_ops: bool) -> ExpertGemm:
    """The grouped GEMM for a layer: C++ on CPU for float32 weights where the kernels built, Triton on CUDA
    where it imports, else the reference."""
    if device.type == "cpu" and dtype == torch.float32 and use_cpu_ops and cpu_ops.available():
        return CpuExpertGemm()
    if device.type == "cuda" and fused_experts_triton.triton is not None and dtype in fused_experts_triton.DTYPES:
        return fused_experts_triton.TritonExpertGemm()
    return TorchExpertGemm()


class FusedMoE(nn.Module):
    """``forward(x [T, H]) -> [T, H]``; ``expert_load``: tokens per expert (all experts) of the last forward."""

    def __init__(
        self,
        hidden_size: int,
        spec: MoESpec,
        shard: TensorParallelShard,
        tp: TensorParallelGroup,
        use_cpu_ops: bool,
        router: nn.Module | None = None,
        shared_expert: GatedMLP | None = None,
        shared_columns: range | None = None,
    ) -> None:
        """``router``: a module from hidden states to expert logits, where a model's router is more than one
        linear layer (Gemma 4); by default ``nn.Linear`` (with a bias where ``spec.router.bias``).
        ``shared_expert``: an MLP every token goes through, gated by ``sigmoid(shared_expert_gate(x))``
        (Qwen2-MoE), holding ``shared_columns`` of its intermediate dimension on this rank."""
        super().__init__()
        self.spec, self.tp, self.hidden_size = spec, tp, hidden_size
        self.num_experts = spec.router.num_experts
        self.experts = shard.experts(self.num_experts)
        self.columns = shard.expert_columns(spec.intermediate_size)
        num_local, columns = len(self.experts), len(self.columns)
        self.intermediate_size = columns
        self.gate = router or nn.Linear(hidden_size, self.num_experts, bias=spec.router.bias)  # on every rank
        scale = spec.router.per_expert_scale
        self.per_expert_scale = nn.Parameter(torch.ones(self.num_experts), requires_grad=False) if scale else None
        self.w13 = nn.Parameter(torch.empty(num_local, 2 * columns, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_local, hidden_size, columns), requires_grad=False)
        own_down_bias = spec.expert_bias and (shard.expert_parallel or shard.is_driver)
        self.b13 = nn.Parameter(torch.empty(num_local, 2 * columns), requires_grad=False) if spec.expert_bias else None
        self.b2 = nn.Parameter(torch.empty(num_local, hidden_size), requires_grad=False) if own_down_bias else None
        self.use_cpu_ops = use_cpu_ops
        self.activation = activation_fn(spec, use_cpu_ops)
        self.gemm: ExpertGemm | None = None  # chosen on first use, by device and dtype (``prepare_for_cpu``)
        self.shared_expert, self.shared_columns = shared_expert, shared_columns
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if shared_expert is not None else None
        self.register_buffer("expert_load", torch.zeros(self.num_experts, dtype=torch.long), persistent=False)

    def forward(self, x: torch.Tensor, router_input: torch.Tensor | None = None) -> torch.Tensor:
        """``router_input``: what the router reads, where it differs from the experts' input (Gemma 4)."""
        weights, ids = select_experts(self.gate(x if router_input is None else router_input), self.spec.router)
        if self.per_expert_scale is not None:
            weights = weights * self.per_expert_scale[ids]
        self.expert_load.copy_(count_per_expert(ids, self.num_experts))  # in place: replayed CUDA graphs update it
        if self.gemm is None:
            self.gemm = expert_gemm(x.device, x.dtype, use_cpu_ops=False)
        routing = route_pairs(weights, ids, self.experts, self.num_experts)
        sizes = (2 * self.intermediate_size, self.hidden_size)
        out = fused_experts(x, routing, self.gemm, self.w13, self.w2, sizes, self.activation, self.b13, self.b2)
        out = self.tp.all_reduce(out)
        if self.shared_expert is not None:  # HF: experts + sigmoid(gate(x)) * shared(x)
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    @torch.no_grad()
    def load_hf_weights(self, state: Mapping, prefix: str) -> None:
        """This rank's slice of the block under ``prefix`` (``model.layers.{i}.``), any layout ``moe_weights`` reads."""
        weight, bias = read_router(state, prefix)
        self.gate.weight.copy_(weight)
        if self.gate.bias is not None:
            self.gate.bias.copy_(bias)
        self.load_experts(state, prefix)
        if self.shared_expert is not None:
            self.shared_expert.load_hf_weights(state, prefix + "mlp.shared_expert.")
            self.shared_expert_gate.weight.copy_(materialize(state[prefix + "mlp.shared_expert_gate.weight"]))

    @torch.no_grad()
    def load_experts(self, state: Mapping, prefix: str, block: str | None = None) -> None:
        """The experts' slices (``block``: where they are when not under the router's block, Gemma 4)."""
        self.expert_load.zero_()  # the loader allocates buffers uninitialized
        parts = read_experts(state, prefix, self.experts, self.columns, self.spec.interleaved, block)
        self.w13.copy_(parts["w13"])
        self.w2.copy_(parts["w2"])
        if self.b13 is not None:
            self.b13.copy_(parts["b13"])
        if self.b2 is not None:
            self.b2.copy_(parts["b2"])

    @torch.no_grad()
    def prepare_for_cpu(self, pack: bool) -> None:
        """With the C++ kernels and float32 weights: both projections packed for ``grouped_gemm`` (the
        plain copies dropped); otherwise the PyTorch reference."""
        gemm = expert_gemm(self.w13.device, self.w13.dtype, pack)
        if isinstance(gemm, CpuExpertGemm):
            self.w13.data = gemm.prepare(self.w13.data)
            self.w2.data = gemm.prepare(self.w2.data)
        self.gemm = gemm if isinstance(gemm, CpuExpertGemm) else TorchExpertGemm()
        if self.shared_expert is not None:
            for linear in (self.shared_expert.gate_up_proj, self.shared_expert.down_proj):
                linear.prepare_for_cpu(pack=pack)
