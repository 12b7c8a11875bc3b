"""MoBA as Triton kernels, forward and backward (backend "triton", CUDA; CPU only under ``TRITON_INTERPRET=1``).

Work is organised by *key block*, the way the original MoBA groups queries: every (query head, query) row that
selected block j of kv head hk is gathered into segment (batch, hk, j), and programs take tiles of BLOCK_M rows
of one segment against that block's keys. Each (row, block) pair is computed exactly once however the rows of a
segment are scattered, and the query heads of one GQA group share the segment, so K / V are read in place
(kv head = q head // group) and never copied::

    slots  [B, Hq, Nq, S]        int32  blocks each query attends (from `selected_blocks`), -1 = empty slot
    rows   [B, Hkv, G * Nq * S]  int32  row id g * Nq + q of every pair, sorted by block (pairs of block j are
                                         contiguous; empty slots sort last and are never read)
    tiles  [T] x (segment, start, end)  BLOCK_M consecutive pairs of one segment

Forward, two passes: (A) the log-sum-exp of every pair, merged per row into the row's softmax normaliser;
(B) P = exp(S - lse_row) is then already final, so each tile adds P @ V into the fp32 output with atomics.
Backward recomputes P the same way and adds dq, dk, dv with atomics. Softmax runs in float32 (float64 for float64
inputs); the own block is masked causally, an earlier block needs no mask. The atomics make GPU results
deterministic only up to float32 summation order.
"""

from __future__ import annotations

import contextlib

import torch

from .checks import cuda_or_triton_interpreter, effective_block_size, gate_dtype, num_blocks
from .nonfinite import route_nonfinite
from .plan import BlockPlan, check_call
from .selection import GateOptions, selection_slices

try:
    import triton
    import triton.language as tl
except ImportError as err:
    raise ImportError(f"backend 'triton' needs the triton package (pip install 'moba-hf[triton]'): {err}") from err

_GATE_ELEMENTS = 1 << 26  # selection entries (rows x blocks) held at once while building the slot lists
_BLOCK_M = 64  # pairs per program; tl.dot needs every tile side >= 16


@triton.jit
def _mm(a, b, FMA: tl.constexpr):
    """a @ b. float64 multiplies and reduces element-wise: not every Triton / GPU pair lowers a float64 tl.dot."""
    if FMA:
        c = tl.sum(a[:, :, None] * b[None, :, :], axis=1)
    else:
        c = tl.dot(a, b, input_precision="ieee")  # "ieee": no TF32 rounding of float32 inputs
    return c


# what a program of `_moba_kernel` computes for its tile of pairs
_PAIR_LSE = tl.constexpr(0)  # each pair's log-sum-exp, into OUT [B * Hkv, pairs]
_FORWARD = tl.constexpr(1)  # the pairs' share of the output, P @ V, added into OUT [B, Hq, Nq, D]
_BACKWARD = tl.constexpr(2)  # dq added into OUT, dk / dv into DK / DV


