"""MoBA on flash-attn's public varlen function (backend "flash"; extra ``moba-hf[flash]``).

Two `flash_attn_varlen_func` calls, both over K/V laid out as ``[B * Hkv * Nk, 1, D]`` (one row per key, each kv
head's keys contiguous), merged in float32 by log-sum-exp like the "torch" backend's pieces::

    own blocks  : one varlen sequence per (batch, kv head, query block), q heads of the group as flash heads,
                  causal=True (flash aligns the mask bottom-right, so a cut first block of Nq < Nk is right)
    gated blocks: one varlen sequence per (batch, kv head, key block) holding every (q head, query) row that
                  picked that block, one flash head, causal=False; blocks nobody picked are empty sequences

Gradients. flash-attn's autograd differentiates `out` only: the log-sum-exp it returns carries no gradient, but
the merge weights exp(lse_piece - lse_total) depend on q and k through it. The exact gradient comes from a
surrogate with the same value and the right derivative, built from public calls only::

    lse_eff = lse + s - s.detach(),   s_i = scale * q_i . u_i,   u = flash(q.detach(), k.detach(), v=k)

u_i = sum_j P_ij k_j with P held constant, and k reaches u only through the value slot, so ds_i/dq_i = scale * u_i
and ds_i/dk_j = scale * P_ij q_i: exactly d lse_i. Cost: training runs each piece twice (forward and backward,
about 2x the attention work of the pieces); without a gradient for q or k (inference, or top_k = 1 with no
sink/local blocks: nothing to merge) the surrogate is skipped and it costs nothing.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F

from .checks import effective_block_size, flash_attn_takes, gate_dtype, num_blocks
from .dense import merge_lse_rows
from .nonfinite import route_nonfinite
from .plan import BlockPlan, check_call
from .selection import GateOptions, selection_slices

try:
    import flash_attn
    from flash_attn import flash_attn_varlen_func
except ImportError as err:
    raise ImportError(f"backend 'flash' needs flash-attn (pip install 'moba-hf[flash]'): {err}") from err

_MIN_VERSION = (2, 6)  # varlen softmax_lse is [heads, total_q]; older releases returned a padded layout
_version = tuple(int(x) for x in re.findall(r"\d+", getattr(flash_attn, "__version__", "0.0"))[:2])
if _version < _MIN_VERSION:
    raise ImportError(f"backend 'flash' needs flash-attn >= 2.6, found {flash_attn.__version__}")

_GATE_ELEMENTS = 1 << 26  # gate scores (rows x blocks) held at once
exact_lse_gradient = True  # tests switch this off to show that the naive merge's gradients are wrong


def _cu(lengths: torch.Tensor) -> torch.Tensor:
    return F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)


def _attend(q, k, v, q_lens, k_lens, scale, causal, surrogate):
    """One varlen call -> (out [T, H, D], log-sum-exp [T, H] in float32/64, with the surrogate's gradient)."""
    args = (_cu(q_lens), _cu(k_lens), int(q_lens.max()), int(k_lens.max()))
    out, lse, _ = flash_attn_varlen_func(q, k, v, *args, softmax_scale=scale, causal=causal, return_attn_probs=True)
    if lse.shape != (q.shape[1], q.shape[0]):
        raise RuntimeError(f"flash-attn returned softmax_lse of shape {tuple(lse.shape)}, expected [heads, total_q]")
    dtype = gate_dtype(q.dtype)
    lse = lse.detach().t().to(dtype)
    if surrogate:
        # k in the value slot: a NaN / inf key would spread (0 * NaN) to every row and turn s - s.detach() into NaN
        k_value = k.masked_fill(~k.isfinite(), 0)
        u = flash_attn_varlen_func(q.detach(), k.detach(), k_value, *args, softmax_scale=scale, causal=causal)
        s = scale * (q.to(dtype) * u.to(dtype)).sum(-1)
        lse = lse + (s - s.detach())
    return out, lse


def _gated_rows(q, k, block_size: int, top_k: int, gate: GateOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """Every gated (row, key block) pair sorted by block: rows flat over [B, Hkv, Nq, group], blocks flat over
    [B, Hkv, n_blocks]."""
    b, hq, nq, _ = q.shape
    hkv, nb = k.shape[1], num_blocks(k.shape[2], block_size)
    g = hq // hkv
    rows, blocks = [], []
    per = max(1, _GATE_ELEMENTS // (b * hq * nb))
    for a, _, earlier in selection_slices(q, k, block_size=block_size, top_k=top_k, gate=gate, slice_rows=per):
        ib, ih, iq, ij = earlier.nonzero().unbind(1)
        kv = ib * hkv + ih // g
        rows.append((kv * nq + iq + a) * g + ih % g)
        blocks.append(kv * nb + ij)
    rows, blocks = torch.cat(rows), torch.cat(blocks)
    order = torch.argsort(blocks, stable=True)
    return rows[order], blocks[order]


def moba_attention_flash(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockPlan, scale: float | None = None
) -> torch.Tensor:
    """MoBA attention on flash-attn (same contract as `moba_attention_reference`); differentiable in q, k, v.

    q: [B, Hq, Nq, D]; k, v: [B, Hkv, Nk, D]; returns [B, Hq, Nq, D] in q's dtype. Needs CUDA fp16/bf16 tensors.
    """
    check_call(q, k, v, plan)
    block_size = effective_block_size(plan.block_size, k.shape[2])  # bounded by the sequence
    if not flash_attn_takes(q):
        raise ValueError(
            "backend 'flash' needs CUDA float16/bfloat16 tensors with head_dim <= 256 on an sm80+ GPU, got "
            f"device {q.device}, dtype {q.dtype}, head_dim {q.shape[-1]}"
        )
    guarded = route_nonfinite(moba_attention_flash, q, k, v, plan, scale)
    if guarded is not None:
        return guarded
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    g, bs = hq // hkv, block_size
    scale = d**-0.5 if scale is None else float(scale)
    start = nk - nq
    k0 = start // bs * bs  # first key of the first query's block
    # rows flat over [B, Hkv, Nq, g]: the q heads of one kv head side by side
    q_rows = q.unflatten(1, (hkv, g)).transpose(2, 3).reshape(b * hkv * nq, g, d)

    with torch.no_grad():
        firsts = torch.arange(k0, nk, bs, device=q.device)  # own blocks' first keys
        ends = (firsts + bs).clamp_(max=nk)
        own_q = (ends - firsts.clamp(min=start)).repeat(b * hkv)
        own_k = (ends - firsts).repeat(b * hkv)
        rows, blocks = _gated_rows(q, k, bs, plan.top_k, plan.gate) if plan.reaches_back() else (None, None)
    merge = rows is not None and rows.numel() > 0
    k, v = k.to(q.dtype), v.to(q.dtype)  # after the gate, which pools k in its own dtype like the reference
    surrogate = merge and exact_lse_gradient and torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)

    # own blocks: no query has a key before k0, so the keys from k0 on (a copy only when k0 > 0) are the sequences
    k_own, v_own = (t[:, :, k0:].reshape(b * hkv * (nk - k0), 1, d) for t in (k, v))
    out, lse = _attend(q_rows, k_own, v_own, own_q, own_k, scale, True, surrogate)
    if not merge:
        return out.view(b, hkv, nq, g, d).transpose(2, 3).reshape(b, hq, nq, d)

    # gated blocks: every key block of every (batch, kv head) is a sequence, so the key rows need no gather
    nb = num_blocks(nk, bs)
    block_k = torch.full((nb,), bs, device=q.device)
    block_k[-1] = nk - (nb - 1) * bs
    k_flat, v_flat = (t.reshape(b * hkv * nk, 1, d) for t in (k, v))
    q_gated = q_rows.reshape(-1, 1, d).index_select(0, rows)
    counts = torch.bincount(blocks, minlength=b * hkv * nb)
    out_g, lse_g = _attend(q_gated, k_flat, v_flat, counts, block_k.repeat(b * hkv), scale, False, surrogate)

    # in lse's float32 (float64 stays float64)
    merged = merge_lse_rows(out.reshape(-1, d), lse.reshape(-1), out_g.reshape(-1, d), lse_g.reshape(-1), rows)
    return merged.to(q.dtype).view(b, hkv, nq, g, d).transpose(2, 3).reshape(b, hq, nq, d)
