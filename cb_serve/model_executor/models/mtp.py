"""Multi-token prediction (MTP) layers of Qwen3-Next and Qwen3.5 checkpoints (``mtp.*``): the draft head the
speculative proposer ``spec_decode/mtp.py`` runs, as vLLM's ``Qwen3NextMTP`` / ``Qwen3_5MTP`` compute it.

Row ``p`` of a sequence takes the token after it, ``t[p + 1]``, and a hidden state ``h[p]``: the target's final,
normed hidden state at ``p`` (or, down a chain of drafts, this head's own output at ``p - 1``). It computes
``fc([norm_e(embed(t[p + 1])) | norm_h(h[p])])``, one decoder layer with full attention over its own KV cache of
earlier rows (the family's attention and feed-forward, RoPE at position ``p``), then a final norm; the target's
LM head on that output predicts ``t[p + 2]``. A checkpoint with several MTP layers uses layer ``j`` for the
``j``-th draft of a chain, cycling (vLLM's ``spec_step_idx % num_mtp_layers``).

The embedding, LM head and RoPE tables are the target's, referenced, not copied. One rank: tensor parallelism
with MTP is refused (the target's sharded LM head would need every rank).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from cb_serve.attention.base import AttentionBackend, AttentionMetadata
from cb_serve.distributed.group import TensorParallelGroup
from cb_serve.distributed.sharding import single_shard
from cb_serve.model_executor.layers.checkpoint import copy_parts
from cb_serve.model_executor.layers.linear import Linear
from cb_serve.model_executor.layers.rotary import Rope
from cb_serve.model_executor.models.decoder import DecoderLayer
from cb_serve.model_executor.models.plan import LayerPlan

NORMS = ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")


def num_mtp_layers(state: Mapping[str, object]) -> int:
    """The MTP layers a checkpoint's state holds (``mtp.layers.{j}.``); 0 without any."""
    layers = {name.split(".")[2] for name in state if name.startswith("mtp.layers.")}
    return len(layers) if "mtp.fc.weight" in state else 0


class MultiTokenPredictor(nn.Module):
    """What ``ModelRunner`` runs as the proposer's model: ``layers`` (the MTP decoder layers, full attention),
    ``forward(input_ids, positions, kv_caches, meta, hidden_states, step)`` -> each row's output (normed), and
    ``compute_logits`` (the target's LM head on it)."""

    def __init__(self, target: nn.Module, plan: LayerPlan, num_layers: int, backend: AttentionBackend) -> None:
        super().__init__()
        config = self.config = target.config
        assert num_layers > 0 and plan.mixer.sliding_window is None, "an MTP layer attends to every earlier row"
        size, eps, cpu = config.hidden_size, config.rms_norm_eps, target.use_cpu_ops
        shard, tp = single_shard(config), TensorParallelGroup.single()
        self.fc = Linear(2 * size, size, bias=False)
        for name in NORMS:
            setattr(self, name, plan.norm(size, eps, cpu))
        self.layers = nn.ModuleList(DecoderLayer(config, plan, backend, shard, tp, cpu) for _ in range(num_layers))
        self.use_cpu_ops = cpu
        self._target = (target,)  # not a submodule: its weights are the target's own

    def state_specs(self) -> dict:
        return {}

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list,
        meta: AttentionMetadata,
        hidden_states: torch.Tensor,
        step: int = 0,
    ) -> torch.Tensor:
        """Every row's output (its final norm applied); ``hidden_states`` ``[T, hidden]``, the rows' ``h[p]``;
        ``step``: the draft's place in its chain (which MTP layer runs)."""
        (target,) = self._target
        e = self.pre_fc_norm_embedding(target.embed(input_ids))
        x = self.fc(torch.cat([e, self.pre_fc_norm_hidden(hidden_states.to(e.dtype))], dim=-1))
        j = step % len(self.layers)
        layer = self.layers[j]
        rope = Rope(positions, target.rope_cos[layer.rope_table], target.rope_sin[layer.rope_table], x.dtype,
                    self.use_cpu_ops)  # fmt: skip
        x, residual = layer(x, None, rope, kv_caches[j], meta)
        return self.norm(residual + x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's LM head on the rows' outputs (already normed), float32."""
        (target,) = self._target
        return target.lm_head(hidden)[:, : self.config.vocab_size].float()

    @torch.no_grad()
    def load_hf_state_dict(self, state: Mapping, prefix: str = "mtp.") -> None:
        copy_parts(self.fc.weight, state[prefix + "fc.weight"])
        for name in NORMS:
            copy_parts(getattr(self, name).weight, state[f"{prefix}{name}.weight"])
        for j, layer in enumerate(self.layers):
            layer.load_hf_weights(state, f"{prefix}layers.{j}.")

    def prepare_for_cpu(self) -> None:
        """The CPU weight layouts of its projections (``CausalLM.prepare_for_cpu``'s, on these layers)."""
        from cb_serve.model_executor.models.base import prepare_layers_for_cpu

        prepare_layers_for_cpu(self.layers, self.use_cpu_ops)
        self.fc.prepare_for_cpu(pack=self.use_cpu_ops)
