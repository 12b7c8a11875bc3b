"""Sparse MoBA decode: a few new queries read the pooled block keys and only their selected cache blocks.

`decode = "moba"` runs this at every decode step, whatever the cache length: the configuration fixes the math.
The caller keeps the pooled keys of the cache's blocks up to date (running sums, see
`moba_hf.integration.cache`), so a step costs O(blocks) for the gate plus O(top_k * block_size) for attention,
not O(cache length). Rows may start at different cache positions (left padding)::

    cache row b   pad pad | x x x x | x x x x | x q      starts[b] = 2, block_size = 4
    sequence pos          | 0 1 2 3 | 4 5 6 7 | 8 9      the query is at sequence position 9, block 2

Selection goes through `choose_blocks`, the rule prefill uses, so decode picks the blocks prefill would pick for a
query at the same position, ties included. A step is a fixed, small number of batched ops (no loop over rows,
heads or blocks): one gate matmul, the selection, then the attention over the selected blocks. On CPU in float32 /
float64 it reads them where they lie (q.k sampled at the selected keys, a weighted sum of their value rows:
nothing of the cache is copied); elsewhere (a paged cache, bfloat16, CUDA, autograd) the union of the blocks a
KV head's query heads selected is copied once per head, then one masked attention. Both compute the same result.
A step of `generate` on CPU in float32 (one query, rows that start together) is one call of the native kernel
(`kernels.native`, built by the system C compiler at first use) where it is built: after the rest of a model's
layer has swept the CPU caches, every torch call costs tens of microseconds, and a step of a dozen calls costs more
than its reads.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import warnings
from typing import Protocol

import torch
import torch.nn.functional as F

from . import native
from .checks import check_inputs, check_shapes, gate_dtype, needs_grad
from .nonfinite import masked_matmul
from .plan import BlockPlan
from .pooling import gate_queries, gate_width, pooled_keys
from .selection import MAX_PASS_PICKS, GateOptions, block_masks, choose_blocks
from .workers import run_single_threaded

# `block_masks` of rows of one length, by (blocks, queries, position, block size, sink, local, device): a decode
# step's are the same for every step inside a block
_masks_by_position: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
# the gathered blocks of a CPU step go into buffers kept per thread: a fresh allocation of a few MiB comes back
# from the OS page by page at every step (page faults cost as much as a dense pass over an 8K cache)
_WORKSPACE_MAX_BYTES = 64 << 20
_workspace = threading.local()


def check_decode_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_keys: torch.Tensor,
    plan: BlockPlan,
    *,
    starts: torch.Tensor | None,
    scale: object = None,
) -> None:
    """The checks of `decode_plan`'s arguments (the plan's values are its own)."""
    check_inputs(q, k, v, scale)
    check_shapes(q, k, v)
    if not isinstance(plan, BlockPlan):
        raise ValueError(f"plan must be a BlockPlan, got {type(plan).__name__}")
    if plan.dense_tail:
        raise ValueError(f"decode steps have no dense tail, got a plan with dense_tail={plan.dense_tail}")
    if not isinstance(block_keys, torch.Tensor) or not block_keys.is_floating_point():
        got = block_keys.dtype if isinstance(block_keys, torch.Tensor) else type(block_keys).__name__
        raise ValueError(f"block_keys must be a floating-point tensor (the pooled keys), got {got}")
    if block_keys.dim() != 4:
        raise ValueError(f"block_keys must be 4-D, got shape {tuple(block_keys.shape)}")
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    pooling = plan.gate.pooling
    width = gate_width(d, pooling)
    if block_keys.shape[:2] != (b, hkv) or block_keys.shape[3] != width:
        raise ValueError(
            f"block_keys must be [B={b}, Hkv={hkv}, n_blocks, {width}] for pooling={pooling!r}, "
            f"got {tuple(block_keys.shape)}"
        )
    if block_keys.device != q.device:
        raise ValueError(f"block_keys must be on q's device ({q.device}), got {block_keys.device}")
    if starts is None:
        return
    accepted = f"None or a [B={b}] integer tensor (int64, int32, int16, int8 or uint8) of cache positions"
    if not isinstance(starts, torch.Tensor):
        raise ValueError(f"starts must be {accepted}, got {type(starts).__name__} {starts!r}")
    if starts.dtype not in _INDEX_DTYPES:
        raise ValueError(f"starts must be {accepted}, got a {starts.dtype} tensor {_show(starts)}")
    if starts.shape != (b,):
        raise ValueError(f"starts must be {accepted}, got shape {tuple(starts.shape)}")
    low, high = int(starts.min()), int(starts.max())
    if low < 0 or nk - high < nq:
        raise ValueError(
            f"starts must be [B={b}] cache positions in 0..{nk - nq} (at least Nq={nq} tokens after them, "
            f"Nk={nk}), got {_show(starts)}"
        )


def _show(t: torch.Tensor) -> str:
    values = t.flatten()[:8].tolist()
    return f"{values}{' ...' if t.numel() > 8 else ''}"


def decode_selection(
    q: torch.Tensor,
    block_keys: torch.Tensor,
    lengths: torch.Tensor | int,
    *,
    block_size: int,
    top_k: int,
    gate: GateOptions,
) -> torch.Tensor:
    """Blocks each query attends: bool [B, Hq, Nq, n_blocks] (n_blocks = block_keys.shape[2]).

    q: [B, Hq, Nq, D], the last Nq tokens of row b's sequence of `lengths[b]` tokens (lengths: [B] long, or one
    int for rows of one length);
    block_keys: [B, Hkv, n_blocks, D] pooled keys (2D for "mean+max" and "bound", see `pooled_keys`), covering
    every row's blocks (later entries are never selected: they lie after each query's own block).
    """
    b, hq, nq, d = q.shape
    hkv, nb = block_keys.shape[1], block_keys.shape[2]
    masks = None
    if isinstance(lengths, int):  # every row alike: current [Nq], and the masks of the last steps' blocks kept
        # one query: its block fixes the masks; several: their positions do
        where = (lengths - 1) // block_size if nq == 1 else lengths
        key = (nb, nq, where, block_size, gate.sink_blocks, gate.local_blocks, q.device)
        masks = _masks_by_position.get(key)
        if masks is None:
            if len(_masks_by_position) > 64:
                _masks_by_position.clear()
            current = torch.arange(lengths - nq, lengths, device=q.device) // block_size
            masks = _masks_by_position[key] = block_masks(current, nb, gate)
        current = None
    else:
        position = lengths[:, None] - nq + torch.arange(nq, device=q.device)  # [B, Nq] in each row's sequence
        current = (position // block_size)[:, None]  # [B, 1, Nq]

    def scores() -> torch.Tensor:  # one matmul: [B, Hkv, g * Nq, W] @ [B, Hkv, W, nb], rows (query head, query)
        gate_q = gate_queries(q.to(block_keys.dtype).reshape(b, hkv, -1, d), gate.pooling)
        return (gate_q @ block_keys.transpose(-1, -2)).view(b, hq, nq, nb)

    with torch.no_grad():
        return choose_blocks(current, nb, scores, batch_heads=(b, hq), top_k=top_k, gate=gate, masks=masks, head_dim=d)


def moba_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_keys: torch.Tensor,
    *,
    block_size: int,
    top_k: int,
    pooling: str = "mean",
    sink_blocks: int = 0,
    local_blocks: int = 0,
    top_p: float | None = None,
    min_top_k: int = 1,
    scale: float | None = None,
    starts: torch.Tensor | None = None,
    return_selection: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """MoBA attention of a few new queries over a KV cache, reading only the selected blocks.

    q: [B, Hq, Nq, D] -- the last Nq positions of the cache (Nq small: decode, speculative steps).
    k, v: [B, Hkv, Nk, D] -- the cache including the queries' own keys.
    block_keys: [B, Hkv, n_blocks, D] (2D for "mean+max" and "bound") -- each block's pooled keys in row b's sequence
        layout, covering at least the blocks of all Nk - starts[b] tokens; later entries are ignored.
    starts: [B] integer tensor -- cache position where row b's sequence begins (left padding); None means 0.
        Row b's sequence is cache positions starts[b] .. Nk - 1, all real tokens.
    Returns [B, Hq, Nq, D] in q's dtype (and the selection [B, Hq, Nq, n_blocks] if `return_selection`):
    exactly `moba_attention(q_b, k_b, v_b, ...)` for every row's sequence, with `block_keys` as the gate's keys.
    The keywords make a `BlockPlan` (`decode_plan` takes one).
    """
    plan = BlockPlan.build(block_size, top_k, pooling, sink_blocks, local_blocks, top_p, min_top_k)
    return decode_plan(q, k, v, block_keys, plan, scale, starts=starts, return_selection=return_selection)


def decode_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_keys: torch.Tensor,
    plan: BlockPlan,
    scale: float | None = None,
    *,
    starts: torch.Tensor | None = None,
    return_selection: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`moba_decode` under a `BlockPlan` (without a dense tail: decode steps have none)."""
    check_decode_args(q, k, v, block_keys, plan, starts=starts, scale=scale)
    cache = DenseCache(k, v)
    bs, top_k, gate = plan.block_size, plan.top_k, plan.gate
    in_place = _reads_in_place(q, cache)
    step = lambda: _decode(q, cache, block_keys, bs, top_k, scale, gate, starts, return_selection, in_place)  # noqa: E731
    if in_place:
        # a few ops over the selected keys in place: run here; handing them to a worker thread costs a wake-up,
        # which on a loaded machine is more than the step itself
        return step()
    # the copying path is dozens of small ops: one thread runs them faster than several (see `workers`)
    return run_single_threaded(step, q.device)


