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

from .checks import check_shapes, gate_dtype
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
    check_step_args(q, k, v, real, last)
    b, hq, _, d = q.shape
    hkv, n_slots = k.shape[1], k.shape[2]
    bs, gate = plan.block_size, plan.gate
    pool = BlockStats(gate.pooling, d)  # (not `of`: its cache is C code, which a trace cannot enter)
    if stats.dim() != 4 or stats.shape[:2] != (b, hkv) or stats.shape[2] * bs < n_slots or stats.shape[3] != pool.width:
        raise ValueError(
            f"stats must be [B={b}, Hkv={hkv}, at least {-(-n_slots // bs)} blocks of {bs}, {pool.width}], got shape "
            f"{tuple(stats.shape)}"
        )
    dev = q.device
    nb = stats.shape[2]
    rows = torch.arange(b, device=dev)

    # the new token, and the tokens of each row so far
    new_real = _new_is_real(real, last)  # [B]
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
    k_sel = k.reshape(-1, d).index_select(0, index).view(b, hq, -1, d)
    v_sel = v.reshape(-1, d).index_select(0, index).view(b, hq, -1, d)
    return _attend(q, k_sel, v_sel, valid, new_real, scale)  # [B, Hq, 1, D]


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
    check_step_args(q, k, v, real, last)
    b, hq, _, d = q.shape
    hkv = k.shape[1]
    # the query heads of a KV head as its rows: [B, Hkv, g, D] against the cache's [B, Hkv, L, D]
    out = _attend(q.reshape(b, hkv, hq // hkv, d), k, v, real[:, None], _new_is_real(real, last), scale)
    return out.view(b, hq, 1, d)


def check_step_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, real: torch.Tensor, last: torch.Tensor) -> None:
    """The checks the captured steps share (shapes only: traced, they cost the graph nothing)."""
    check_shapes(q, k, v)
    b, _, nq, _ = q.shape
    n_slots = k.shape[2]
    if nq != 1:
        raise ValueError(f"a captured step takes one new token per row: q must be [B, Hq, 1, D], got {tuple(q.shape)}")
    if real.dtype != torch.bool or real.shape != (b, n_slots):
        raise ValueError(f"real must be a bool [B={b}, slots={n_slots}] tensor, got {real.dtype} {tuple(real.shape)}")
    if last.dim() != 0 or last.is_floating_point():
        raise ValueError(
            f"last must be a 0-d integer tensor (the new token's slot), got {last.dtype} {tuple(last.shape)}"
        )


def _new_is_real(real: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """Whether each row's new token (at slot `last`) is real: bool [B]."""
    return real.gather(1, last.view(1, 1).expand(real.shape[0], 1)).squeeze(1)


def _attend(q, k, v, valid, new_real, scale) -> torch.Tensor:
    """Softmax attention of q [..., M, D] over k, v [..., S, D] where `valid` [..., S] (broadcast over the rows M),
    in `gate_dtype`; zeros for the rows whose new token is a pad (new_real [B]). A key not attended adds nothing,
    even where its value is NaN or inf (an attended one shows it)."""
    dtype = gate_dtype(q.dtype)
    s = q.to(dtype) @ k.to(dtype).transpose(-1, -2)
    probs = (s * (q.shape[-1] ** -0.5 if scale is None else scale)).masked_fill(~valid[..., None, :], float("-inf"))
    out = probs.softmax(-1) @ torch.where(valid[..., None], v.to(dtype), 0.0)
    return torch.where(new_real[:, None, None, None], out, 0.0).to(q.dtype)
