"""What every MoBA backend shares: argument checks, the block gate and its selection, dense causal attention.

Block layout for ``Nk`` keys and ``block_size = 4`` (the last block may be partial)::

    keys     0 1 2 3 | 4 5 6 7 | 8 9 10
    block       0    |    1    |   2

Queries are the *last* ``Nq`` positions of the keys: query ``i`` sits at absolute position
``p = Nk - Nq + i`` (prefill: Nq == Nk; decode: Nq == 1). Its current block is ``p // block_size``.

All backends select blocks through `selected_blocks`, so they agree on every tie and rounding of the gate.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

_MAX_PASS_PICKS = 2  # up to this many gated picks per query, repeated max passes select instead of topk

POOLINGS = ("mean", "max", "mean+max", "bound")


def check_moba_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    block_size: int,
    top_k: int,
    pooling: str = "mean",
    sink_blocks: int = 0,
    local_blocks: int = 0,
) -> None:
    """Raise ValueError naming the parameter, its value and the valid range for any bad argument."""
    for name, value, low in (
        ("block_size", block_size, 1),
        ("top_k", top_k, 1),
        ("sink_blocks", sink_blocks, 0),
        ("local_blocks", local_blocks, 0),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [batch, heads, seq, head_dim], got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in batch (dim 0) and head_dim (dim 3)")
    hq, hkv = q.shape[1], k.shape[1]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    nq, nk = q.shape[2], k.shape[2]
    if nk < 1 or not 1 <= nq <= nk:
        raise ValueError(f"need 1 <= Nq <= Nk (queries are the last Nq keys), got Nq={nq}, Nk={nk}")


def num_blocks(seq_len: int, block_size: int) -> int:
    return -(-seq_len // block_size)


def pooled_keys(k: torch.Tensor, block_size: int, pooling: str) -> torch.Tensor:
    """Pool each block's keys: [B, Hkv, Nk, D] -> [B, Hkv, n_blocks, D] (2D for "mean+max" and "bound").

    "bound" keeps each channel's max and min (as max of -k), Quest's bound on q.k over the block.
    Computed in float32 (float64 stays float64); a partial last block pools only its real keys.
    """
    b, h, n, d = k.shape
    nb = num_blocks(n, block_size)
    kf = gate_features(k.to(gate_dtype(k.dtype)), pooling)
    pad = nb * block_size - n
    blocks = F.pad(kf, (0, 0, 0, pad)).view(b, h, nb, block_size, kf.shape[-1])
    pooled = []
    if pooling in ("mean", "mean+max"):
        counts = torch.full((nb,), float(block_size), dtype=kf.dtype, device=k.device)
        counts[-1] = block_size - pad
        pooled.append(blocks.sum(dim=3) / counts[:, None])
    if pooling in ("max", "mean+max", "bound"):
        if pad:
            blocks = F.pad(kf, (0, 0, 0, pad), value=float("-inf")).view(b, h, nb, block_size, kf.shape[-1])
        pooled.append(blocks.amax(dim=3))
    return pooled[0] if len(pooled) == 1 else torch.cat(pooled, dim=-1)


def gate_features(k: torch.Tensor, pooling: str) -> torch.Tensor:
    """Per-key features that the pooling reduces: k itself, or [k, -k] for "bound" (max of -k = -min)."""
    return torch.cat([k, -k], dim=-1) if pooling == "bound" else k


def gate_width(head_dim: int, pooling: str) -> int:
    """Last dim of the pooled keys."""
    return 2 * head_dim if pooling in ("mean+max", "bound") else head_dim


def gate_queries(q: torch.Tensor, pooling: str) -> torch.Tensor:
    """Queries in the pooled keys' feature space, so that a dot product gives the gate score.

    "mean+max": [q, q] (the sum of both scores). "bound": [relu(q), relu(-q)] against [max k, -min k] gives
    sum_d max(q_d max_d, q_d min_d), the largest q.k any key of the block can reach.
    """
    if pooling == "mean+max":
        return torch.cat([q, q], dim=-1)
    if pooling == "bound":
        return torch.cat([q.clamp(min=0), (-q).clamp(min=0)], dim=-1)
    return q


def gate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def gate_scores(
    q: torch.Tensor, k: torch.Tensor, block_size: int, pooling: str = "mean", pooled: torch.Tensor | None = None
) -> torch.Tensor:
    """Gate score of every (query, block) pair: [B, Hq, Nq, n_blocks], float32 (float64 for float64 input).

    "mean+max" sums the two scores q.mean(K) + q.max(K); "bound" is Quest's upper bound of q.k. `pooled`:
    `pooled_keys(k, block_size, pooling)` when the caller already has it (query slices of one call share it).
    """
    b, hq, nq, d = q.shape
    hkv = k.shape[1]
    if pooled is None:
        pooled = pooled_keys(k, block_size, pooling)  # [B, Hkv, nb, D or 2D]
    qf = gate_queries(q.to(pooled.dtype).reshape(b, hkv, hq // hkv, nq, d), pooling)
    scores = torch.einsum("bhgqd,bhnd->bhgqn", qf, pooled)
    return scores.reshape(b, hq, nq, -1)


def selected_blocks(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    block_size: int,
    top_k: int,
    pooling: str = "mean",
    sink_blocks: int = 0,
    local_blocks: int = 0,
    q_start: int | None = None,
    pooled: torch.Tensor | None = None,
) -> torch.Tensor:
    """Which blocks each query attends: bool [B, Hq, Nq, n_blocks].

    True for the query's current block, the forced sink / local blocks before it, and the `top_k - 1`
    earlier blocks with the highest gate score among the rest; never a future block.
    `q_start` is the absolute position of the first query (default: Nk - Nq, the last Nq keys); backends
    that process queries in slices pass it so each slice selects exactly as the whole would, and `pooled`
    (`pooled_keys` of k) so the keys are pooled once.
    """
    nq, nk = q.shape[2], k.shape[2]
    start = nk - nq if q_start is None else q_start
    nb = num_blocks(nk, block_size)
    with torch.no_grad():
        current = (torch.arange(nq, device=q.device) + start) // block_size  # [Nq]
        # blocks after the last query's block are never chosen: score only up to it (halves a prefill's gate work)
        seen = (start + nq - 1) // block_size + 1
        if top_k > 1 and pooled is None:
            pooled = pooled_keys(k[:, :, : seen * block_size], block_size, pooling)
        chosen = choose_blocks(
            current,
            seen,
            lambda: gate_scores(q, k, block_size, pooling, pooled[:, :, :seen]),
            batch_heads=(q.shape[0], q.shape[1]),
            top_k=top_k,
            sink_blocks=sink_blocks,
            local_blocks=local_blocks,
        )
        return chosen if seen == nb else F.pad(chosen, (0, nb - seen))


def choose_blocks(
    current: torch.Tensor,
    n_blocks: int,
    scores: Callable[[], torch.Tensor],
    *,
    batch_heads: tuple[int, int],
    top_k: int,
    sink_blocks: int,
    local_blocks: int,
) -> torch.Tensor:
    """The MoBA selection rule, given each query's current block [Nq] and its gate scores.

    `scores()` returns [B, Hq, Nq, n_blocks] and is called only when some block is gated (top_k > 1). Returns
    bool [B, Hq, Nq, n_blocks]: the current block, forced sink / local blocks before it, and the top_k - 1
    best-scoring other earlier blocks. Shared by plain MoBA and DCA (whose scores mix query variants).
    """
    blk = torch.arange(n_blocks, device=current.device)
    earlier = blk[None, :] < current[:, None]  # [Nq, nb]
    forced = blk[None, :] == current[:, None]
    if sink_blocks:
        forced = forced | (earlier & (blk[None, :] < sink_blocks))
    if local_blocks:
        forced = forced | (earlier & (blk[None, :] >= current[:, None] - local_blocks))
    selected = forced.expand(*batch_heads, *forced.shape)
    n_pick = min(top_k - 1, n_blocks)
    if n_pick <= 0:
        return selected
    gated = scores().masked_fill(~(earlier & ~forced), float("-inf"))
    picked = torch.zeros_like(gated, dtype=torch.bool)
    if n_pick <= _MAX_PASS_PICKS:  # a max pass per pick beats topk for the paper's top_k = 3 (1.7x on CPU)
        own = current.view(1, 1, -1, 1).expand(*gated.shape[:-1], 1)
        for _ in range(n_pick):
            best, index = gated.max(dim=-1, keepdim=True)
            gated.scatter_(-1, index, float("-inf"))
            # a row out of candidates marks its own block instead (selected anyway)
            picked.scatter_(-1, torch.where(best > float("-inf"), index, own), True)
    else:
        top = gated.topk(n_pick, dim=-1, sorted=False)
        picked.scatter_(-1, top.indices, top.values > float("-inf"))
    return selected | picked


def selection_slices(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    block_size: int,
    top_k: int,
    pooling: str,
    sink_blocks: int,
    local_blocks: int,
    slice_rows: int,
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """`selected_blocks` over query slices of `slice_rows` (bounds the gate scores held at once).

    Yields (index of the slice's first query, selected [B, Hq, n, n_blocks], earlier = selected minus the own
    block). Fast backends treat the own block (causal) apart from the gated earlier blocks.
    """
    nq, nk = q.shape[2], k.shape[2]
    start = nk - nq
    blk = torch.arange(num_blocks(nk, block_size), device=q.device)
    pooled = pooled_keys(k, block_size, pooling) if top_k > 1 else None
    for a in range(0, nq, slice_rows):
        n = min(slice_rows, nq - a)
        selected = selected_blocks(
            q[:, :, a : a + n],
            k,
            block_size=block_size,
            top_k=top_k,
            pooling=pooling,
            sink_blocks=sink_blocks,
            local_blocks=local_blocks,
            q_start=start + a,
            pooled=pooled,
        )
        own = ((torch.arange(n, device=q.device) + start + a) // block_size)[:, None] == blk
        yield a, selected, selected & ~own


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None) -> torch.Tensor:
    """Dense causal attention with the queries at the last Nq key positions (bottom-right aligned), GQA.

    q: [B, Hq, Nq, D], k, v: [B, Hkv, Nk, D] -> [B, Hq, Nq, D]. Uses PyTorch SDPA without copying K/V.
    """
    nq, nk = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if nq == nk:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    if nq == 1:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)
    q_pos = torch.arange(nk - nq, nk, device=q.device)
    mask = q_pos[:, None] >= torch.arange(nk, device=q.device)[None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
