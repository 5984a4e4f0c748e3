"""The gated delta rule and causal convolution of Gated DeltaNet layers (``layers/delta_rule.py``,
``layers/causal_conv.py``) against
HF transformers' own PyTorch functions (``modeling_qwen3_next``), bit for bit: the chunked form over a
prefill chunk continuing from a state, the recurrent form over one token of several sequences at once,
and the convolution in both forms."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cb_serve import cpu_ops
from cb_serve.model_executor.layers import causal_conv, delta_rule

hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
KW = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)


def inputs(n: int, t: int, nk: int = 2, nv: int = 4, dk: int = 16, dv: int = 32, seed: int = 0):
    torch.manual_seed(seed)
    q, k, v = torch.randn(n, t, nk, dk), torch.randn(n, t, nk, dk), torch.randn(n, t, nv, dv)
    g, beta = delta_rule.gates(torch.randn(n, t, nv), torch.randn(n, t, nv), torch.randn(nv), torch.randn(nv))
    return q, k, v, g, beta, torch.randn(n, nv, dk, dv)


@pytest.mark.bitwise
def test_gates_are_hfs():
    a, b, a_log, dt_bias = torch.randn(5, 4), torch.randn(5, 4), torch.randn(4), torch.randn(4)
    g, beta = delta_rule.gates(a, b, a_log, dt_bias)
    assert torch.equal(g, -a_log.float().exp() * F.softplus(a.float() + dt_bias)) and torch.equal(beta, b.sigmoid())


@pytest.mark.bitwise
@pytest.mark.parametrize("length", [1, 63, 64, 150])
def test_chunk_rule_is_hfs_from_a_state(length):
    q, k, v, g, beta, state = inputs(1, length)
    ref, ref_state = hf.torch_chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state, **KW)
    out, new_state = delta_rule.chunk_rule(q[0], k[0], v[0], g[0], beta[0], state[0])
    assert torch.equal(out, ref[0]) and torch.equal(new_state, ref_state[0])


@pytest.mark.bitwise
def test_recurrent_rule_batches_sequences_as_hf_runs_each():
    q, k, v, g, beta, state = inputs(3, 1, seed=1)
    out, new_state = delta_rule.recurrent_rule(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state)
    for i in range(3):
        one = (x[i : i + 1] for x in (q, k, v, g, beta))
        ref, ref_state = hf.torch_recurrent_gated_delta_rule(*one, initial_state=state[i : i + 1], **KW)
        assert torch.equal(out[i], ref[0, 0]) and torch.equal(new_state[i], ref_state[0])


@pytest.mark.bitwise
def test_convolution_continues_from_its_state_in_both_forms():
    torch.manual_seed(2)
    channels, width = 40, 4
    weight, state, x = torch.randn(channels, width), torch.randn(channels, width), torch.randn(10, channels)
    full = torch.cat([state, x.T], dim=1)[None]
    ref = F.silu(F.conv1d(full, weight[:, None], padding=width - 1, groups=channels)[..., : full.shape[-1]])
    out, new_state = causal_conv.causal_conv(x, state, weight)
    assert torch.equal(out, ref[0, :, -10:].T) and torch.equal(new_state, full[0, :, -width:])
    states, tokens = torch.randn(3, channels, width), torch.randn(3, channels)
    out, new_states = causal_conv.causal_conv_step(tokens, states, weight)
    for i in range(3):
        s = states[i : i + 1].clone()
        ref = hf.causal_conv1d_update(tokens[i : i + 1, :, None], s, weight, None, "silu")
        assert torch.equal(out[i], ref[0, :, 0]) and torch.equal(new_states[i], s[0])


@pytest.mark.bitwise
@pytest.mark.parametrize("dk, dv", [(16, 32), (128, 128), (24, 20), (300, 48)])
def test_the_cpu_kernel_steps_the_slots_in_place_bit_for_bit(dk, dv):
    """``recurrent_step`` with the C++ kernel: the slots' states and the outputs are ``recurrent_rule``'s,
    bit for bit (its sums over the key dim in torch's order), other slots untouched."""
    if not cpu_ops.available():
        pytest.skip("cb_serve CPU kernels did not build here")
    q, k, v, g, beta, _ = inputs(3, 1, dk=dk, dv=dv, seed=3)
    q, k, v, g, beta = (x[:, 0] for x in (q, k, v, g, beta))
    states, slots = torch.randn(5, 4, dk, dv), torch.tensor([4, 0, 2])
    ref, ref_states = delta_rule.recurrent_rule(q, k, v, g, beta, states[slots])
    stepped = states.clone()
    out = delta_rule.recurrent_step(q, k, v, g, beta, stepped, slots, use_cpu_ops=True)
    assert torch.equal(out, ref) and torch.equal(stepped[slots], ref_states)
    assert torch.equal(stepped[[1, 3]], states[[1, 3]])