@triton.jit
def _moba_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    OUT,
    DK,
    DV,
    ROWS,
    TILE_SEG,
    TILE_START,
    TILE_END,
    sq_b,
    sq_h,
    sq_n,
    sk_b,
    sk_h,
    sk_n,
    sv_b,
    sv_h,
    sv_n,
    sd_b,
    sd_h,
    sd_n,
    n_q,
    n_k,
    n_blocks,
    group,
    n_kv_heads,
    n_heads,
    pairs,
    block_size,
    scale,
    STAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ACC: tl.constexpr,
    FMA: tl.constexpr,
):
    """One tile of pairs (BLOCK_M rows of one segment against its block's keys) at one `STAGE`."""
    t = tl.program_id(0)
    seg = tl.load(TILE_SEG + t).to(tl.int64)  # segment = (batch * n_kv_heads + kv head) * n_blocks + block
    start = tl.load(TILE_START + t)
    end = tl.load(TILE_END + t)
    bhk = seg // n_blocks
    j = seg % n_blocks
    b = bhk // n_kv_heads
    hk = bhk % n_kv_heads
    idx = start + tl.arange(0, BLOCK_M)
    ok = idx < end
    row = tl.load(ROWS + bhk * pairs + idx, mask=ok, other=0).to(tl.int64)
    q_idx = row % n_q
    h = hk * group + row // n_q
    q_pos = q_idx + (n_k - n_q)
    row_flat = (b * n_heads + h) * n_q + q_idx  # the row in [B, Hq, Nq]
    dims = tl.arange(0, D_PAD)
    mask = ok[:, None] & (dims < HEAD_DIM)[None, :]  # head_dim padded to a power of two: pad lanes read 0
    q = tl.load(Q + b * sq_b + h[:, None] * sq_h + q_idx[:, None] * sq_n + dims[None, :], mask=mask, other=0.0)
    if STAGE == _PAIR_LSE:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=ACC)
        l_i = tl.zeros([BLOCK_M], dtype=ACC)
    else:
        lse = tl.load(LSE + row_flat, mask=ok, other=0.0)
        acc = tl.zeros([BLOCK_M, D_PAD], dtype=ACC)  # the output, or dq
    if STAGE == _BACKWARD:
        do = tl.load(DO + b * sd_b + h[:, None] * sd_h + q_idx[:, None] * sd_n + dims[None, :], mask=mask, other=0.0)
        delta = tl.load(DELTA + row_flat, mask=ok, other=0.0)
        kv_base = (b * n_kv_heads + hk) * n_k  # dk / dv are contiguous [B, Hkv, Nk, D] accumulation buffers
    lo = j * block_size
    hi = tl.minimum(lo + block_size, tl.max(tl.where(ok, q_pos, 0)) + 1)  # no row sees past its own position
    for s0 in range(lo, hi, BLOCK_N):
        cols = s0 + tl.arange(0, BLOCK_N).to(tl.int64)
        kv_mask = (cols < hi)[:, None] & (dims < HEAD_DIM)[None, :]
        k = tl.load(K + b * sk_b + hk * sk_h + cols[:, None] * sk_n + dims[None, :], mask=kv_mask, other=0.0)
        s = _mm(q, tl.trans(k), FMA).to(ACC) * scale
        visible = ok[:, None] & (cols < hi)[None, :] & (cols[None, :] <= q_pos[:, None])
        if STAGE == _PAIR_LSE:
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            # a row that has seen nothing yet keeps m = -inf; shift by 0 then so exp() gives 0, not NaN
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(s - m_safe[:, None]), axis=1)
            m_i = m_new
        else:
            v = tl.load(V + b * sv_b + hk * sv_h + cols[:, None] * sv_n + dims[None, :], mask=kv_mask, other=0.0)
            # the row's final normaliser is known, so this block's share of the softmax is final too
            p = tl.where(visible, tl.exp(s - lse[:, None]), 0.0)
            if STAGE == _FORWARD:
                acc += _mm(p.to(v.dtype), v, FMA).to(ACC)
            else:
                ds = p * (_mm(do, tl.trans(v), FMA).to(ACC) - delta[:, None])
                acc += _mm(ds.to(k.dtype), k, FMA).to(ACC)
                dkv = (kv_base + cols)[:, None] * HEAD_DIM + dims[None, :]
                # several tiles (other rows of this block, other heads of the group) add into the same keys
                tl.atomic_add(DV + dkv, _mm(tl.trans(p.to(do.dtype)), do, FMA).to(ACC), mask=kv_mask)
                dk_part = _mm(tl.trans(ds.to(q.dtype)), q, FMA).to(ACC) * scale
                tl.atomic_add(DK + dkv, dk_part, mask=kv_mask)
    if STAGE == _PAIR_LSE:
        # every pair sees >= 1 key (an earlier block entirely, its own block up to the query), so l > 0 on real rows
        lse = m_i + tl.log(tl.where(l_i == 0.0, 1.0, l_i))
        tl.store(OUT + bhk * pairs + start + tl.arange(0, BLOCK_M), lse, mask=ok)
    else:
        if STAGE == _BACKWARD:
            acc = acc * scale
        tl.atomic_add(OUT + row_flat[:, None] * HEAD_DIM + dims[None, :], acc, mask=mask)


