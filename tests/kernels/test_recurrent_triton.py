"""The Triton decode kernels of the recurrent layers against their PyTorch references (``recurrent_rule``,
``ssd.state_update``, ``causal_conv_step``): each updates the full state tensor in place at the rows' slots,
leaving every other slot bit-identical, and skips padding rows (slot -1). Odd dims, GQA / groups, conv with
and without bias. Without CUDA the kernels run in the Triton interpreter (conftest sets
``TRITON_INTERPRET=1``), so shapes stay small."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton", reason="the triton recurrent kernels need the triton package")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA and TRITON_INTERPRET is not set before triton was imported", allow_module_level=True)

from cb_serve.model_executor.layers import delta_rule, ssd  # noqa: E402
from cb_serve.model_executor.layers.causal_conv import causal_conv_step  # noqa: E402
from cb_serve.model_executor.layers.recurrent_triton import (  # noqa: E402
    causal_conv1d_update,
    fused_recurrent_gated_delta_rule,
    selective_state_update,
)

# As in test_triton_attention.py: CPU tensors need the interpreter, which a CUDA host has off unless
# TRITON_INTERPRET=1 was set before triton was imported; there the CUDA tests below cover the kernels.
interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tensors need the Triton interpreter (TRITON_INTERPRET=1)"
)

NUM_SLOTS = 5
SLOTS = {"permuted": [4, 0, 2], "padding": [3, -1, 1]}
TOL = dict(rtol=1e-5, atol=1e-5)


def check_states(new, old, slots, ref_rows):
    """Slots in ``slots`` hold ``ref_rows`` (in order, padding skipped); every other slot is unchanged."""
    used = [s for s in slots if s >= 0]
    for slot in range(new.shape[0]):
        if slot in used:
            torch.testing.assert_close(new[slot], ref_rows[used.index(slot)], **TOL)
        else:
            assert torch.equal(new[slot], old[slot]), slot


def check_outputs(out, ref, slots):
    rows = [i for i, s in enumerate(slots) if s >= 0]
    assert out.dtype == ref.dtype and out.shape[1:] == ref.shape[1:]
    torch.testing.assert_close(out[rows], ref, **TOL)


def run_delta_rule(slots, hk, hv, dk, dv, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    n = len(slots)
    q, k = torch.randn(n, hk, dk, generator=gen), torch.randn(n, hk, dk, generator=gen)
    v = torch.randn(n, hv, dv, generator=gen)
    g = -torch.rand(n, hv, generator=gen)
    beta = torch.rand(n, hv, generator=gen)
    states = torch.randn(NUM_SLOTS, hv, dk, dv, generator=gen)
    q, k, v, g, beta, states = (t.to(device) for t in (q, k, v, g, beta, states))
    old = states.clone()
    out = fused_recurrent_gated_delta_rule(
        q, k, v, g, beta, states, torch.tensor(slots, dtype=torch.int32, device=device)
    )
    rows = [i for i, s in enumerate(slots) if s >= 0]
    idx = torch.tensor([s for s in slots if s >= 0], device=device)
    ref_out, ref_states = delta_rule.recurrent_rule(q[rows], k[rows], v[rows], g[rows], beta[rows], old[idx])
    check_outputs(out, ref_out, slots)
    check_states(states, old, slots, ref_states)


def run_state_update(slots, groups, h, p, s, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    n = len(slots)
    x = torch.randn(n, h, p, generator=gen)
    dt = torch.randn(n, h, generator=gen)
    a = -torch.rand(h, generator=gen).exp()
    bc = torch.randn(n, 2, groups, s, generator=gen)  # b and c strided, as the layer splits them
    d, dt_bias = torch.randn(h, generator=gen), torch.randn(h, generator=gen)
    states = torch.randn(NUM_SLOTS, h, p, s, generator=gen)
    x, dt, a, bc, d, dt_bias, states = (t.to(device) for t in (x, dt, a, bc, d, dt_bias, states))
    b, c = bc[:, 0], bc[:, 1]
    old = states.clone()
    out = selective_state_update(
        x, dt, a, b, c, d, dt_bias, states, torch.tensor(slots, dtype=torch.int32, device=device)
    )
    rows = [i for i, s in enumerate(slots) if s >= 0]
    idx = torch.tensor([s for s in slots if s >= 0], device=device)
    ref_out, ref_states = ssd.state_update(x[rows], dt[rows], a, b[rows], c[rows], d, dt_bias, old[idx])
    check_outputs(out, ref_out, slots)
    check_states(states, old, slots, ref_states)


def run_conv(slots, channels, width, has_bias, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    n = len(slots)
    x = torch.randn(n, channels, generator=gen)
    weight = torch.randn(channels, width, generator=gen)
    bias = torch.randn(channels, generator=gen) if has_bias else None
    states = torch.randn(NUM_SLOTS, channels, width, generator=gen)
    x, weight, states = x.to(device), weight.to(device), states.to(device)
    bias = None if bias is None else bias.to(device)
    old = states.clone()
    out = causal_conv1d_update(x, states, weight, bias, torch.tensor(slots, dtype=torch.int32, device=device))
    rows = [i for i, s in enumerate(slots) if s >= 0]
    idx = torch.tensor([s for s in slots if s >= 0], device=device)
    ref_out, ref_states = causal_conv_step(x[rows], old[idx], weight, bias)
    check_outputs(out, ref_out, slots)
    check_states(states, old, slots, ref_states)


# (id, Hk, Hv, Dk, Dv)
DELTA_CASES = [("gqa2-dk16-dv32", 2, 4, 16, 32), ("gqa2-dv24", 2, 4, 16, 24)]
# (id, G, H, P, S)
SSD_CASES = [("g2-h4-p8-s16", 2, 4, 8, 16), ("s12", 2, 4, 8, 12)]
# (id, C, K, bias)
CONV_CASES = [("bias", 40, 4, True), ("no-bias", 40, 4, False)]


@interpreted
@pytest.mark.parametrize("slots", list(SLOTS.values()), ids=list(SLOTS))
@pytest.mark.parametrize("case", DELTA_CASES, ids=[c[0] for c in DELTA_CASES])
def test_delta_rule_matches_reference(case, slots):
    run_delta_rule(slots, *case[1:])


@interpreted
@pytest.mark.parametrize("slots", list(SLOTS.values()), ids=list(SLOTS))
@pytest.mark.parametrize("case", SSD_CASES, ids=[c[0] for c in SSD_CASES])
def test_state_update_matches_reference(case, slots):
    run_state_update(slots, *case[1:])


@interpreted
@pytest.mark.parametrize("slots", list(SLOTS.values()), ids=list(SLOTS))
@pytest.mark.parametrize("case", CONV_CASES, ids=[c[0] for c in CONV_CASES])
def test_conv_matches_reference(case, slots):
    run_conv(slots, *case[1:])


@interpreted
def test_block_tiling_matches_reference():
    """Several column / row / channel blocks per program grid (small blocks): tiles stay disjoint."""
    slots = [4, -1, 0]
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(3, 1, 12, generator=gen), torch.randn(3, 1, 12, generator=gen)
    v, g, beta = torch.randn(3, 2, 20, generator=gen), -torch.rand(3, 2, generator=gen), torch.rand(3, 2, generator=gen)
    states = torch.randn(NUM_SLOTS, 2, 12, 20, generator=gen)
    old = states.clone()
    out = fused_recurrent_gated_delta_rule(q, k, v, g, beta, states, torch.tensor(slots, dtype=torch.int32), block_v=8)
    ref_out, ref_states = delta_rule.recurrent_rule(
        q[[0, 2]], k[[0, 2]], v[[0, 2]], g[[0, 2]], beta[[0, 2]], old[[4, 0]]
    )
    check_outputs(out, ref_out, slots)
    check_states(states, old, slots, ref_states)
    x, dt, a = torch.randn(3, 2, 20, generator=gen), torch.randn(3, 2, generator=gen), -torch.rand(2, generator=gen)
    b, c, d, dt_bias = (
        torch.randn(3, 1, 12, generator=gen),
        torch.randn(3, 1, 12, generator=gen),
        torch.ones(2),
        torch.zeros(2),
    )
    states = torch.randn(NUM_SLOTS, 2, 20, 12, generator=gen)
    old = states.clone()
    out = selective_state_update(x, dt, a, b, c, d, dt_bias, states, torch.tensor(slots, dtype=torch.int32), block_p=8)
    ref_out, ref_states = ssd.state_update(x[[0, 2]], dt[[0, 2]], a, b[[0, 2]], c[[0, 2]], d, dt_bias, old[[4, 0]])
    check_outputs(out, ref_out, slots)
    check_states(states, old, slots, ref_states)
    x, weight = torch.randn(3, 40, generator=gen), torch.randn(40, 3, generator=gen)
    states = torch.randn(NUM_SLOTS, 40, 3, generator=gen)
    old = states.clone()
    out = causal_conv1d_update(x, states, weight, None, torch.tensor(slots, dtype=torch.int32), block_c=16)
    ref_out, ref_states = causal_conv_step(x[[0, 2]], old[[4, 0]], weight)
    check_outputs(out, ref_out, slots)
    check_states(states, old, slots, ref_states)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("slots", list(SLOTS.values()), ids=list(SLOTS))
def test_cuda_matches_reference(slots):
    for case in DELTA_CASES:
        run_delta_rule(slots, *case[1:], device="cuda")
    run_delta_rule(slots, 4, 8, 128, 128, device="cuda")  # Qwen3-Next-like head dims
    for case in SSD_CASES:
        run_state_update(slots, *case[1:], device="cuda")
    run_state_update(slots, 1, 8, 64, 128, device="cuda")
    for case in CONV_CASES:
        run_conv(slots, *case[1:], device="cuda")
    run_conv(slots, 1000, 4, True, device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replays_new_slots():
    """The launch reads ``slots`` on the device only: captured once, replayed with other slots and a pad."""
    gen = torch.Generator().manual_seed(0)
    x, weight = torch.randn(3, 64, generator=gen).cuda(), torch.randn(64, 4, generator=gen).cuda()
    states = torch.randn(NUM_SLOTS, 64, 4, generator=gen).cuda()
    slots = torch.tensor([0, 1, 2], dtype=torch.int32, device="cuda")
    causal_conv1d_update(x, states.clone(), weight, None, slots)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    scratch = states.clone()
    with torch.cuda.graph(graph):
        out = causal_conv1d_update(x, scratch, weight, None, slots)
    scratch.copy_(states)
    slots.copy_(torch.tensor([4, -1, 1], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    ref_out, ref_states = causal_conv_step(x[[0, 2]], states[[4, 1]], weight)
    check_outputs(out, ref_out, [4, -1, 1])
    check_states(scratch, states, [4, -1, 1], ref_states)
