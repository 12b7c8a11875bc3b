"""Dense attention pieces that merge through their log-sum-exp: MoBA's own / gated blocks (`torch_impl`, `flash`)
and DCA's key parts (`dca`) are each a dense attention of some queries over some keys, and the pieces of one row
combine as ``out = sum_p exp(lse_p - lse) out_p`` with ``lse = log sum_p exp(lse_p)``.

On CPU the fused flash-attention op does a piece in one call (forward and backward, it returns the log-sum-exp);
elsewhere, or if that op is missing, plain matmuls do it.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from .checks import scale_underflows
from .nonfinite import masked_matmul

# private but long-standing ops (torch >= 2.3); looked up softly so a missing one means the matmul path
_FUSED_FWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FUSED_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
use_fused = True  # tests switch this off to check the matmul path
_threads = threading.local()


def fused_available(t: torch.Tensor) -> bool:
    """Whether the fused CPU flash-attention ops serve `t` (CPU tensor, ops present, not switched off)."""
    on = use_fused and not getattr(_threads, "no_fused", False)
    return on and _FUSED_FWD is not None and _FUSED_BWD is not None and t.device.type == "cpu"


@contextlib.contextmanager
def fused_if(finite_keys: bool):
    """The fused op turns a row whose scores are all NaN (one visible key, a NaN) into output 0, log-sum-exp 0:
    with non-finite keys the pieces run as matmuls, which keep the NaN."""
    before = getattr(_threads, "no_fused", False)
    _threads.no_fused = before or not finite_keys
    try:
        yield
    finally:
        _threads.no_fused = before


def _offset_mask(nq: int, nk: int, offset: int, like: torch.Tensor) -> torch.Tensor:
    """Additive causal mask, query i at key position i + offset (bottom-right when offset = nk - nq)."""
    allowed = torch.arange(nq, device=like.device)[:, None] + offset >= torch.arange(nk, device=like.device)[None, :]
    return torch.zeros(nq, nk, dtype=like.dtype, device=like.device).masked_fill_(~allowed, float("-inf"))


def attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention returning its log-sum-exp: q [b, hq, n, d], k, v [b, hk, m, d] (GQA: hq a multiple of hk)
    -> (out [b, hq, n, d], lse [b, hq, n]). Forward only; pieces merge through lse (MoBA pieces, DCA parts).

    offset None: no mask; otherwise causal with query i at key position i + offset (the fused op's causal flag
    multiplies its -inf mask by the scale: a scale that rounds to 0 takes the explicit mask).
    """
    n, m = q.shape[2], k.shape[2]
    if fused_available(q):
        if offset is None or (offset == 0 and n == m and not scale_underflows(scale, q.dtype)):
            return _FUSED_FWD(q, k, v, 0.0, offset is not None, scale=scale)
        return _FUSED_FWD(q, k, v, 0.0, False, attn_mask=_offset_mask(n, m, offset, q), scale=scale)
    b, hq, _, d = q.shape
    hk = k.shape[1]
    q5 = q.reshape(b, hk, hq // hk, n, d)
    s = (q5 @ k[:, :, None].transpose(-1, -2)) * scale
    if offset is not None:  # masked_fill, not + mask: a masked NaN key must not reach the row (NaN + -inf = NaN)
        s = s.masked_fill(_offset_mask(n, m, offset, s) != 0, float("-inf"))
    lse = s.logsumexp(dim=-1)
    # a piece whose only keys score -inf (an inf key) adds nothing to the merge: out 0, lse -inf (not NaN)
    out = (s - lse.masked_fill(lse == float("-inf"), 0)[..., None]).exp() @ v[:, :, None]
    return out.reshape(b, hq, n, d), lse.reshape(b, hq, n)


def attention_with_lse_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    offset: int | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one piece, recomputed from the *final* output and log-sum-exp of its rows (shapes as
    `attention_with_lse`): the piece's share of a softmax merged over several pieces."""
    n, m = q.shape[2], k.shape[2]
    if fused_available(q):
        if offset is None or (offset == 0 and n == m and not scale_underflows(scale, q.dtype)):
            return _FUSED_BWD(do, q, k, v, o, lse, 0.0, offset is not None, scale=scale)
        return _FUSED_BWD(do, q, k, v, o, lse, 0.0, False, attn_mask=_offset_mask(n, m, offset, q), scale=scale)
    b, hq, _, d = q.shape
    hk = k.shape[1]
    g = hq // hk
    q5, do5, o5 = (t.reshape(b, hk, g, n, d) for t in (q, do, o))
    k5, v5 = k[:, :, None], v[:, :, None]
    s = (q5 @ k5.transpose(-1, -2)) * scale
    allowed = None
    if offset is not None:
        allowed = _offset_mask(n, m, offset, s) == 0
        s = s.masked_fill(~allowed, float("-inf"))
    p = (s - lse.reshape(b, hk, g, n, 1)).exp()
    dv = (p.transpose(-1, -2) @ do5).sum(2)
    dp = do5 @ v5.transpose(-1, -2)
    ds = p * (dp - (do5 * o5).sum(-1, keepdim=True))
    # a masked NaN key must not reach dq through ds = 0 (0 * NaN)
    dq = (ds @ k5 if allowed is None else masked_matmul(ds, allowed, k5.expand(-1, -1, g, -1, -1))) * scale
    dk = (ds.transpose(-1, -2) @ q5).sum(2) * scale
    return dq.reshape(b, hq, n, d), dk, dv


def merge_lse_(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, l_: torch.Tensor) -> None:
    """Merge a piece's (o, l_) into (out, lse) in place by log-sum-exp (o is scaled in place too)."""
    l_new = torch.logaddexp(lse, l_)
    out.mul_((lse - l_new).exp_()[..., None]).add_(o.mul_((l_ - l_new).exp_()[..., None]))
    lse.copy_(l_new)


def merge_lse_rows(
    out: torch.Tensor, lse: torch.Tensor, piece_out: torch.Tensor, piece_lse: torch.Tensor, rows: torch.Tensor
) -> torch.Tensor:
    """`merge_lse_` for pieces scattered over rows, out of place (autograd flows through every input).

    out [R, D], lse [R]: each row's first piece; piece_out [P, D], piece_lse [P]: pieces of rows `rows` [P] (a row
    may have several). Returns the merged [R, D] in lse's dtype.
    """
    with torch.no_grad():  # the max only keeps exp() in range
        top = lse.detach().scatter_reduce(0, rows, piece_lse.detach(), "amax")
    total = top + (lse - top).exp().index_add(0, rows, (piece_lse - top[rows]).exp()).log()
    return (out.to(lse.dtype) * (lse - total).exp()[:, None]).index_add(
        0, rows, piece_out.to(lse.dtype) * (piece_lse - total[rows]).exp()[:, None]
    )


def partial_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, allowed: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unnormalized softmax attention of one key part (autograd-capable; parts merge by `merge_partials`).

    q: [B, Hkv, G*T, D]; k, v: [B, Hkv, L, D]; allowed: bool broadcastable to [B, Hkv, G*T, L] or None.
    Returns (sum_j e_j v_j [B, Hkv, G*T, D], row max [.., 1], row sum [.., 1]) with e_j = exp(score_j - max).
    """
    scores = (q @ k.transpose(-1, -2)) * scale
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True).detach()
    # a row with no key in this part keeps max -inf, so the merge weighs it 0; exp needs a finite shift
    weights = torch.exp(scores - row_max.masked_fill(row_max == float("-inf"), 0.0))
    return weights @ v, row_max, weights.sum(dim=-1, keepdim=True)


def merge_partials(parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Combine parts through their log-sum-exp: out = sum_p e^(m_p - M) o_p / sum_p e^(m_p - M) l_p.

    Some part must hold every row's own key (DCA's intra part does), so M is finite.
    """
    top = torch.stack([m for _, m, _ in parts]).amax(dim=0)
    numerator = sum(o * torch.exp(m - top) for o, m, _ in parts)
    denominator = sum(l * torch.exp(m - top) for _, m, l in parts)
    return numerator / denominator