def _slot_lists(q, k, *, block_size: int, top_k: int, gate: GateOptions) -> torch.Tensor:
    """[B, Hq, Nq, S] int32: the blocks each query attends, ascending, padded with -1.

    Built in query slices (`q_start` keeps each slice's selection equal to the whole's) so the boolean
    [B, Hq, Nq, n_blocks] selection never exists at once for long sequences.
    """
    b, hq, nq, _ = q.shape
    nk = k.shape[2]
    nb = num_blocks(nk, block_size)
    # own block + forced sink / local blocks + top_k - 1 picks can never exceed this
    n_slots = max(1, min(nb, top_k + gate.sink_blocks + gate.local_blocks))
    slots = torch.empty(b, hq, nq, n_slots, dtype=torch.int32, device=q.device)
    block_ids = torch.arange(nb, dtype=torch.int32, device=q.device)
    rows = max(1, _GATE_ELEMENTS // max(1, b * hq * nb))
    for s, sel, _ in selection_slices(q, k, block_size=block_size, top_k=top_k, gate=gate, slice_rows=rows):
        e = s + sel.shape[2]
        # unselected blocks sort after every real one (key nb) and become the -1 padding
        ordered = torch.where(sel, block_ids, nb).sort(dim=-1).values[..., :n_slots]
        slots[:, :, s:e] = ordered.masked_fill(ordered == nb, -1)
    return slots


class _Plan:
    """The pair layout shared by the three kernels (see the module docstring)."""

    def __init__(self, slots: torch.Tensor, n_kv_heads: int, n_blocks: int, block_m: int):
        b, hq, nq, n_slots = slots.shape
        dev = slots.device
        self.pairs = hq // n_kv_heads * nq * n_slots
        # pair p = (g * Nq + q) * S + s of kv head hk; empty slots get key n_blocks and sort last
        keys = slots.reshape(b * n_kv_heads, self.pairs)
        keys = torch.where(keys < 0, n_blocks, keys)
        sorted_keys, order = keys.sort(dim=-1, stable=True)
        self.sort_order = order
        self.rows = (order // n_slots).to(torch.int32).contiguous()
        bounds = torch.arange(n_blocks + 1, dtype=sorted_keys.dtype, device=dev).expand(b * n_kv_heads, -1)
        offsets = torch.searchsorted(sorted_keys.contiguous(), bounds.contiguous()).to(torch.int64)
        seg_start, seg_end = offsets[:, :-1].reshape(-1), offsets[:, 1:].reshape(-1)  # segment (bhk, j)
        n_tiles = (seg_end - seg_start + block_m - 1) // block_m
        tile_seg = torch.repeat_interleave(torch.arange(n_tiles.numel(), device=dev), n_tiles)
        first_tile = torch.cumsum(n_tiles, 0) - n_tiles
        rank = torch.arange(tile_seg.numel(), device=dev) - first_tile[tile_seg]
        self.tile_seg = tile_seg.to(torch.int32)
        self.tile_start = (seg_start[tile_seg] + rank * block_m).to(torch.int32)
        self.tile_end = seg_end[tile_seg].to(torch.int32)
        self.n_slots = n_slots

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.rows, self.tile_seg, self.tile_start, self.tile_end


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    # kernels take batch / head / sequence strides but assume unit stride along head_dim
    return t if t.stride(-1) == 1 else t.contiguous()


_FMA_DEVICES = ("cuda",)  # devices where float64 avoids tl.dot (the interpreter's NumPy dot handles float64)


def _fma(q: torch.Tensor) -> bool:
    return q.dtype == torch.float64 and q.device.type in _FMA_DEVICES


def _block_m(q: torch.Tensor) -> int:
    # the element-wise float64 product is [BLOCK_M, D, BLOCK_N]: small tiles keep it in registers
    return 16 if _fma(q) else _BLOCK_M


def _run(stage: tl.constexpr, q, k, v, do, lse, delta, out, dk, dv, plan: _Plan, block_size: int, scale: float) -> None:
    """`_moba_kernel` at `stage` over every tile of `plan` (stages that read no do / lse / delta / dk / dv are given
    any tensor there)."""
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3])
    sizes = (nq, nk, num_blocks(nk, block_size), hq // hkv, hkv, hq, plan.pairs, block_size, scale)
    # key tiles no longer than a block (short blocks waste no lanes) but >= 16 for tl.dot
    block_n = 16 if _fma(q) else max(16, min(64, triton.next_power_of_2(block_size)))
    meta = dict(HEAD_DIM=d, D_PAD=max(16, triton.next_power_of_2(d)), BLOCK_M=_block_m(q), BLOCK_N=block_n)
    meta.update(ACC=tl.float64 if q.dtype == torch.float64 else tl.float32, FMA=_fma(q))
    tensors = (q, k, v, do, lse, delta, out, dk, dv, *plan.tensors())
    _moba_kernel[(plan.tile_seg.numel(),)](*tensors, *strides, *sizes, STAGE=stage.value, **meta)


class _MobaTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: _Plan, block_size: int, scale: float):
        b, hq, nq, d = q.shape
        hkv = k.shape[1]
        acc_dtype = gate_dtype(q.dtype)
        pair_lse = torch.full((b * hkv, plan.pairs), float("-inf"), dtype=acc_dtype, device=q.device)
        _run(_PAIR_LSE, q, k, v, q, pair_lse, pair_lse, pair_lse, k, v, plan, block_size, scale)
        # back to slot order, then each row's normaliser over its blocks
        by_slot = torch.full_like(pair_lse, float("-inf")).scatter_(1, plan.sort_order, pair_lse)
        plan.sort_order = None  # int64 per pair: not needed by the backward
        lse = torch.logsumexp(by_slot.view(b, hq, nq, plan.n_slots), dim=-1).contiguous()
        out = torch.zeros(b, hq, nq, d, dtype=acc_dtype, device=q.device)
        _run(_FORWARD, q, k, v, q, lse, lse, out, k, v, plan, block_size, scale)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.block_size, ctx.scale = plan, block_size, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        acc_dtype = lse.dtype
        grad_out = _last_dim_contiguous(grad_out)
        # delta_i = sum_d dO * O: the row term of the softmax derivative, cheap enough outside the kernel
        delta = (grad_out.to(acc_dtype) * out.to(acc_dtype)).sum(dim=-1).contiguous()
        dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc_dtype, device=q.device)
        dv = torch.zeros(v.shape, dtype=acc_dtype, device=q.device)
        _run(_BACKWARD, q, k, v, grad_out, lse, delta, dq, dk, dv, ctx.plan, ctx.block_size, ctx.scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def moba_attention_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockPlan, scale: float | None = None
) -> torch.Tensor:
    """MoBA attention with Triton kernels (the contract of `moba_attention_reference`); differentiable in q, k, v."""
    check_call(q, k, v, plan)
    block_size = effective_block_size(plan.block_size, k.shape[2])  # bounded by the sequence
    if not cuda_or_triton_interpreter(q):
        raise ValueError(f"backend 'triton' needs CUDA tensors (or TRITON_INTERPRET=1), got device {q.device}")
    guarded = route_nonfinite(moba_attention_triton, q, k, v, plan, scale)
    if guarded is not None:
        return guarded
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    slots = _slot_lists(q, k, block_size=block_size, top_k=plan.top_k, gate=plan.gate)
    plan = _Plan(slots, k.shape[1], num_blocks(k.shape[2], block_size), _block_m(q))
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        return _MobaTriton.apply(q, k, v, plan, block_size, scale)
