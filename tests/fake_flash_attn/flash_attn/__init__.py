"""A pure-PyTorch stand-in for flash-attn's public `flash_attn_varlen_func`, for machines without flash-attn.

Tests put the folder above this package on sys.path. It follows the real function's documented contract:

- q: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim); sequence i is rows
  cu_seqlens[i]:cu_seqlens[i + 1] (int32); GQA: q head h attends kv head h // (nheads // nheads_k).
- causal=True aligns the mask bottom-right: query i of a sequence sees keys j <= i + seqlen_k - seqlen_q;
  a row that sees no key outputs 0 with log-sum-exp +inf.
- return_attn_probs=True returns (out, softmax_lse, S_dmask): softmax_lse is (nheads, total_q) float32,
  S_dmask None here (the real one returns it only with dropout).
- autograd like the real one: gradients flow from `out` only; a gradient reaching softmax_lse is dropped.
- the real kernel's trap for GQA with max_seqlen_q == 1 (it then assumes one query per sequence) is an error here.

Unlike the real one it takes any floating dtype on any device; float64 inputs give float64 results (and lse) so
tests can compare at 1e-10. Memory is (nheads, total_q, total_k): small inputs only.
"""

from __future__ import annotations

import torch

__version__ = "2.8.3+fake"


def _positions(cu: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence id, position inside it) of each of `total` rows; rows past cu[-1] get sequence id -1."""
    lengths = (cu[1:] - cu[:-1]).long()
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu.device), lengths)
    seq = torch.cat([seq, seq.new_full((total - seq.numel(),), -1)])
    pos = torch.arange(total, device=cu.device) - cu.long()[seq.clamp(min=0)]
    return seq, pos


def _attention(q, k, v, cu_q, cu_k, scale, causal):
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    g = q.shape[1] // k.shape[1]
    seq_q, pos_q = _positions(cu_q, q.shape[0])
    seq_k, pos_k = _positions(cu_k, k.shape[0])
    allowed = (seq_q[:, None] == seq_k[None, :]) & (seq_q[:, None] >= 0)
    if causal:
        shift = ((cu_k[1:] - cu_k[:-1]) - (cu_q[1:] - cu_q[:-1])).long()[seq_q.clamp(min=0)]
        allowed &= pos_k[None, :] <= pos_q[:, None] + shift[:, None]
    kr, vr = (t.to(dtype).repeat_interleave(g, dim=1) for t in (k, v))
    s = torch.einsum("qhd,khd->hqk", q.to(dtype), kr) * scale
    s = s.masked_fill(~allowed, float("-inf"))
    lse = s.logsumexp(dim=-1)  # (nheads, total_q)
    empty = ~allowed.any(dim=-1)
    p = (s - lse.masked_fill(empty, 0)[..., None]).exp()
    out = torch.einsum("hqk,khd->qhd", p, vr)
    return out.to(q.dtype), lse.masked_fill(empty, float("inf"))


class _VarlenAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, scale, causal):
        ctx.save_for_backward(q, k, v, cu_q, cu_k)
        ctx.scale, ctx.causal = scale, causal
        return _attention(q, k, v, cu_q, cu_k, scale, causal)

    @staticmethod
    def backward(ctx, dout, dlse):  # dlse is dropped, as flash-attn's backward drops it
        q, k, v, cu_q, cu_k = ctx.saved_tensors
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_() for t in (q, k, v)]
            out, _ = _attention(*inputs, cu_q, cu_k, ctx.scale, ctx.causal)
            dq, dk, dv = torch.autograd.grad(out, inputs, dout)
        return dq, dk, dv, None, None, None, None


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # 0.0 means deactivated
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    """Varlen attention with flash-attn's semantics (see the module docstring)."""
    if dropout_p or tuple(window_size) != (-1, -1) or softcap or alibi_slopes is not None or block_table is not None:
        raise NotImplementedError("the fake flash_attn supports no dropout, window, softcap, alibi or paged KV")
    if q.dim() != 3 or k.shape != v.shape or k.dim() != 3 or q.shape[2] != k.shape[2] or q.shape[1] % k.shape[1]:
        raise RuntimeError(f"bad shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if not q.dtype == k.dtype == v.dtype:
        raise RuntimeError("query and key must have the same dtype")
    for name, cu, total, longest in (
        ("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q),
        ("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k),
    ):
        lengths = cu[1:] - cu[:-1]
        if cu.dtype != torch.int32 or cu[0] != 0 or (lengths < 0).any() or cu[-1] > total:
            raise RuntimeError(f"{name} must be int32, start at 0, be non-decreasing and fit the tensor")
        if lengths.max() > longest:  # the real kernel would silently skip rows
            raise RuntimeError(f"a sequence is longer than max_seqlen ({int(lengths.max())} > {longest})")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise RuntimeError("cu_seqlens_q and cu_seqlens_k must have the same length")
    if max_seqlen_q == 1 and q.shape[1] > k.shape[1] and q.shape[0] != cu_seqlens_q.numel() - 1:
        raise RuntimeError("max_seqlen_q == 1 with GQA needs exactly one query per sequence (flash-attn reshapes q)")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    out, lse = _VarlenAttention.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal)
    return (out, lse, None) if return_attn_probs else out
