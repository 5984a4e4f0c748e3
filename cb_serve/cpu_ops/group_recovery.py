"""Recovering the low-bit groups ``(q, d, m)`` of a dequantized GGUF weight from its float32 values alone.

Each function takes the weight as ``[N, K // 32, 32]`` (groups of 32 inputs per output row), tries a few
candidate scales per group and keeps, group by group, the first candidate that gives back every value bit
for bit; it returns ``(q, d, m)`` once every group is found, else None.

- 4 bits, ``fma(d, q, m)`` with ``q`` in 0..15 (``d * q`` exact, so one rounding as in the dequantizer):
  Q4_1 ``d * q + m`` (float16 ``d``, ``m``), Q4_0 ``d * (q - 8)``, and Q4_K, whose sub-blocks of 32 are
  ``(d * sc) * q - dmin * mn``: float32 ``a = d * sc`` (up to 17 significant bits) and ``b = dmin * mn``.
  For Q4_K ``m = -b`` is the group's minimum (its ``q = 0``) and ``a`` lies in the interval where every
  ``a * q + m`` rounds to its value: the shortest float in it is taken, for each guess of the largest ``q``.
- 8 bits, ``d * q`` with ``q`` in -127..127: Q8_0 (float16 ``d``, ``q = ±127`` at the largest magnitude)
  and Q5_0, ``d * (q - 16)`` with ``q`` in 0..31 (``-16 d`` at the largest magnitude, or a smaller top ``q``
  where an importance-weighted quantizer chose the scale); and in groups of 16 Q6_K, ``(d * sc) * (q - 32)``
  with ``q`` in 0..63 (float16 ``d``, int8 ``sc``).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

Groups = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]  # q [N, G, 32], d [N, G], m [N, G] or None
CANDIDATE_ULPS = (0, -1, 1, -2, 2)  # float16 neighbours of the estimated Q4_1 scale that are tried
Q4_SCALE_BITS = 20  # d * q exact in float32 for q <= 15
# The largest |q| of a group, tried in turn (until every group is found): Q8_0's 127, Q5_0's 16 (or smaller
# tops); Q6_K's 32 (or smaller).
Q8_TOPS = (127, *range(16, 0, -1))
Q6_TOPS = tuple(range(32, 0, -1))
SHORT_SCALE_BITS = (11, 14, 17, Q4_SCALE_BITS)  # significant bits tried for a Q4_K scale, fewest first


def significant_bits_at_most(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Whether each (finite) ``x`` has at most ``bits`` significant bits."""
    mantissa, _ = torch.frexp(x.double())
    scaled = torch.ldexp(mantissa, torch.tensor(float(bits), dtype=torch.float64))
    return torch.isfinite(x) & (scaled == scaled.round())


def _round_to_bits(x: torch.Tensor, bits: int) -> torch.Tensor:
    mantissa, exponent = torch.frexp(x)
    return torch.ldexp(torch.round(torch.ldexp(mantissa, torch.tensor(float(bits), dtype=x.dtype))), exponent - bits)