class CacheWindows(Protocol):
    """A KV cache that sparse decode reads a few windows of: `shape` is (B, Hkv, Nk, D)."""

    shape: tuple[int, int, int, int]

    def windows(self, start: torch.Tensor, width: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of cache positions start .. start + width - 1 for every start [B, Hkv, U], in `dtype`:
        each [B, Hkv, U * width, D]."""
        ...


@dataclasses.dataclass(frozen=True)
class DenseCache:
    """k, v: [B, Hkv, Nk, D] tensors. A window of a (row, head) is one contiguous run of width * D numbers, so a
    contiguous cache is read with one `index_select` of U windows per (row, head): the index holds one entry per
    window, and only the windows are copied."""

    k: torch.Tensor
    v: torch.Tensor

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return tuple(self.k.shape)

    def windows(self, start: torch.Tensor, width: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        b, hkv, nk, d = self.k.shape
        first = torch.arange(b * hkv, device=start.device).view(b, hkv, 1) * nk  # each (row, head)'s position 0
        index = (first + start).flatten()
        return tuple(
            _windows(t, index, width, dtype, slot).view(b, hkv, -1, d) for slot, t in enumerate((self.k, self.v))
        )


def _windows(t: torch.Tensor, index: torch.Tensor, width: int, dtype: torch.dtype, slot: int) -> torch.Tensor:
    """Rows index .. index + width - 1 of t viewed as [B * Hkv * Nk, D], for every entry of `index`, in `dtype`:
    [len(index), width * D], in this thread's workspace `slot` (valid until the next call with that slot)."""
    d = t.shape[-1]
    # a strided cache has no overlapping-rows view; out= has no backward: a plain gather of every position
    if not t.is_contiguous() or (torch.is_grad_enabled() and t.requires_grad):
        positions = (index[:, None] + torch.arange(width, device=index.device)).flatten()
        return t.reshape(-1, d).index_select(0, positions).view(-1, width * d).to(dtype)
    flat = t.view(-1)  # overlapping windows as rows of one strided view: one gather, one index entry per window
    rows = flat.as_strided((flat.numel() // d - width + 1, width * d), (d, 1))
    shape = (index.numel(), width * d)
    out = torch.index_select(rows, 0, index, out=_buffer(shape, t.dtype, t.device, 2 * slot))
    return out if t.dtype == dtype else _buffer(shape, dtype, t.device, 2 * slot + 1).copy_(out)


def _buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, slot: int) -> torch.Tensor:
    """An uninitialized tensor of `shape`: on CPU up to _WORKSPACE_MAX_BYTES, a view of a buffer this thread keeps
    for `slot` (so the next call with the slot overwrites it); a new tensor otherwise."""
    n = 1
    for size in shape:
        n *= size
    if device.type != "cpu" or n * dtype.itemsize > _WORKSPACE_MAX_BYTES:
        return torch.empty(shape, dtype=dtype, device=device)
    buffers = _workspace.__dict__.setdefault("buffers", {})
    key = (slot, dtype)
    buf = buffers.get(key)
    if buf is None or buf.numel() < n:
        grown = min(2 * (0 if buf is None else buf.numel()), _WORKSPACE_MAX_BYTES // dtype.itemsize)
        buf = buffers[key] = torch.empty(max(n, grown), dtype=dtype)
    return buf[:n].view(shape)


def moba_decode_cache(
    q: torch.Tensor, cache: CacheWindows, block_keys: torch.Tensor, plan: BlockPlan, scale: float | None = None
) -> torch.Tensor:
    """`decode_plan` over any cache that reads windows of positions (e.g. a paged one), every row starting at
    cache position 0. q: [B, Hq, Nq, D], the last Nq positions; block_keys as in `moba_decode`; checked by the
    caller (shapes of a paged cache are the caller's to get right)."""
    bs, top_k, gate = plan.block_size, plan.top_k, plan.gate
    step = lambda: _decode(q, cache, block_keys, bs, top_k, scale, gate, None, False, False)  # noqa: E731
    return run_single_threaded(step, q.device)


def _decode(q, cache, block_keys, block_size, top_k, scale, gate, starts, return_selection, in_place):
    """in_place: `_reads_in_place(q, cache)` (a `DenseCache` the step reads where it lies)."""
    nk = cache.shape[2]
    scale = q.shape[3] ** -0.5 if scale is None else scale
    # one query (a step of `generate`), rows that start together, the fixed budget, read in place: the short path
    one_query = q.shape[2] == 1 and (gate.top_p is None or gate.top_p >= 1) and isinstance(cache, DenseCache)
    start = _common_start(starts) if one_query and in_place else None
    if start is not None:
        _check_block_count(block_keys, nk - start, block_size)
        return _one_query(q, cache.k, cache.v, block_keys, start, block_size, top_k, scale, gate, return_selection)
    if starts is None:  # rows of one length: index arithmetic on Python ints, a few ops fewer per step
        lengths = longest = nk
    else:
        starts = starts.to(device=q.device, dtype=torch.long)
        lengths, longest = nk - starts, nk - int(starts.min())
    needed = _check_block_count(block_keys, longest, block_size)
    selected = decode_selection(
        q, block_keys[:, :, :needed], lengths, block_size=block_size, top_k=top_k, gate=gate
    )  # [B, Hq, Nq, nb]
    if in_place:
        # no row selects more than its own block, the forced ones and top_k - 1 gated ones
        slots = min(selected.shape[-1], top_k + gate.sink_blocks + gate.local_blocks)
        out = _attend_in_place(q, cache.k, cache.v, selected, slots, starts, block_size, scale)
    else:
        out = _attend_windows(q, cache, selected, starts, block_size, scale)
    return (out, selected) if return_selection else out


def _check_block_count(block_keys: torch.Tensor, longest: int, block_size: int) -> int:
    """The blocks of the longest row's sequence; ValueError if block_keys holds fewer."""
    needed = -(-longest // block_size)
    if block_keys.shape[2] < needed:
        raise ValueError(f"block_keys has {block_keys.shape[2]} blocks, the sequences need {needed}")
    return needed


def _common_start(starts: torch.Tensor | None) -> int | None:
    """The cache position every row starts at (None: 0), or None if rows start at different positions."""
    if starts is None:
        return 0
    low, high = starts.aminmax()
    low = int(low)
    return low if low == int(high) else None


# --- one query, rows of one length: the step `generate` runs per layer and token ------------------------------------
#
#   blocks     0     1     2     3     4     5     6      own = 6 (partial), sink_blocks = 1, local_blocks = 1
#   forced     s                             l     o      s: sink, l: local, o: own (its keys so far)
#   gated            c     c     c     c                  candidates lo .. hi - 1 = 1 .. 4, top_k - 1 picked
#
# The candidates are one run of blocks, so the gate's picks are a max over a slice of the scores, and the forced
# blocks are known without looking at them. Each query row reads its own list of key positions (every one of them
# attended: nothing to mask), scored by one sampled q.k product and summed by one weighted gather of value rows.
# When the candidates are no more than the picks, every block is attended: plain dense attention over the row's
# sequence, with no gate at all.


def _one_query(q, k, v, block_keys, start, block_size, top_k, scale, gate, return_selection):
    """`_decode` of one query per row, every row's sequence at cache positions start .. Nk - 1, fixed budget, on the
    in-place path (CPU float32 / float64, a cache `_row_stride` reads, no autograd). Returns [B, Hq, 1, D] (and the
    selection [B, Hq, 1, n_blocks] if `return_selection`). Runs on the caller's threads, as `_attend_in_place`:
    the thread setting is the caller's (process-wide in part), never changed here."""
    b, hq, _, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    n = nk - start
    nb = -(-n // block_size)
    own = nb - 1
    lo = min(gate.sink_blocks, own)  # candidates: blocks lo .. hi - 1 (neither sink, local nor own)
    hi = max(lo, own - gate.local_blocks)
    n_pick = top_k - 1
    if hi - lo <= n_pick:  # every candidate is picked: all blocks
        out = _dense_one_query(q, k[:, :, start:], v[:, :, start:], scale)
        if not return_selection:
            return out
        return out, torch.ones(b, hq, 1, nb, dtype=torch.bool, device=q.device)
    r = b * hq
    done = _native_one_query(q, k, v, block_keys, start, n, block_size, lo, hi, n_pick, scale, gate, return_selection)
    if done is not None:
        out, picks = done
    else:
        picks = _torch_picks(q, block_keys, hkv, nb, lo, hi, n_pick, gate)
        out = _sparse_one_query(q, k, v, picks, start, n, block_size, lo, hi, n_pick, scale)
    if not return_selection:
        return out
    forced_blocks = _cached(("forced", r, nb, lo, hi, q.device), lambda: _forced_blocks(r, nb, lo, hi, q.device))
    return out, forced_blocks.clone().scatter_(1, picks + lo, True).view(b, hq, 1, nb)


def _torch_picks(q, block_keys, hkv, nb, lo, hi, n_pick, gate):
    """The gate's picks [R, n_pick] (block index - lo) as torch ops: one bmm [B * Hkv, g, W] @ [B * Hkv, W, nb],
    rows (query head), then `_gated_picks`."""
    b, hq, _, d = q.shape
    if n_pick == 0:  # top_k = 1: no gate
        return torch.empty(b * hq, 0, dtype=torch.long, device=q.device)
    with torch.no_grad():
        gate_q = gate_queries(q.to(block_keys.dtype).reshape(b * hkv, hq // hkv, d), gate.pooling)
        pooled = block_keys.reshape(b * hkv, block_keys.shape[2], -1)[:, :nb]
        return _gated_picks(torch.bmm(gate_q, pooled.transpose(1, 2)).view(b * hq, nb), lo, hi, n_pick)


def _native_one_query(q, k, v, block_keys, start, n, block_size, lo, hi, n_pick, scale, gate, return_selection):
    """`_one_query`'s gate, picks and attention in one call of the native kernel (`native.decode_step`): its
    output [B, Hq, 1, D] and picks [R, n_pick] (block index - lo; None unless `return_selection`), or None where
    that kernel does not run (then the torch ops below compute the same). A handful of torch calls: after the
    rest of a layer has swept the CPU caches, each costs tens of microseconds."""
    b, hq, _, d = q.shape
    hkv = k.shape[1]
    if q.dtype != torch.float32 or block_keys.dtype != torch.float32 or not q.is_contiguous():
        return None
    if n_pick > native.MAX_PICKS or d > native.MAX_D or hq // hkv > native.MAX_GROUP:
        return None
    if block_keys.stride(3) != 1 or (b > 1 and hkv > 1 and block_keys.stride(0) != hkv * block_keys.stride(1)):
        return None
    gate_q = None if gate.pooling == "mean" else gate_queries(q.reshape(b * hq, d), gate.pooling).contiguous()
    out = torch.empty_like(q)
    picks = torch.empty(b * hq, n_pick, dtype=torch.long) if return_selection else None
    cache = (k, v, _row_stride(k), start, n)
    if not native.decode_step(q, gate_q, block_keys, cache, (block_size, lo, hi, n_pick), scale, out, picks):
        return None
    return out, picks


def _sparse_one_query(q, k, v, picks, start, n, block_size, lo, hi, n_pick, scale):
    """`_one_query`'s attention over the picked and forced keys as torch ops: one sampled q.k product and one
    weighted gather of value rows. Returns [B, Hq, 1, D]."""
    b, hq, _, d = q.shape
    hkv, r = k.shape[1], b * hq
    # row (row, head) reads rows base + position of the storage's rows: its KV head's keys start at head index * step
    step = _row_stride(k)
    base = torch.add(start, _head_rows(b, hq, hkv, q.device), alpha=step)  # [R, 1]
    forced = _forced_positions(lo, hi, n, block_size, q.device)  # sequence positions of the forced blocks [F]
    gated = n_pick * block_size
    cols = torch.empty(r, gated + forced.numel(), dtype=torch.long, device=q.device)
    offset = _cached(("offset", lo * block_size, block_size, q.device),  # picks count from block lo
                     lambda: torch.arange(lo * block_size, (lo + 1) * block_size, device=q.device))  # fmt: skip
    torch.add(torch.add(base, picks, alpha=block_size)[..., None], offset,
              out=cols[:, :gated].view(r, n_pick, block_size))  # fmt: skip
    torch.add(base, forced, out=cols[:, gated:])
    nnz = cols.shape[1]
    keys, values = _storage_rows(k, step), _storage_rows(v, step)
    crow = torch.arange(0, r * nnz + 1, nnz, device=q.device)
    pattern = _csr(crow, cols.view(-1), _zeros(r * nnz, q.dtype, q.device), keys.shape[0])
    scores = torch.sparse.sampled_addmm(pattern, q.reshape(r, d), keys.t(), beta=0.0, alpha=scale)
    probs = scores.values().view(r, nnz).softmax(dim=-1)
    # every listed key is attended: a NaN / inf value reaches exactly the rows that attend it, as in the rule.
    # (torch.embedding_bag, not F.embedding_bag: the bags' offsets are crow, not a new arange of the same)
    out = torch.embedding_bag(values, cols.view(-1), crow, False, 0, False, probs.view(-1), True)[0]
    return out.view(b, hq, 1, d)


def _forced_blocks(r: int, nb: int, lo: int, hi: int, device: torch.device) -> torch.Tensor:
    """bool [R, nb]: the blocks before lo and from hi on (sink, local and own blocks)."""
    blocks = torch.arange(nb, device=device)
    return ((blocks < lo) | (blocks >= hi)).expand(r, nb)


def _dense_one_query(q, k, v, scale):
    """Attention of one query per row over every key: the reference's arithmetic (a masked NaN / inf key or value
    cannot exist here, and a row of all-NaN or all -inf scores stays NaN, where the fused kernel gives 0).
    q: [B, Hq, 1, D]; k, v: [B, Hkv, N, D] -> [B, Hq, 1, D]."""
    b, hq, _, d = q.shape
    hkv = k.shape[1]
    q5 = q.reshape(b, hkv, hq // hkv, d)
    probs = (q5 @ k.transpose(-1, -2)).mul_(scale).softmax(dim=-1)  # [B, Hkv, g, N]
    return (probs @ v).view(b, hq, 1, d)


def _gated_picks(scores: torch.Tensor, lo: int, hi: int, n_pick: int) -> torch.Tensor:
    """The n_pick best candidates (blocks lo .. hi - 1, more than n_pick of them) by scores [R, nb], as
    `choose_blocks` picks them: block indices minus lo [R, n_pick]. Overwrites scores."""
    candidates = scores[:, lo:hi].clamp_(min=torch.finfo(scores.dtype).min)  # a -inf candidate ranks last
    if n_pick <= MAX_PASS_PICKS:
        # choose_blocks' max passes take the largest left, the first of equal ones, a NaN before any number: the
        # head of a stable descending sort, in one op
        return candidates.sort(dim=-1, descending=True, stable=True).indices[:, :n_pick]
    # choose_blocks' topk over the whole row, non-candidates at -inf: the same input, the same picks
    scores[:, :lo] = float("-inf")
    scores[:, hi:] = float("-inf")
    return scores.topk(n_pick, dim=-1, sorted=False).indices - lo


_one_query_tables: dict[tuple, torch.Tensor] = {}


def _cached(key: tuple, make) -> torch.Tensor:
    found = _one_query_tables.get(key)
    if found is None:
        if len(_one_query_tables) > 256:  # shapes of many generations: keep the table small
            _one_query_tables.clear()
        found = _one_query_tables[key] = make()
    return found


def _head_rows(b: int, hq: int, hkv: int, device: torch.device) -> torch.Tensor:
    """Each query row's (row, KV head) index [B * Hq, 1]: its keys are rows index * step .. of `_storage_rows`."""
    return _cached(
        ("heads", b, hq, hkv, device),
        lambda: (torch.arange(b, device=device)[:, None] * hkv + torch.arange(hq, device=device) // (hq // hkv)).view(
            -1, 1
        ),
    )


def _arange(n: int, device: torch.device) -> torch.Tensor:
    return _cached(("arange", n, device), lambda: torch.arange(n, device=device))


def _zeros(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """n zeros (a view of a kept tensor, read only)."""
    key = ("zeros", dtype, device)
    found = _one_query_tables.get(key)
    if found is None or found.numel() < n:
        found = _one_query_tables[key] = torch.zeros(max(n, 2 * (0 if found is None else found.numel())), dtype=dtype,
                                                     device=device)  # fmt: skip
    return found[:n]


def _forced_positions(lo: int, hi: int, n: int, block_size: int, device: torch.device) -> torch.Tensor:
    """Sequence positions of the forced blocks of a query at position n - 1: the sink blocks 0 .. lo - 1, then the
    local blocks from hi and the own block's keys so far: [lo * bs + (n - hi * bs)]."""
    tail = torch.arange(hi * block_size, n, device=device)
    return tail if lo == 0 else torch.cat([_arange(lo * block_size, device), tail])


def reads_in_place(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether a sparse step of queries q over the cache k, v [B, Hkv, Nk, D] reads the selected keys where they
    lie, copying nothing of the cache (see `_reads_in_place`)."""
    return _reads_in_place(q, DenseCache(k, v))


def _reads_in_place(q: torch.Tensor, cache: DenseCache) -> bool:
    """Whether `_attend_in_place` takes this step: CPU float32 / float64, k and v laid out as `_storage_rows` reads
    them (a contiguous cache, or a prefix of one along the positions: a StaticCache's written slots), no autograd
    (the sparse products it uses have no bfloat16 kernels and no backward here); `_attend_windows` otherwise."""
    return (
        q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.float64)
        and _row_stride(cache.k) is not None
        and _row_stride(cache.k) == _row_stride(cache.v)
        and not needs_grad(q, cache.k, cache.v)
    )


def _row_stride(t: torch.Tensor) -> int | None:
    """How many rows of D numbers lie between the starts of consecutive (row, head) runs of t [B, Hkv, N, D] in its
    storage, or None when t is not laid out as such runs: each (row, head)'s N positions one run of N * D numbers,
    and the runs of a row's heads and of the rows evenly spaced (stride(3) == 1, stride(2) == D, stride(0) ==
    Hkv * stride(1), strides of size-1 dims aside). A contiguous tensor has stride N; a prefix t[:, :, :n] of a
    contiguous [B, Hkv, capacity, D] buffer has stride capacity::

        storage rows   | b0 h0: 0 .. n-1  (unwritten) | b0 h1: 0 .. n-1  (unwritten) | b1 h0: ...
                       |<------- capacity rows ------>|
    """
    b, hkv, n, d = t.shape
    s0, s1, s2, s3 = t.stride()
    if (d > 1 and s3 != 1) or (n > 1 and s2 != d):
        return None
    if hkv > 1:
        if b > 1 and s0 != hkv * s1:
            return None
        step = s1
    else:
        step = s0 if b > 1 else n * d  # one run per row, or one run in all
    return step // d if step % d == 0 else None


def _storage_rows(t: torch.Tensor, step: int) -> torch.Tensor:
    """t [B, Hkv, N, D] (row stride `step`, see `_row_stride`) as rows [R, D] of its storage: position p of
    (row b, head h) is row (b * Hkv + h) * step + p. A view: nothing is copied (`t.view(-1, D)` when contiguous)."""
    b, hkv, n, d = t.shape
    return t.as_strided(((b * hkv - 1) * step + n, d), (d, 1))


def _block_windows(blocks: torch.Tensor, starts: torch.Tensor | None, block_size: int, nk: int):
    """Each block is read as one window of W = min(block_size, Nk) contiguous cache positions; a partial last
    block's window is shifted left to end at Nk, and the window's keys before its block are masked.
    blocks: block indices [B, ...]; starts: [B] viewed to broadcast against them, or None (every row from 0).
    Returns each window's first cache position, the offset of its block's first key inside it (0 unless shifted),
    and W."""
    width = min(block_size, nk)
    block_start = blocks * block_size  # cache position of each block's first key
    if starts is not None:
        block_start = block_start + starts
    win_start = block_start.clamp(max=nk - width)
    return win_start, block_start - win_start, width


def _view(t: torch.Tensor | None, *shape: int) -> torch.Tensor | None:
    return None if t is None else t.view(shape)


def _attend_in_place(q, k, v, selected, slots, starts, block_size, scale):
    """Every query row attends its own selected blocks, read where they lie in the cache: one sampled q.k product
    at the selected key positions (a CSR pattern over the cache's rows) and one weighted sum of the value rows
    (`embedding_bag`); nothing of the cache is copied. `slots`: at least the most blocks a row selected.
    Returns [B, Hq, Nq, D].

    The step is kept to few ops: after the cache has been swept by the rest of a model's layer, each op's fixed cost
    grows several times, and the number of ops, not the bytes, then sets a short step's time."""
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    n = b * hq * nq
    # each row's selected blocks first (in any order): [B, Hq, Nq, S]; slots past a row's count are masked
    used, blk = selected.to(torch.int8).topk(slots, dim=-1, sorted=False)
    win_start, first_valid, width = _block_windows(blk, _view(starts, b, 1, 1, 1), block_size, nk)
    head_row, offset, crow, zeros = _in_place_indices(b, hq, hkv, width, slots, n, q.dtype, q.device)
    step = _row_stride(k)  # rows of the storage between (row, head) runs: Nk, or a static cache's capacity
    cols = ((head_row * step + win_start)[..., None] + offset).view(n, -1)  # rows of `_storage_rows`
    first_valid.masked_fill_(used == 0, width)  # a slot a row does not use: every key masked
    masked = offset < first_valid[..., None]  # [B, Hq, Nq, S, W]
    if nq > 1:  # causal inside the newest block (a single query is the last key: it sees every key)
        q_pos = nk - nq + torch.arange(nq, device=q.device)
        masked |= win_start[..., None] + offset > q_pos[:, None, None]
    masked = masked.view(n, -1)
    keys, values = _storage_rows(k, step), _storage_rows(v, step)
    pattern = _csr(crow, cols.view(-1), zeros, keys.shape[0])
    scores = torch.sparse.sampled_addmm(pattern, q.reshape(n, d), keys.t(), beta=0.0).values().view(n, -1)
    probs = scores.mul_(scale).masked_fill_(masked, float("-inf")).softmax(dim=-1)
    out = F.embedding_bag(cols, values, per_sample_weights=probs, mode="sum")
    # a NaN / inf value in a slot a row does not attend gave 0 * NaN: exactly, as the rule (a finite sum: all
    # finite; one huge enough to overflow takes the exact path too, which gives the same result)
    if not math.isfinite(out.sum().item()):
        valid = ~masked
        out = masked_matmul(probs[:, None], valid[:, None], values[cols])[:, 0]
    return out.view(b, hq, nq, d)


_indices: dict[tuple, tuple[torch.Tensor, ...]] = {}


def _in_place_indices(b, hq, hkv, width, slots, n, dtype, device):
    """What `_attend_in_place` needs besides the selection, the same for every step of a generation: each query
    row's (row, KV head) index [B, Hq, 1, 1], offsets 0 .. W - 1, the CSR row pointers and zero values."""
    key = (b, hq, hkv, width, slots, n, dtype, device)
    found = _indices.get(key)
    if found is None:
        if len(_indices) > 64:  # shapes of many generations: keep the table small
            _indices.clear()
        head_row = torch.arange(b, device=device)[:, None] * hkv + torch.arange(hq, device=device) // (hq // hkv)
        row_len = slots * width
        found = _indices[key] = (
            head_row[:, :, None, None],
            torch.arange(width, device=device),
            torch.arange(0, n * row_len + 1, row_len, device=device),
            torch.zeros(n * row_len, dtype=dtype, device=device),
        )
    return found


_csr_lock = threading.Lock()
_csr_quiet = False


def _csr(crow: torch.Tensor, col: torch.Tensor, values: torch.Tensor, n_cols: int) -> torch.Tensor:
    """A CSR sampling pattern of len(crow) - 1 rows (values: zeros, only read as `beta * values` with beta 0).
    PyTorch warns once per process that CSR tensors are in beta: that one warning is taken here, at the first
    call, instead of in the user's output."""
    global _csr_quiet
    if not _csr_quiet:
        with _csr_lock, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.sparse_csr_tensor(crow[:1].repeat(2), col[:0], values[:0], size=(1, 1))
            _csr_quiet = True
    return torch.sparse_csr_tensor(crow, col, values, size=(crow.numel() - 1, n_cols), check_invariants=False)


def _attend_windows(q, cache, selected, starts, block_size, scale):
    """Attention over windows copied from any `CacheWindows` (a paged cache, bfloat16, CUDA, autograd): per KV
    head, the union of the blocks its query heads selected is copied once and shared by the group, then one
    masked attention over it. Returns [B, Hq, Nq, D]."""
    b, hq, nq, d = q.shape
    hkv, nk = cache.shape[1], cache.shape[2]
    g = hq // hkv
    dev = q.device
    by_head = selected.reshape(b, hkv, g * nq, -1)  # [B, Hkv, g*Nq, nb], rows ordered (query head, query)
    union = by_head.any(dim=2)  # [B, Hkv, nb]
    n_union = int(union.sum(-1).max())
    in_union, blk = union.to(torch.int8).topk(n_union, dim=-1, sorted=False)  # [B, Hkv, U]; pads: in_union 0
    win_start, first_valid, width = _block_windows(blk, _view(starts, b, 1, 1), block_size, nk)
    dtype = gate_dtype(q.dtype)
    k_sel, v_sel = cache.windows(win_start, width, dtype)  # [B, Hkv, U*W, D]

    offset = torch.arange(width, device=dev)
    wanted = by_head.gather(-1, blk[:, :, None].expand(-1, -1, g * nq, -1)) & in_union.bool()[:, :, None]
    valid = wanted[..., None] & (offset >= first_valid[..., None])[:, :, None]  # [B, Hkv, g*Nq, U, W]
    if nq > 1:  # causal inside the newest block (a single query is the last key: it sees every key)
        key_pos = win_start[..., None] + offset  # [B, Hkv, U, W]
        q_pos = (nk - nq + torch.arange(nq, device=dev)).repeat(g)  # [g*Nq]
        valid &= key_pos[:, :, None] <= q_pos[:, None, None]
    valid = valid.flatten(-2)  # [B, Hkv, g*Nq, U*W]

    scores = q.reshape(b, hkv, g * nq, d).to(dtype) @ k_sel.transpose(-1, -2)
    probs = scores.mul_(scale).masked_fill_(~valid, float("-inf")).softmax(dim=-1)
    return masked_matmul(probs, valid, v_sel).view(b, hq, nq, d).to(q.dtype)  # NaN values reach only their rows


def block_keys_from_cache(
    k: torch.Tensor, block_size: int, pooling: str = "mean", starts: torch.Tensor | None = None
) -> torch.Tensor:
    """Pooled block keys [B, Hkv, n_blocks, D or 2D] of each row's sequence (cache positions starts[b]..Nk-1),
    recomputed from scratch: the oracle for the running sums (and the slow path when none are kept)."""
    b, hkv, nk, d = k.shape
    if starts is None:
        return pooled_keys(k, block_size, pooling)
    nb = -(-int((nk - starts).max()) // block_size)
    width = gate_width(d, pooling)
    out = k.new_zeros(b, hkv, nb, width, dtype=gate_dtype(k.dtype))
    for r in range(b):
        pooled = pooled_keys(k[r : r + 1, :, int(starts[r]) :], block_size, pooling)
        out[r : r + 1, :, : pooled.shape[2]] = pooled
    return out
