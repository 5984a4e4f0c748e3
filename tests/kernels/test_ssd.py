"""Mamba2's selective scan (``layers/ssd.py``) against HF transformers' own PyTorch functions
(``modeling_granitemoehybrid``), bit for bit: the chunked scan over a prefill chunk continuing from a
state, and the recurrent update of one token of several sequences; a prefill split anywhere, and
token-by-token decoding, continue where the one-call scan goes."""

from __future__ import annotations

import pytest
import torch

from cb_serve import cpu_ops
from cb_serve.model_executor.layers import ssd

hf = pytest.importorskip("transformers.models.granitemoehybrid.modeling_granitemoehybrid")
HEADS, HEAD_DIM, GROUPS, STATE, CHUNK = 8, 16, 2, 16, 16


def inputs(n: int, t: int, seed: int = 0):
    torch.manual_seed(seed)
    x, dt = torch.randn(n, t, HEADS, HEAD_DIM), torch.randn(n, t, HEADS)
    b, c = torch.randn(n, t, GROUPS, STATE), torch.randn(n, t, GROUPS, STATE)
    a, d, dt_bias = -torch.rand(HEADS) * 2, torch.randn(HEADS), torch.randn(HEADS)
    return x, dt, a, b, c, d, dt_bias, torch.randn(n, HEADS, HEAD_DIM, STATE)


@pytest.mark.bitwise
@pytest.mark.parametrize("length", [1, 7, 16, 45])
def test_chunk_scan_is_hfs(length):
    x, dt, a, b, c, d, dt_bias, state = inputs(1, length)
    limit = (0.0, 3.0)
    out, new_state = ssd.chunk_scan(x[0], dt[0], a, b[0], c[0], d, dt_bias, state[0], CHUNK, limit)
    ref, ref_state = hf.mamba2_chunk_scan(
        x, dt, a, b, c, CHUNK, D=d, dt_bias=dt_bias, initial_states=state, dt_softplus=True, dt_limit=limit,
        return_final_states=True,
    )  # fmt: skip
    assert torch.equal(out, ref[0]) and torch.equal(new_state, ref_state[0])


@pytest.mark.bitwise
def test_state_update_is_hfs_for_each_sequence():
    x, dt, a, b, c, d, dt_bias, states = inputs(3, 1, seed=1)
    out, new_states = ssd.state_update(x[:, 0], dt[:, 0], a, b[:, 0], c[:, 0], d, dt_bias, states)
    for i in range(3):
        s = states[i : i + 1].clone()
        ref = hf.mamba2_selective_state_update(
            s, x[i : i + 1, 0], dt[i : i + 1, 0, :, None].expand(-1, -1, HEAD_DIM),
            a[:, None, None].expand(-1, HEAD_DIM, STATE), b[i : i + 1, 0], c[i : i + 1, 0],
            d[:, None].expand(-1, HEAD_DIM), dt_bias=dt_bias[:, None].expand(-1, HEAD_DIM), dt_softplus=True,
        )  # fmt: skip
        assert torch.equal(out[i], ref[0]) and torch.equal(new_states[i], s[0])


def test_split_prefills_and_decodes_continue_the_scan():
    x, dt, a, b, c, d, dt_bias, state = inputs(1, 40, seed=2)
    x, dt, b, c, state = x[0], dt[0], b[0], c[0], state[0]
    whole, final = ssd.chunk_scan(x, dt, a, b, c, d, dt_bias, state, CHUNK)
    first, mid = ssd.chunk_scan(x[:21], dt[:21], a, b[:21], c[:21], d, dt_bias, state, CHUNK)
    rest, end = ssd.chunk_scan(x[21:30], dt[21:30], a, b[21:30], c[21:30], d, dt_bias, mid, CHUNK)
    outs, s = [], end[None]
    for t in range(30, 40):  # decode steps
        y, s = ssd.state_update(x[t : t + 1], dt[t : t + 1], a, b[t : t + 1], c[t : t + 1], d, dt_bias, s)
        outs.append(y)
    torch.testing.assert_close(torch.cat([first, rest, *outs]), whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s[0], final, rtol=1e-5, atol=1e-5)


@pytest.mark.bitwise
def test_the_cpu_kernel_steps_the_slots_in_place():
    """``state_step`` with the C++ kernel: the slots' states are ``state_update``'s bit for bit, the outputs to
    float32 rounding (the sum over the state dim in order, where ``bmm`` picks its own), other slots untouched."""
    if not cpu_ops.available():
        pytest.skip("cb_serve CPU kernels did not build here")
    x, dt, a, b, c, d, dt_bias, _ = inputs(3, 1, seed=4)
    x, dt, b, c = x[:, 0], dt[:, 0], b[:, 0], c[:, 0]
    states, slots = torch.randn(5, HEADS, HEAD_DIM, STATE), torch.tensor([4, 0, 2])
    ref, ref_states = ssd.state_update(x, dt, a, b, c, d, dt_bias, states[slots])
    stepped = states.clone()
    out = ssd.state_step(x, dt, a, b, c, d, dt_bias, stepped, slots, use_cpu_ops=True)
    assert torch.equal(stepped[slots], ref_states) and torch.equal(stepped[[1, 3]], states[[1, 3]])
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
