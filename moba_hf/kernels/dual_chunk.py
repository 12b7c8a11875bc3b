"""Dual Chunk Attention, dense and composed with MoBA. Pure PyTorch, no transformers import.

Inputs are already remapped: keys rotated at ``j mod s`` (as they sit in the KV cache) and queries at
their intra-chunk position ``i mod s``. The successive / inter query variants are rotations of that query
(`kernels.rope.rotate`). For a query tile inside chunk m the keys split into three contiguous parts::

    keys    [0, (m-1)s)        [(m-1)s, ms)          [ms, i]
    query   inter: c-1         successive            intra: i mod s (causal)

Each part gives (output, row max, row sum) in float32 (float64 stays float64); the parts merge through
their log-sum-exp. With MoBA, a block's gate score uses the query variant of the block's part, and only
selected blocks enter each part.
"""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Iterator

import torch

from .causal import causal_attention, with_dense_tail
from .checks import check_inputs, check_shapes, gate_dtype, num_blocks
from .dense import attention_with_lse, fused_available, merge_lse_, merge_partials, partial_attention
from .dual_chunk_positions import INTER, INTRA, SUCCESSIVE, query_positions
from .nonfinite import all_finite, has_nonfinite, propagate_nonfinite
from .plan import BlockPlan
from .pooling import pooled_keys
from .rope import rotate
from .selection import choose_blocks, gate_scores
from .torch_impl import attention_with_query_variants

# elements of one score tile [B, Hq, T, Nk]: bounds the memory of a prefill (2**27 float32 = 512 MiB)
TILE_ELEMENTS = 1 << 27


