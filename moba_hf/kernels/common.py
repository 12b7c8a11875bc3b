"""What every MoBA backend shares: argument checks, the block gate and its selection, dense causal attention.

Block layout for ``Nk`` keys and ``block_size = 4`` (the last block may be partial)::

    keys     0 1 2 3 | 4 5 6 7 | 8 9 10
    block       0    |    1    |   2

Queries are the *last* ``Nq`` positions of the keys: query ``i`` sits at absolute position
``p = Nk - Nq + i`` (prefill: Nq == Nk; decode: Nq == 1). Its current block is ``p // block_size``.

All backends select blocks through `selected_blocks`, so they agree on every tie and rounding of the gate.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from ..options import POOLINGS  # torch-free, shared with moba_hf.config

_MAX_PASS_PICKS = 2  # up to this many gated picks per query, repeated max passes select instead of topk


def check_count(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class GateOptions:
    """How the gate scores blocks and which blocks it forces, beyond block_size / top_k (see `MobaConfig`).

    pooling:      how a block's keys are pooled for its score, one of `POOLINGS`
    sink_blocks:  the first n blocks, always attended
    local_blocks: the n blocks before the query's own, always attended
    """

    pooling: str = "mean"
    sink_blocks: int = 0
    local_blocks: int = 0

    def __post_init__(self) -> None:
        check_count("sink_blocks", self.sink_blocks, 0)
        check_count("local_blocks", self.local_blocks, 0)
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {self.pooling!r}")

    def reaches_back(self, top_k: int) -> bool:
        """Whether some query may attend a block before its own (else each query sees its own block only)."""
        return top_k > 1 or self.sink_blocks > 0 or self.local_blocks > 0

    def as_kwargs(self) -> dict[str, object]:
        """The public functions' keywords (`pooling=`, `sink_blocks=`, `local_blocks=`)."""
        return dataclasses.asdict(self)


DEFAULT_GATE = GateOptions()  # the paper's gate: mean pooling, no forced blocks


