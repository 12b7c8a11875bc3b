"""Dense causal attention with the queries at the last key positions, and a dense tail beside a sparse head."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .checks import check_count, check_inputs, check_shapes, gate_dtype, scale_underflows
from .nonfinite import SLICE_ELEMENTS, all_finite, masked_matmul


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None) -> torch.Tensor:
    """Dense causal attention with the queries at the last Nq key positions (bottom-right aligned), GQA.

    q: [B, Hq, Nq, D], k, v: [B, Hkv, Nk, D] -> [B, Hq, Nq, D]. Uses PyTorch SDPA without copying K/V.
    """
    check_inputs(q, k, v, scale)
    check_shapes(q, k, v)
    return causal_attention_unchecked(q, k, v, scale)


def causal_attention_unchecked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
    """`causal_attention` without its input checks, for callers whose q, k, v meet them by construction (a model's
    own q, k, v, the queries its newest keys: the "moba" attention function, where the checks would run once per
    layer and token)."""
    nq, nk = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    # exact for NaN / inf: SDPA adds its boolean mask (a masked NaN key would leak, NaN - inf), and its causal
    # kernel multiplies a masked probability 0 by the value (0 * NaN = NaN in rows that never attend it)
    if nq > 1 and not (all_finite(v) and (nq == nk or all_finite(k))):
        return _causal_math(q, k, v, scale)
    if nq == nk and not (scale is not None and scale_underflows(scale, q.dtype)):  # is_causal: -inf * 0 = NaN
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    if nq == 1:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)
    q_pos = torch.arange(nk - nq, nk, device=q.device)
    mask = q_pos[:, None] >= torch.arange(nk, device=q.device)[None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


def with_dense_tail(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dense_tail: int,
    sparse: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    dense: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Attention whose last `dense_tail` queries attend densely: `sparse` for the queries before them (over the keys
    up to the last of those queries, all they can see), `dense` for the tail; both take and return [B, H, N, D]
    tensors with the queries at the last positions of the keys."""
    check_count("dense_tail", dense_tail, 0)
    nq, nk = q.shape[2], k.shape[2]
    tail = min(dense_tail, nq)
    if tail == 0:
        return sparse(q, k, v)
    if tail == nq:
        return dense(q, k, v)
    head = sparse(q[:, :, : nq - tail], k[:, :, : nk - tail], v[:, :, : nk - tail])
    return torch.cat([head, dense(q[:, :, nq - tail :], k, v)], dim=2)


def _causal_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
    """`causal_attention` for non-finite keys / values: masked scores, exact for NaN / inf, in row slices."""
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    scale = d**-0.5 if scale is None else scale
    dtype = gate_dtype(q.dtype)
    kf, vf = (t.to(dtype).repeat_interleave(hq // hkv, dim=1) for t in (k, v))
    rows = max(1, SLICE_ELEMENTS // max(1, b * hq * nk))
    out = []
    for a in range(0, nq, rows):
        q_pos = torch.arange(nk - nq + a, nk - nq + min(nq, a + rows), device=q.device)
        allowed = torch.arange(nk, device=q.device)[None, :] <= q_pos[:, None]
        scores = (q[:, :, a : a + rows].to(dtype) @ kf.transpose(-1, -2)) * scale
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
        out.append(masked_matmul(probs, allowed, vf))
    return torch.cat(out, dim=2).to(q.dtype)
