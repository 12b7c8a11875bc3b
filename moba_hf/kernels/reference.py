"""The readable MoBA reference: materializes the full [Nq, Nk] mask. Every fast backend is checked against it."""

from __future__ import annotations

import torch

from .checks import effective_block_size, gate_dtype
from .nonfinite import masked_matmul
from .plan import BlockPlan, check_call
from .selection import selected_blocks


def moba_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockPlan, scale: float | None = None
) -> torch.Tensor:
    """MoBA attention, clarity first.

    q: [B, Hq, Nq, D]; k, v: [B, Hkv, Nk, D] with Hq % Hkv == 0 and Nq <= Nk (queries are the last Nq
    positions); `plan` without a dense tail; `scale` None: head_dim ** -0.5. Returns [B, Hq, Nq, D] in q's dtype.
    Softmax in float32 (float64 stays float64). Every backend has exactly this signature.
    """
    check_call(q, k, v, plan)
    block_size = effective_block_size(plan.block_size, k.shape[2])  # bounded by the sequence
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    scale = d**-0.5 if scale is None else scale

    blocks = selected_blocks(q, k, block_size=block_size, top_k=plan.top_k, gate=plan.gate)  # [B, Hq, Nq, n_blocks]
    key_pos = torch.arange(nk, device=q.device)
    query_pos = torch.arange(nk - nq, nk, device=q.device)
    allowed = blocks[..., key_pos // block_size] & (key_pos[None, :] <= query_pos[:, None])  # [B, Hq, Nq, Nk]

    dtype = gate_dtype(q.dtype)
    group = hq // hkv
    k_rep = k.to(dtype).repeat_interleave(group, dim=1)
    v_rep = v.to(dtype).repeat_interleave(group, dim=1)
    scores = (q.to(dtype) @ k_rep.transpose(-1, -2)) * scale
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
    # a matmul would spread a NaN value to rows that never attend it (0 * NaN = NaN)
    return masked_matmul(probs, allowed, v_rep).to(q.dtype)
