"""A MoBA decode step over a pre-allocated cache in fixed shapes and device ops only: what a CUDA graph can capture.

`kernels.decode` reads the step's facts on the host (how many tokens each row holds, which blocks were picked) to
read only the picked blocks with as few calls as possible. A captured graph replays its kernels without running
any Python, so every such fact must come from a tensor here, and every shape must be the same at every step:

    slots      0   1   2   3   4   5   6   7   8   9   ... L - 1      the cache's slots (max_cache_len)
    real       .   .   x   x   x   x   x   x   x   .                 . pad or not yet written, x a real token
    position           0   1   2   3   4   5   6                     each real token's place in its row's sequence
    last                                       ^                     the new token's slot (written this step)

Blocks are laid over each row's real tokens (pads and gaps dropped, as the padded prefill path lays them), the new
token's block holds its row's keys so far, and the statistics of every block (`pooling.BlockStats`) live in one
tensor of all max_cache_len / block_size blocks, updated in place with the new key. The selection is
`choose_blocks`, the rule every path shares; the attention reads the top_k + sink + local block slots of each
query head, masked where a slot was not picked or lies past the row's tokens. The cost is the picked blocks' keys
and values plus a few passes over [B, max_cache_len] integers (the positions); no length is read on the host.
"""

from __future__ import annotations

import torch

from .checks import gate_dtype
from .plan import BlockPlan
from .pooling import BlockStats, gate_queries
from .selection import choose_blocks


def graph_decode_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    stats: torch.Tensor,
    real: torch.Tensor,
    last: torch.Tensor,
    plan: BlockPlan,
    scale: float | None = None,
) -> torch.Tensor:
    """MoBA attention of each row's new token over its row's real tokens, in fixed shapes (see the module's notes).

    q: [B, Hq, 1, D], the new tokens' queries; k, v: [B, Hkv, L, D], the pre-allocated cache, the new tokens' keys
    and values already written at slot `last` (a 0-d integer tensor: every row writes the same slot);
    real: bool [B, L], the slots holding real tokens (written, not padding), the new one included if it is real;
    stats: [B, Hkv, n_blocks >= ceil(L / block_size), width] float (`gate_dtype`), the `BlockStats` of each row's
    blocks of its real tokens before this step; the new key is merged in place where it is real.
    Returns [B, Hq, 1, D] in q's dtype: `moba_attention` of the new token over its row's real tokens (zeros for a
    row whose new token is a pad, as the padded paths give a pad query)."""
    b, hq, _, d = q.shape
    hkv, n_slots = k.shape[1], k.shape[2]
    dev = q.device
    bs, gate = plan.block_size, plan.gate
    pool = BlockStats(gate.pooling, d)  # (not `of`: its cache is C code, which a trace cannot enter)
    nb = stats.shape[2]
    rows = torch.arange(b, device=dev)

    # the new token, and the tokens of each row so far
    new_real = real.gather(1, last.view(1, 1).expand(b, 1)).squeeze(1)  # [B]
    count = real.sum(dim=-1)  # [B], the new token included where real
    block = (count - 1).clamp(min=0) // bs  # the new token's block [B]
    x = k.index_select(2, last.view(1))[:, :, 0].to(stats.dtype)  # [B, Hkv, D]
    before = stats[rows, :, block]  # [B, Hkv, width]
    merged = pool.merged(before, pool.of_keys(x))
    stats[rows, :, block] = torch.where(new_real[:, None, None], merged, before)

    # the gate: every block's pooled key (empty blocks pool to zeros and lie after the new token's: never picked)
    filled = (count[:, None] - torch.arange(nb, device=dev) * bs).clamp(0, bs)  # [B, nb]
    pooled = pool.pooled(stats, filled.to(stats.dtype)[:, None])  # [B, Hkv, nb, width]
    g = hq // hkv

    def scores() -> torch.Tensor:
        gate_q = gate_queries(q.to(pooled.dtype).reshape(b, hkv, g, d), gate.pooling)
        return (gate_q @ pooled.transpose(-1, -2)).view(b, hq, 1, nb)

    with torch.no_grad():
        selected = choose_blocks(
            block[:, None, None], nb, scores, batch_heads=(b, hq), top_k=plan.top_k, gate=gate, head_dim=d
        )  # [B, Hq, 1, nb]

    # the picked blocks' slots: at most top_k (own included) + sink + local per query head
    n_slots_read = min(nb, plan.top_k + gate.sink_blocks + gate.local_blocks)
    picked, blk = selected[:, :, 0].to(torch.int8).topk(n_slots_read, dim=-1, sorted=False)  # [B, Hq, U]
    position = blk[..., None] * bs + torch.arange(bs, device=dev)  # [B, Hq, U, bs] sequence positions
    valid = picked.bool()[..., None] & (position < count[:, None, None, None])
    position, valid = position.flatten(2), valid.flatten(2)  # [B, Hq, S]

    # sequence position -> slot, per row (a pad or an unwritten slot goes to the spare column n_slots)
    sequence = torch.where(real, real.cumsum(dim=-1) - 1, n_slots)
    slot_of = torch.zeros(b, n_slots + 1, dtype=torch.long, device=dev)
    slot_of.scatter_(1, sequence, torch.arange(n_slots, device=dev).expand(b, n_slots))
    slot = slot_of.gather(1, position.clamp(max=n_slots).flatten(1)).view(position.shape)  # [B, Hq, S]

    kv_head = torch.arange(hq, device=dev) // g
    run = (rows[:, None] * hkv + kv_head)[:, :, None] * n_slots  # [B, Hq, 1]: each query head's KV run
    index = (run + slot).flatten()
    dtype = gate_dtype(q.dtype)
    k_sel = k.reshape(-1, d).index_select(0, index).view(b, hq, -1, d).to(dtype)
    v_sel = v.reshape(-1, d).index_select(0, index).view(b, hq, -1, d).to(dtype)

    s = q.to(dtype) @ k_sel.transpose(-1, -2)  # [B, Hq, 1, S]
    probs = (s * (d**-0.5 if scale is None else scale)).masked_fill(~valid[:, :, None], float("-inf")).softmax(-1)
    # a slot not attended adds nothing, even where its value is NaN or inf (an attended one shows it)
    out = probs @ torch.where(valid[..., None], v_sel, 0.0)
    return torch.where(new_real[:, None, None, None], out, 0.0).to(q.dtype)


def graph_dense_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    real: torch.Tensor,
    last: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Dense attention of each row's new token over its row's real tokens, in fixed shapes (`graph_decode_step`'s
    arguments, without block statistics): a dense layer's or `decode = "full"`'s step. Returns [B, Hq, 1, D]."""
    b, hq, _, d = q.shape
    hkv = k.shape[1]
    new_real = real.gather(1, last.view(1, 1).expand(b, 1)).squeeze(1)
    dtype = gate_dtype(q.dtype)
    s = q.to(dtype).view(b, hkv, hq // hkv, d) @ k.to(dtype).transpose(-1, -2)  # [B, Hkv, g, L]
    probs = (s * (d**-0.5 if scale is None else scale)).masked_fill(~real[:, None, None], float("-inf")).softmax(-1)
    out = probs @ torch.where(real[:, None, :, None], v.to(dtype), 0.0)  # a pad's value reaches no row
    return torch.where(new_real[:, None, None, None], out.view(b, hq, 1, d), 0.0).to(q.dtype)