def _check_dca(pretraining_length: int, chunk_size: int, inv_freq: torch.Tensor, head_dim: int) -> None:
    if isinstance(pretraining_length, bool) or not isinstance(pretraining_length, int) or pretraining_length < 2:
        raise ValueError(f"pretraining_length must be an integer >= 2, got {pretraining_length!r}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or not 0 < chunk_size < pretraining_length:
        raise ValueError(
            f"chunk_size must be an integer with 0 < chunk_size < pretraining_length (1..{pretraining_length - 1}), "
            f"got {chunk_size!r}"
        )
    if inv_freq.dim() != 1 or 2 * inv_freq.shape[0] != head_dim:
        raise ValueError(f"inv_freq must have shape [head_dim / 2] = [{head_dim // 2}], got {tuple(inv_freq.shape)}")


def query_variants(
    q: torch.Tensor, nk: int, pretraining_length: int, chunk_size: int, inv_freq: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The intra, successive and inter versions of q (rotated at i mod s), only those some key needs, stacked in
    one buffer: [V, B, Hq, Nq, D] in `dtype` (V = 1..3; the block attention gathers rows of all of them)."""
    nq = q.shape[2]
    count = 1 + sum(nk > which * chunk_size for which in (1, 2))  # some key lies `which` chunks before the last query
    positions = query_positions(torch.arange(nk - nq, nk, device=q.device), pretraining_length, chunk_size)
    moves = [positions[:, which] - positions[:, 0] for which in range(1, count)]
    if torch.is_grad_enabled() and q.requires_grad:
        return torch.stack([q.to(dtype), *(rotate(q, delta, inv_freq, dtype) for delta in moves)])
    variants = torch.empty((count, *q.shape), dtype=dtype, device=q.device)
    variants[0].copy_(q)
    for which, delta in enumerate(moves, start=1):
        rotate(q, delta, inv_freq, dtype, out=variants[which])
    return variants


_SCORE_ELEMENTS = 1 << 24  # gate scores held at once while selecting (rows x blocks x batch x heads)
_PART_SCORE_ELEMENTS = 1 << 20  # the same on each CPU worker, beside its block attention


def dca_selection_slices(
    variants: torch.Tensor,
    k: torch.Tensor,
    *,
    chunk_size: int,
    plan: BlockPlan,
    queries: tuple[int, int] | None = None,
    slice_elements: int = _SCORE_ELEMENTS,
    pooled: torch.Tensor | None = None,
) -> Iterator[tuple[int, torch.Tensor]]:
    """`dca_selected_blocks` over query slices: yields (index of the slice's first query, selected [B, Hq, n,
    seen]), seen = blocks up to the slice's last query's (later ones are never chosen). queries: the range
    [first, end) of the queries to cover (default all); slice_elements bounds the gate scores held at once;
    pooled: `pooled_keys(k, ...)` when the caller has it. A slice never crosses a chunk boundary, so each region's
    blocks are scored once, with its own variant."""
    b, hq, nq = variants[0].shape[:3]
    nk = k.shape[2]
    block_size, top_k, gate = plan.block_size, plan.top_k, plan.gate
    first = nk - nq  # position of query 0
    per_chunk = chunk_size // block_size
    lo_query, hi_query = queries or (0, nq)
    if pooled is None and top_k > 1:
        pooled = pooled_keys(k, block_size, gate.pooling)
    rows = max(1, slice_elements // max(1, b * hq * num_blocks(first + hi_query, block_size)))
    a = lo_query
    while a < hi_query:
        chunk = (first + a) // chunk_size
        end = min(hi_query, a + rows, (chunk + 1) * chunk_size - first)  # a slice never crosses a chunk boundary
        seen = (first + end - 1) // block_size + 1

        def scores(a: int = a, end: int = end, chunk: int = chunk, seen: int = seen) -> torch.Tensor:
            # older chunks, the previous chunk, the own chunk: each with its region's query variant
            cuts = [0, max(chunk - 1, 0) * per_chunk, chunk * per_chunk, seen]
            parts = []
            for which, (lo, hi) in zip((INTER, SUCCESSIVE, INTRA), itertools.pairwise(cuts), strict=True):
                if hi > lo:
                    qv = variants[min(which, len(variants) - 1)][:, :, a:end]
                    parts.append(gate_scores(qv, k, block_size, gate.pooling, pooled[:, :, lo:hi]))
            return torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]

        current = torch.arange(first + a, first + end, device=k.device) // block_size
        rule = dict(top_k=top_k, gate=gate, first_block=(first + a) // block_size, head_dim=k.shape[3])
        yield a, choose_blocks(current, seen, scores, batch_heads=(b, hq), **rule)
        a = end


def dca_selected_blocks(
    variants: torch.Tensor,
    k: torch.Tensor,
    *,
    chunk_size: int,
    plan: BlockPlan,
) -> torch.Tensor:
    """MoBA selection under DCA: bool [B, Hq, Nq, n_blocks].

    Same rule as `kernels.selected_blocks` (own block, forced sink / local blocks, then the top_k - 1
    best earlier blocks), but block b's gate score is q_variant . pool(K_b) with the variant of b's region.
    """
    b, hq, nq = variants[0].shape[:3]
    nb = num_blocks(k.shape[2], plan.block_size)
    selected = torch.zeros(b, hq, nq, nb, dtype=torch.bool, device=k.device)
    with torch.no_grad():
        for a, chosen in dca_selection_slices(variants, k, chunk_size=chunk_size, plan=plan):
            selected[:, :, a : a + chosen.shape[2], : chosen.shape[3]] = chosen
    return selected


def dca_selection(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    pretraining_length: int,
    chunk_size: int,
    inv_freq: torch.Tensor,
    plan: BlockPlan,
) -> torch.Tensor:
    """The blocks `dca_attention` with these arguments lets each query attend: bool [B, Hq, Nq, n_blocks]
    (q, k as `dca_attention` takes them; a dense tail is the caller's to apply)."""
    variants = query_variants(q, k.shape[2], pretraining_length, chunk_size, inv_freq, gate_dtype(q.dtype))
    return dca_selected_blocks(variants, k, chunk_size=chunk_size, plan=plan)


def dca_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    pretraining_length: int,
    chunk_size: int,
    inv_freq: torch.Tensor,
    scale: float | None = None,
    temperature: float = 1.0,
    plan: BlockPlan | None = None,
) -> torch.Tensor:
    """Dual Chunk Attention; with a `plan`, composed with MoBA.

    q: [B, Hq, Nq, D] rotated at (i mod chunk_size); k, v: [B, Hkv, Nk, D], k rotated at (j mod chunk_size);
    the queries are the last Nq of the Nk positions. inv_freq: [D / 2], the model's RoPE inverse frequencies.
    temperature multiplies the logits (1.0 = off). plan None: dense causal DCA; otherwise MoBA under `plan` (its
    dense tail runs dense DCA), whose block_size divides chunk_size. Returns [B, Hq, Nq, D] in q's dtype.
    """
    dca = dict(pretraining_length=pretraining_length, chunk_size=chunk_size, inv_freq=inv_freq, scale=scale)
    dca["temperature"] = temperature
    check_inputs(q, k, v, scale)
    check_shapes(q, k, v)
    if plan is not None and not isinstance(plan, BlockPlan):
        raise ValueError(f"plan must be a BlockPlan or None (dense DCA), got {type(plan).__name__}")
    if plan is not None and plan.dense_tail:
        sparse, dense = plan.sparse, None
        return with_dense_tail(
            q,
            k,
            v,
            plan.dense_tail,
            lambda q_, k_, v_: dca_attention(q_, k_, v_, **dca, plan=sparse),
            lambda q_, k_, v_: dca_attention(q_, k_, v_, **dca, plan=dense),
        )
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not 0 < temperature < math.inf:
        raise ValueError(f"temperature must be a finite number > 0 (1.0 = off), got {temperature!r}")
    block_size = None if plan is None else plan.block_size
    if plan is not None and chunk_size % block_size:
        raise ValueError(f"chunk_size ({chunk_size}) must be a multiple of block_size ({block_size})")
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    _check_dca(pretraining_length, chunk_size, inv_freq, d)
    s, g = chunk_size, hq // hkv
    dtype = gate_dtype(q.dtype)
    variants = query_variants(q, nk, pretraining_length, s, inv_freq, dtype)

    def whole_selection() -> torch.Tensor | None:
        return None if plan is None else dca_selected_blocks(variants, k, chunk_size=s, plan=plan)

    if has_nonfinite(q, v):  # the kernels' NaN / inf rule (see kernels.nonfinite.propagate_nonfinite)
        allowed = _allowed(q, k, whole_selection(), block_size)  # the selection of the original q, as the reference's
        return propagate_nonfinite(lambda q_, v_: dca_attention(q_, k, v_, **dca, plan=plan), q, v, allowed)
    scale = (d**-0.5 if scale is None else scale) * temperature
    # inference on CPU: fused pieces merged by log-sum-exp (dense: one call per part; MoBA: the torch kernel's
    # gathered blocks, each reading the query variant of its region)
    fast = fused_available(q) and not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)))
    fast = fast and all_finite(k)  # the fused op zeroes a row whose scores are all NaN
    if plan is None:
        if fast:
            return _dense_dca_by_parts(variants, k, v, s, scale).to(q.dtype)
        return _dense_dca(variants, k, v, s, scale).to(q.dtype)
    if fast:  # each worker selects the blocks of its own queries, slice by slice, then attends them
        pooled = pooled_keys(k, block_size, plan.gate.pooling) if plan.top_k > 1 else None  # once, for the workers
        slices = dict(chunk_size=s, plan=plan, slice_elements=_PART_SCORE_ELEMENTS, pooled=pooled)

        def select(first: int, end: int) -> Iterator[tuple[int, torch.Tensor]]:
            return dca_selection_slices(variants, k, queries=(first, end), **slices)

        out = attention_with_query_variants(
            variants, k, v, selected=select, block_size=block_size, variant_chunk=s, scale=scale, top_k=plan.top_k
        )
        return out.to(q.dtype)
    # with gradients (or off CPU), MoBA: per query tile, one masked part per region, merged by log-sum-exp
    selected = whole_selection()
    kf, vf = k.to(dtype), v.to(dtype)
    key_block = torch.arange(nk, device=k.device) // block_size
    tile = max(1, min(nq, TILE_ELEMENTS // max(1, b * hq * nk)))

    outputs = []
    first = nk - nq  # position of query 0
    t0 = 0
    while t0 < nq:
        chunk = (first + t0) // s
        t1 = min(nq, t0 + tile, (chunk + 1) * s - first)  # a tile never crosses a chunk boundary
        q_pos = torch.arange(first + t0, first + t1, device=q.device)
        bounds = [(chunk * s, first + t1), ((chunk - 1) * s, chunk * s), (0, (chunk - 1) * s)]
        parts = []
        for which, (lo, hi) in enumerate(bounds[: min(chunk, INTER) + 1]):
            qv = variants[which][:, :, t0:t1].reshape(b, hkv, g * (t1 - t0), d)
            allowed = selected[:, :, t0:t1][..., key_block[lo:hi]]  # [B, Hq, T, L]
            if which == 0:
                allowed = allowed & (torch.arange(lo, hi, device=q.device)[None, :] <= q_pos[:, None])  # causal
            allowed = allowed.reshape(b, hkv, g * (t1 - t0), hi - lo)
            parts.append(partial_attention(qv, kf[:, :, lo:hi], vf[:, :, lo:hi], scale, allowed))
        outputs.append(merge_partials(parts).reshape(b, hq, t1 - t0, d))
        t0 = t1
    return torch.cat(outputs, dim=2).to(q.dtype)


def _allowed(q: torch.Tensor, k: torch.Tensor, selected: torch.Tensor | None, block_size: int | None):
    """allowed(a, n, keys) -> bool [B, Hq, n, len(keys)]: whether DCA query rows a .. a + n - 1 attend the key
    positions `keys` (for NaN / inf values), given the MoBA selection (None: dense DCA)."""
    nq, nk = q.shape[2], k.shape[2]

    def allowed(a: int, n: int, keys: torch.Tensor) -> torch.Tensor:
        q_pos = torch.arange(nk - nq + a, nk - nq + a + n, device=q.device)
        causal = keys[None, :] <= q_pos[:, None]
        if selected is None:
            return causal.expand(q.shape[0], q.shape[1], n, keys.numel())
        return selected[:, :, a : a + n][..., keys // block_size] & causal

    return allowed


def _dense_dca_by_parts(variants: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: int, scale: float) -> torch.Tensor:
    """Dense DCA for inference on CPU: per query chunk, one fused flash call per part, merged by log-sum-exp.

    Each key pair is computed once (about the products of dense causal attention, a third of `_dense_dca`'s);
    the fused CPU op returns the log-sum-exp but has no gradient for it, hence inference only.
    """
    q = variants[0]
    nq, nk = q.shape[2], k.shape[2]
    kf, vf = k.to(q.dtype), v.to(q.dtype)
    first = nk - nq
    out = torch.empty_like(q)
    t0 = 0
    while t0 < nq:
        chunk = (first + t0) // s
        t1 = min(nq, (chunk + 1) * s - first)
        lo, hi = chunk * s, first + t1
        # own chunk, causal: query t0 sits at key index first + t0 - lo of the part
        o, lse = attention_with_lse(q[:, :, t0:t1], kf[:, :, lo:hi], vf[:, :, lo:hi], first + t0 - lo, scale)
        for which, (a, b) in ((1, ((chunk - 1) * s, lo)), (2, (0, (chunk - 1) * s))):
            if a < 0 or b <= a:
                continue
            o_part, lse_part = attention_with_lse(
                variants[which][:, :, t0:t1], kf[:, :, a:b], vf[:, :, a:b], None, scale
            )
            merge_lse_(o, lse, o_part, lse_part)
        out[:, :, t0:t1] = o
        t0 = t1
    return out


def _dense_dca(variants: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: int, scale: float) -> torch.Tensor:
    """Dense DCA as one SDPA call per query chunk, so the fused kernel does the softmax and the merge.

    The three parts differ only in the query variant, so stack them along head_dim and put each key into the
    slot of its part: q' = [q_intra, q_succ, q_inter], k' = [k, 0, 0] (own chunk), [0, k, 0] (previous chunk),
    [0, 0, k] (older); then q' . k' is the DCA score of every pair, and causal attention of the chunk's
    queries (the newest keys) over k' is DCA exactly. Costs about 3x the products of dense attention.
    """
    q = variants[0]
    dtype, nq, nk = q.dtype, q.shape[2], k.shape[2]
    zeros = torch.zeros_like(q)
    q_aug = torch.cat([*variants, *[zeros] * (3 - len(variants))], dim=-1)
    first = nk - nq
    outputs = []
    t0 = 0
    while t0 < nq:
        chunk = (first + t0) // s
        t1 = min(nq, (chunk + 1) * s - first)
        hi = first + t1
        kc = k[:, :, :hi].to(dtype)
        k_aug = kc.new_zeros(*kc.shape[:3], 3 * kc.shape[-1])
        d = kc.shape[-1]
        bounds = [(chunk * s, hi), (max(0, (chunk - 1) * s), chunk * s), (0, max(0, (chunk - 1) * s))]
        for which, (lo, up) in enumerate(bounds):
            k_aug[:, :, lo:up, which * d : (which + 1) * d] = kc[:, :, lo:up]
        # v padded to q's width too: PyTorch's fused CPU kernel needs equal head dims (else a slow fallback)
        v_aug = torch.nn.functional.pad(v[:, :, :hi].to(dtype), (0, 2 * d))
        outputs.append(causal_attention(q_aug[:, :, t0:t1], k_aug, v_aug, scale=scale)[..., :d])
        t0 = t1
    return torch.cat(outputs, dim=2)