def check_moba_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, block_size: int, top_k: int) -> None:
    """Raise ValueError naming the parameter, its value and the valid range for any bad argument (the gate's
    options are checked by `GateOptions`)."""
    check_count("block_size", block_size, 1)
    check_count("top_k", top_k, 1)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [batch, heads, seq, head_dim], got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in batch (dim 0) and head_dim (dim 3)")
    if q.shape[0] < 1 or q.shape[3] < 1:
        raise ValueError(f"batch (dim 0) and head_dim (dim 3) must be >= 1, got q shape {tuple(q.shape)}")
    hq, hkv = q.shape[1], k.shape[1]
    if hq < 1:  # a result with no heads is never what a model meant (the selection would divide by zero)
        raise ValueError(f"query heads (dim 1) must be >= 1, got q shape {tuple(q.shape)}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    nq, nk = q.shape[2], k.shape[2]
    if nk < 1 or not 1 <= nq <= nk:
        raise ValueError(f"need 1 <= Nq <= Nk (queries are the last Nq keys), got Nq={nq}, Nk={nk}")


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: object) -> None:
    """The public entries' input contract: q, k, v floating-point tensors of one dtype on one device, and `scale`
    None or a finite real number > 0 (integer tensors would come back truncated, scale <= 0 as NaN or garbage)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise ValueError(
                f"{name} must be a floating-point tensor (float16, bfloat16, float32, float64), got {t.dtype}"
            )
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k, v must be on one device, got q {q.device}, k {k.device}, v {v.device}")
    if q.device.type == "meta":  # the block selection reads values
        raise ValueError("q, k, v must hold data (the gate reads their values), got meta tensors")
    if scale is not None and (
        isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale) or scale <= 0
    ):
        raise ValueError(f"scale must be None (head_dim ** -0.5) or a finite number > 0, got {scale!r}")
    if scale is not None and gate_dtype(q.dtype) == torch.float32 and scale > _FLOAT32_MAX:
        # scores are computed in float32 there: the scale would be inf, every score inf or NaN
        raise ValueError(
            f"scale must be at most {_FLOAT32_MAX:.6g} (float32's largest value) for {q.dtype} inputs, whose "
            f"scores are computed in float32; got {scale!r}"
        )


_FLOAT32_MAX = torch.finfo(torch.float32).max
_FLOAT32_UNDERFLOW = math.ldexp(1.0, -150)  # a double at or below it rounds to 0 in float32


def scale_underflows(scale: float, dtype: torch.dtype) -> bool:
    """Whether `scale` rounds to 0 in the scores' dtype (float32 unless `dtype` is float64): every score is then 0,
    as in the reference, but kernels that mask by multiplying -inf with the scale turn masked scores into NaN."""
    return dtype != torch.float64 and scale <= _FLOAT32_UNDERFLOW


def effective_block_size(block_size: int, seq_len: int) -> int:
    """A block longer than the sequence is one block of the sequence's length: same result, memory bounded by the
    sequence, not by the parameter (block_size = 10**11 on 8 tokens must not pad 10**11 keys)."""
    return max(1, min(block_size, seq_len))


def num_blocks(seq_len: int, block_size: int) -> int:
    return -(-seq_len // block_size)


def pooled_keys(k: torch.Tensor, block_size: int, pooling: str) -> torch.Tensor:
    """Pool each block's keys: [B, Hkv, Nk, D] -> [B, Hkv, n_blocks, D] (2D for "mean+max" and "bound").

    "bound" keeps each channel's max and min (as max of -k), Quest's bound on q.k over the block.
    Computed in float32 (float64 stays float64); a partial last block pools only its real keys.
    """
    b, h, n, d = k.shape
    block_size = effective_block_size(block_size, n)
    nb = num_blocks(n, block_size)
    kf = gate_features(k.to(gate_dtype(k.dtype)), pooling)
    pad = nb * block_size - n
    blocks = (F.pad(kf, (0, 0, 0, pad)) if pad else kf).reshape(b, h, nb, block_size, kf.shape[-1])
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
        if torch.is_grad_enabled() and q.requires_grad:
            return torch.cat([q.clamp(min=0), (-q).clamp(min=0)], dim=-1)
        d = q.shape[-1]  # selection (no grad): the halves written into one buffer, no concatenation pass
        features = q.new_empty((*q.shape[:-1], 2 * d))
        torch.clamp(q, min=0, out=features[..., :d])
        torch.neg(q, out=features[..., d:]).clamp_(min=0)
        return features
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
    block_size = effective_block_size(block_size, k.shape[2])
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
    gate: GateOptions = DEFAULT_GATE,
    q_start: int | None = None,
    pooled: torch.Tensor | None = None,
    trim: bool = False,
) -> torch.Tensor:
    """Which blocks each query attends: bool [B, Hq, Nq, n_blocks] (trim: only up to the last query's block).

    True for the query's current block, the forced sink / local blocks before it, and the `top_k - 1`
    earlier blocks with the highest gate score among the rest; never a future block.
    `q_start` is the absolute position of the first query (default: Nk - Nq, the last Nq keys); backends
    that process queries in slices pass it so each slice selects exactly as the whole would, and `pooled`
    (`pooled_keys` of k) so the keys are pooled once.
    """
    nq, nk = q.shape[2], k.shape[2]
    start = nk - nq if q_start is None else q_start
    block_size = effective_block_size(block_size, nk)
    nb = num_blocks(nk, block_size)
    with torch.no_grad():
        current = (torch.arange(nq, device=q.device) + start) // block_size  # [Nq]
        # blocks after the last query's block are never chosen: score only up to it (halves a prefill's gate work)
        seen = (start + nq - 1) // block_size + 1
        if top_k > 1 and pooled is None:
            pooled = pooled_keys(k[:, :, : seen * block_size], block_size, gate.pooling)
        chosen = choose_blocks(
            current,
            seen,
            lambda: gate_scores(q, k, block_size, gate.pooling, pooled[:, :, :seen]),
            batch_heads=(q.shape[0], q.shape[1]),
            top_k=top_k,
            gate=gate,
            first_block=start // block_size,
        )
        return chosen if seen == nb or trim else F.pad(chosen, (0, nb - seen))


def block_masks(current: torch.Tensor, n_blocks: int, gate: GateOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """(forced, excluded) bool [..., Nq, n_blocks] for each query's current block (current: [Nq] or [B, 1, Nq]):
    forced = the current block and the sink / local blocks before it (attended without gating); excluded = every
    block that is no gated candidate (forced, or not earlier than the current block)."""
    blk = torch.arange(n_blocks, device=current.device)
    earlier = blk < current[..., None]  # [..., Nq, nb]
    forced = blk == current[..., None]
    if gate.sink_blocks:
        forced = forced | (earlier & (blk < gate.sink_blocks))
    if gate.local_blocks:
        forced = forced | (earlier & (blk >= current[..., None] - gate.local_blocks))
    return forced, ~(earlier & ~forced)


def choose_blocks(
    current: torch.Tensor | None,
    n_blocks: int,
    scores: Callable[[], torch.Tensor],
    *,
    batch_heads: tuple[int, int],
    top_k: int,
    gate: GateOptions,
    first_block: int = 0,
    masks: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The MoBA selection rule, given each query's current block and its gate scores.

    current: [Nq], or [B, 1, Nq] when batch rows differ (decode over left-padded rows).

    `scores()` returns a new [B, Hq, Nq, n_blocks] tensor (masked in place) and is called only when some block is
    gated (top_k > 1). Returns
    bool [B, Hq, Nq, n_blocks]: the current block, forced sink / local blocks before it, and the top_k - 1
    best-scoring other earlier blocks. Shared by plain MoBA and DCA (whose scores mix query variants);
    `gate.pooling` is already in the scores. first_block: no query's current block is below it (lets the
    exclusion mask skip the columns that are candidates for every row; 0 masks all). masks: `block_masks` of
    these arguments, when the caller keeps them (a decode step's are the same for a whole block of steps; current
    may then be None).
    """
    forced, excluded = block_masks(current, n_blocks, gate) if masks is None else masks
    selected = forced.expand(*batch_heads, *forced.shape[-2:])
    n_pick = min(top_k - 1, n_blocks)
    if n_pick <= 0:
        return selected if masks is None else selected.clone()  # the caller's kept masks stay untouched
    # a NaN score (a NaN key pooled into the block, or a NaN query) ranks first, as in torch.max / topk, and its
    # block is picked: the row then attends the NaN and shows it instead of hiding it behind other blocks
    gated = scores()
    # -inf marks the blocks a row may not pick: a candidate scoring -inf (an inf key pooled into it) ranks last
    # among candidates instead, so top_k >= the blocks still attends every earlier block (clamp keeps NaN)
    gated.clamp_(min=torch.finfo(gated.dtype).min)
    # columns between the sink blocks and the first query's local window are candidates for every row: only the
    # columns around them need the mask (a long prefill's slice then masks a few columns, not all of them)
    first = max(0, first_block - gate.local_blocks)
    if gate.sink_blocks:
        gated[..., : gate.sink_blocks].masked_fill_(excluded[..., : gate.sink_blocks], float("-inf"))
    gated[..., first:].masked_fill_(excluded[..., first:], float("-inf"))
    if n_pick <= _MAX_PASS_PICKS:  # a max pass per pick beats topk for the paper's top_k = 3 (1.7x on CPU)
        # each pass sets its row's best candidate to -inf; a row out of candidates sets an excluded (-inf) entry
        # again, picking nothing: afterwards the picked blocks are the candidates at -inf
        for _ in range(n_pick):
            gated.scatter_(-1, gated.max(dim=-1, keepdim=True).indices, float("-inf"))
        return selected | (gated.isneginf() & ~excluded)
    top = gated.topk(n_pick, dim=-1, sorted=False)
    picked = torch.zeros_like(gated, dtype=torch.bool).scatter_(-1, top.indices, top.values != float("-inf"))
    return selected | picked


def selection_slices(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    block_size: int,
    top_k: int,
    gate: GateOptions,
    slice_rows: int,
    trim: bool = False,
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """`selected_blocks` over query slices of `slice_rows` (bounds the gate scores held at once).

    Yields (index of the slice's first query, selected [B, Hq, n, n_blocks], earlier = selected minus the own
    block). Fast backends treat the own block (causal) apart from the gated earlier blocks. trim: the last dim
    ends at the slice's last block (later blocks are never selected; half the width of a long prefill's).
    """
    nq, nk = q.shape[2], k.shape[2]
    start = nk - nq
    block_size = effective_block_size(block_size, nk)
    pooled = pooled_keys(k, block_size, gate.pooling) if top_k > 1 else None
    for a in range(0, nq, slice_rows):
        n = min(slice_rows, nq - a)
        selected = selected_blocks(
            q[:, :, a : a + n],
            k,
            block_size=block_size,
            top_k=top_k,
            gate=gate,
            q_start=start + a,
            pooled=pooled,
            trim=trim,
        )
        yield a, selected, without_own_block(selected, start + a, block_size)


def without_own_block(selected: torch.Tensor, first_position: int, block_size: int) -> torch.Tensor:
    """selected [B, Hq, n, m] of the queries at positions first_position.. without each query's own block: the
    gated earlier blocks, which fast backends run apart from the own (causal) block."""
    n, m = selected.shape[2], selected.shape[3]
    own = (torch.arange(n, device=selected.device) + first_position) // block_size
    return selected & (own[:, None] != torch.arange(m, device=selected.device))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None) -> torch.Tensor:
    """Dense causal attention with the queries at the last Nq key positions (bottom-right aligned), GQA.

    q: [B, Hq, Nq, D], k, v: [B, Hkv, Nk, D] -> [B, Hq, Nq, D]. Uses PyTorch SDPA without copying K/V.
    """
    check_inputs(q, k, v, scale)
    check_moba_args(q, k, v, block_size=1, top_k=1)
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


# --- NaN / inf inputs ---------------------------------------------------------------------------------------------
# Fused kernels return 0 for a row whose scores are all NaN, and 0 * NaN = NaN spreads a NaN value to rows that
# never attend it. The rule every backend follows instead (the reference's arithmetic): a row with a NaN / inf
# query is NaN; a row attending a NaN value is NaN in that channel, one attending +inf / -inf values is +inf / -inf
# there (NaN for both); NaN / inf keys go through the kernels as they are (masked keys never reach a score).
_HIT_ROWS = 1024
_HIT_ELEMENTS = 1 << 24  # allowed-mask elements per slice while finding the rows that attend a non-finite value


def all_finite(t: torch.Tensor) -> bool:
    """No NaN / inf in t. One sum answers the common case without a bool copy of t; only a non-finite sum (a NaN /
    inf, or huge finite values overflowing) pays for the exact check."""
    return bool(torch.isfinite(t.sum(dtype=gate_dtype(t.dtype)))) or bool(t.isfinite().all())


def has_nonfinite(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether q or v holds a NaN / inf: then backends run `propagate_nonfinite`."""
    return not (all_finite(q) and all_finite(v))


def masked_matmul(probs: torch.Tensor, allowed: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """probs @ v where row i reads only its `allowed` keys: probs, allowed [..., M, N] (allowed broadcastable),
    v [..., N, D] with the same leading dims as probs. Exact for NaN / inf values: each row sums only the values
    it attends, so a non-finite value reaches no other row."""
    if all_finite(v):  # one reduction answers the usual case
        return probs @ v
    bad = ~v.isfinite()
    out = probs @ v.masked_fill(bad, 0)
    m, n, d = probs.shape[-2], probs.shape[-1], v.shape[-1]
    lead = probs.shape[:-2]
    probs3, allowed3 = probs.reshape(-1, m, n), allowed.expand(*lead, m, n).reshape(-1, m, n)
    v3, out3 = v.reshape(-1, n, d), out.reshape(-1, m, d)
    il, ij, idim = bad.reshape(-1, n, d).nonzero(as_tuple=True)
    rows = torch.arange(m, device=v.device)[None, :]
    step = max(1, _HIT_ELEMENTS // m)  # bounds the [entries, M] terms held at once
    for a in range(0, il.numel(), step):
        bl, bj, bd = il[a : a + step], ij[a : a + step], idim[a : a + step]
        term = torch.where(allowed3[bl, :, bj], probs3[bl, :, bj] * v3[bl, bj, bd][:, None], 0)
        out3 = out3.index_put((bl[:, None], rows, bd[:, None]), term, accumulate=True)
    return out3.view(out.shape)


def value_hits(
    v: torch.Tensor, n_heads: int, n_queries: int, allowed: Callable[[int, int, torch.Tensor], torch.Tensor]
) -> torch.Tensor | None:
    """Where rows attend non-finite values: float [B, Hq, Nq, D] holding NaN, +inf or -inf where the row attends
    such values in that channel (NaN for both signs of inf), 0 elsewhere; None if v is finite.

    allowed(a, n, keys): bool [B, Hq, n, len(keys)], whether query rows a .. a + n - 1 attend the key positions
    `keys` (the backend's selection). Only the positions holding a non-finite value are looked at, so a few bad
    values cost O(Nq x their count), not O(Nq x Nk).
    """
    if bool(v.isfinite().all()):
        return None
    b, hkv, nk, d = v.shape
    g = n_heads // hkv
    keys = (~v.isfinite()).any(dim=-1).flatten(0, 1).any(dim=0).nonzero().flatten()  # positions with a bad value
    vk = v[:, :, keys]
    # channels [NaN, +inf, -inf] side by side; a 0/1 matmul counts the attended ones exactly
    ind = torch.cat([vk.isnan(), vk == float("inf"), vk == float("-inf")], dim=-1).to(torch.float32)
    hits = v.new_zeros(b, n_heads, n_queries, d)
    # rows per slice: bounded by the mask's size and by the selection `allowed` computes for them
    rows = max(1, min(_HIT_ROWS, _HIT_ELEMENTS // (b * n_heads * keys.numel())))
    for a in range(0, n_queries, rows):
        n = min(rows, n_queries - a)
        mask = allowed(a, n, keys).to(torch.float32).reshape(b, hkv, g * n, keys.numel())
        count = (mask @ ind).reshape(b, n_heads, n, 3, d) > 0
        nan = count[..., 0, :] | (count[..., 1, :] & count[..., 2, :])
        value = torch.where(count[..., 1, :], float("inf"), torch.where(count[..., 2, :], float("-inf"), 0.0))
        hits[:, :, a : a + n] = value.masked_fill(nan, float("nan")).to(hits.dtype)
    return hits


def moba_allowed(
    q: torch.Tensor, k: torch.Tensor, *, block_size: int, top_k: int, gate: GateOptions
) -> Callable[[int, int, torch.Tensor], torch.Tensor]:
    """`value_hits`' allowed(a, n, keys) for MoBA: the shared selection, causal."""
    nq, nk = q.shape[2], k.shape[2]
    block_size = effective_block_size(block_size, nk)

    def allowed(a: int, n: int, keys: torch.Tensor) -> torch.Tensor:
        sel = selected_blocks(q[:, :, a : a + n], k, block_size=block_size, top_k=top_k, gate=gate, q_start=nk - nq + a)
        q_pos = torch.arange(nk - nq + a, nk - nq + a + n, device=q.device)
        return sel[..., keys // block_size] & (keys[None, :] <= q_pos[:, None])

    return allowed


def propagate_nonfinite(
    attend: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    q: torch.Tensor,
    v: torch.Tensor,
    allowed: Callable[[int, int], torch.Tensor],
) -> torch.Tensor:
    """attend(q, v) -> [B, Hq, Nq, D] run on finite copies of q and v, then the NaN / inf rule above applied on top.

    allowed: as in `value_hits`, computed from the original q (the selection a row made with its NaN query does
    not matter: the row is NaN). Gradients flow through the finite copies: finite rows keep finite gradients.
    """
    q_bad = ~q.isfinite()
    v_bad = ~v.isfinite()
    out = attend(q.masked_fill(q_bad, 0), v.masked_fill(v_bad, 0))
    hits = value_hits(v, q.shape[1], q.shape[2], allowed)
    if hits is not None:
        out = torch.where(hits != 0, hits.to(out.dtype), out)
    return out.masked_fill(q_bad.any(dim=-1, keepdim=True), float("nan"))


def _causal_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
    """`causal_attention` for non-finite keys / values: masked scores, exact for NaN / inf, in row slices."""
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    scale = d**-0.5 if scale is None else scale
    dtype = gate_dtype(q.dtype)
    kf, vf = (t.to(dtype).repeat_interleave(hq // hkv, dim=1) for t in (k, v))
    rows = max(1, _HIT_ELEMENTS // max(1, b * hq * nk))
    out = []
    for a in range(0, nq, rows):
        q_pos = torch.arange(nk - nq + a, nk - nq + min(nq, a + rows), device=q.device)
        allowed = torch.arange(nk, device=q.device)[None, :] <= q_pos[:, None]
        scores = (q[:, :, a : a + rows].to(dtype) @ kf.transpose(-1, -2)) * scale
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
        out.append(masked_matmul(probs, allowed, vf))
    return torch.cat(out, dim=2).to(q.dtype)


class _ValueOf(torch.autograd.Function):
    """y's value with x's gradient (x, y of one shape)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return y.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def finite_key_gradients(attend: Callable[[torch.Tensor], torch.Tensor], k: torch.Tensor) -> torch.Tensor:
    """attend(k) with the gradients of attend(k with its NaN / inf entries zeroed), for kernels whose backward
    multiplies a masked score's zero gradient by its key (0 * NaN would reach rows that never saw the key).
    The rows that do see a non-finite key keep their NaN value; their gradients, and the others', stay finite."""
    with torch.no_grad():
        value = attend(k)
    return _ValueOf.apply(attend(k.masked_fill(~k.isfinite(), 0)), value)


def needs_grad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether autograd will ask for gradients of an attention over q, k, v."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))


def needs_finite_key_gradients(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    return needs_grad(q, k, v) and not all_finite(k)


def propagate_moba_nonfinite(
    attend: Callable[..., torch.Tensor], q, k, v, *, scale, block_size: int, top_k: int, gate: GateOptions
) -> torch.Tensor:
    """`propagate_nonfinite` for a backend `attend` (the public signature) under MoBA's selection."""
    kw = dict(scale=scale, block_size=block_size, top_k=top_k, **gate.as_kwargs())
    allowed = moba_allowed(q, k, block_size=block_size, top_k=top_k, gate=gate)
    return propagate_nonfinite(lambda q_, v_: attend(q_, k, v_, **kw), q, v, allowed)


def route_nonfinite(
    attend: Callable[..., torch.Tensor], q, k, v, *, scale, block_size: int, top_k: int, gate: GateOptions
) -> torch.Tensor | None:
    """For kernels that cannot carry NaN / inf themselves: the result of the backend `attend` (the public
    signature) with NaN / inf propagated exactly as in the reference, or None when the inputs need no such care."""
    if has_nonfinite(q, v):
        return propagate_moba_nonfinite(attend, q, k, v, scale=scale, block_size=block_size, top_k=top_k, gate=gate)
    if needs_finite_key_gradients(q, k, v):
        kw = dict(scale=scale, block_size=block_size, top_k=top_k, **gate.as_kwargs())
        return finite_key_gradients(lambda k_: attend(q, k_, v, **kw), k)
    return None


def cuda_or_triton_interpreter(q: torch.Tensor) -> bool:
    """Where the Triton kernels run: CUDA tensors, or any with the interpreter on (TRITON_INTERPRET=1)."""
    return q.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


FLEX_CPU_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # FlexAttention's CPU kernel has no float64


def flex_takes(q: torch.Tensor) -> bool:
    """What FlexAttention runs: any tensor off the CPU, CPU tensors of `FLEX_CPU_DTYPES`."""
    return q.device.type != "cpu" or q.dtype in FLEX_CPU_DTYPES


def flash_attn_takes(q: torch.Tensor) -> bool:
    """What flash-attn 2 accepts: CUDA fp16/bf16, head_dim <= 256, an Ampere or newer GPU."""
    return (
        q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and q.shape[-1] <= 256
        and torch.cuda.get_device_capability(q.device)[0] >= 8
    )