def _q4k_candidates(w: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(a, m)`` per group: ``m`` the minimum, ``a`` the shortest float (``SHORT_SCALE_BITS``) that rounds
    every ``a * q + m`` to its value, for the largest ``q`` guessed as 15, 14, ..., 1 in turn."""
    w64 = w.double()
    low = w.amin(-1)
    low64 = low.double()[..., None]
    above = w64 - low64
    # Reals that round to w lie strictly inside (w - gap below / 2, w + gap above / 2).
    inf = torch.tensor(float("inf"))
    below_half = (w64 - torch.nextafter(w, -inf).double()) / 2
    above_half = (torch.nextafter(w, inf).double() - w64) / 2
    for top in range(15, 0, -1):
        estimate = above.amax(-1) / top
        q = torch.round(above / torch.where(estimate > 0, estimate, 1.0)[..., None]).clamp(0, 15)
        positive = q > 0
        safe_q = torch.where(positive, q, 1.0)
        lo = torch.where(positive, (w64 - below_half - low64) / safe_q, -torch.inf).amax(-1)
        hi = torch.where(positive, (w64 + above_half - low64) / safe_q, torch.inf).amin(-1)
        a = _round_to_bits((lo + hi) / 2, Q4_SCALE_BITS)
        for bits in reversed(SHORT_SCALE_BITS[:-1]):  # fewer bits override where they still fit
            short = _round_to_bits((lo + hi) / 2, bits)
            a = torch.where((lo < short) & (short < hi), short, a)
        yield torch.where(torch.isfinite(a), a, 0.0).float(), low


def _q4_candidates(w: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(d, m)`` per group to try, for ``w`` ``[N, K // 32, 32]``."""
    low, high = w.amin(-1), w.amax(-1)
    # Q4_1: the group's minimum at q = 0 and maximum at q = 15, so 15 d = the range (up to rounding).
    bits = ((high - low).double() / 15).half().view(torch.int16)
    for ulps in CANDIDATE_ULPS:
        yield (bits + ulps).clamp(min=0).view(torch.float16).float(), low
    # Q4_0: d * (q - 8), the largest magnitude at q = 0, so 8 |d| = it; as d' * q' + m with d' = |d|:
    # m = -8 d' when that value is negative (d > 0), else -7 d' (d < 0, q' = 15 - q).
    d = torch.maximum(high, -low) / 8
    yield d, torch.where(-low > high, -8 * d, -7 * d)
    yield from _q4k_candidates(w)


def _merge(found, q, d, m, exact, q_c, d_c, m_c):
    """Takes the candidate where it is exact and no earlier one was."""
    if q is None:  # constant groups: q = 0 reproduces them whatever d is
        return exact, q_c, d_c, m_c
    take = exact & ~found
    q = torch.where(take[..., None], q_c, q)
    d = torch.where(take, d_c, d)
    m = None if m is None else torch.where(take, m_c, m)
    return found | exact, q, d, m


def find_q4(w: torch.Tensor) -> Groups | None:
    """4-bit groups (uint8 ``q`` 0..15, float32 ``d`` and ``m``) for ``w`` ``[N, K // 32, 32]``, or None."""
    q = d = m = found = None
    for d_c, m_c in _q4_candidates(w):
        if not torch.isfinite(d_c).all():
            return None
        safe = torch.where(d_c > 0, d_c, torch.ones_like(d_c))
        q_c = torch.round((w - m_c[..., None]) / safe[..., None]).clamp(0, 15).to(torch.uint8)
        exact = ((d_c[..., None] * q_c + m_c[..., None]) == w).all(-1) & significant_bits_at_most(d_c, Q4_SCALE_BITS)
        found, q, d, m = _merge(found, q, d, m, exact, q_c, d_c, m_c)
        if found.all():
            return q, d, m
    return None


def find_q8(w: torch.Tensor, tops: tuple[int, ...] = Q8_TOPS) -> Groups | None:
    """8-bit groups (int8 ``q``, float32 ``d``, no ``m``) for ``w`` ``[N, K // 32, 32]``, or None."""
    amax = w.abs().amax(-1)
    if not torch.isfinite(amax).all():
        return None
    q = d = found = None
    for top in tops:
        d_c = amax / top  # exact where the largest magnitude is top * d
        q_c = torch.round(w / torch.where(d_c > 0, d_c, torch.ones_like(d_c))[..., None]).clamp(-127, 127)
        exact = ((d_c[..., None] * q_c) == w).all(-1)  # fma(d, q, 0) is this product however many bits d has
        found, q, d, _ = _merge(found, q, d, None, exact, q_c.to(torch.int8), d_c, None)
        if found.all():
            return q, d, None
    return None


def find_q8_per_16(w: torch.Tensor) -> Groups | None:
    """Q6_K, ``(d * sc) * (q - 32)``: 8-bit groups of 16 (int8 ``q`` -32..31, float32 ``d``) for ``w``
    ``[N, K // 16, 16]``, or None."""
    return find_q8(w, Q6_TOPS)
