"""MoBA in pure PyTorch without any N x N tensor: the CPU workhorse (backend "torch").

Work is split into *pieces*, each a small dense attention whose partial softmaxes are merged by log-sum-exp::

    own block  : queries of block c  x  keys of block c (causal)   -- batched over blocks, GQA heads share K;
                 blocks of 256+ as causal 128-row tiles plus each tile against the block's earlier tiles
    gated block: the (head, query) rows that picked block j  x  keys of block j (no mask) -- one call per block
                 when blocks are picked by many rows, else padded chunks of several blocks per call

Every row sees its own block exactly once and each picked earlier block once, so merging the pieces' (out, lse)
gives the softmax over the union of attended keys (with finite keys the gated pieces accumulate with weights
against the own block's log-sum-exp, `_accumulate`, instead of merging pairwise). Memory grows with
N * top_k * block_size (pieces are bounded in rows), never with N^2. The backward recomputes each piece from the
saved final output and log-sum-exp, the flash-attention way: P = exp(S - lse_final) is that piece's share of the
global softmax.

The pieces and their merge are `kernels.dense` (PyTorch's fused CPU flash-attention op where it serves).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from .checks import check_count, check_shapes, effective_block_size, gate_dtype, num_blocks
from .dense import attention_with_lse, attention_with_lse_backward, fused_available, fused_if, merge_lse_
from .nonfinite import all_finite, has_nonfinite, propagate_moba_nonfinite
from .plan import BlockPlan, check_call
from .selection import selection_slices, without_own_block
from .workers import run_all, worker_count

# working-set bounds: small enough to keep memory ~ N * top_k * block_size, big enough for efficient kernels
# gated rows per fused-batch entry: a group's last chunk is padded, so small blocks (few rows per group) want
# short chunks; on the 2-core CPU box 64 rows were best for block 64 (35% padding at 256), 256 for block 512
_CHUNK_MIN, _CHUNK_MAX = 64, 256


def _chunk_rows(block_size: int) -> int:
    return min(_CHUNK_MAX, max(_CHUNK_MIN, block_size))


_BATCH_ROWS = 8192  # rows per fused call on CPU
_GATE_ELEMENTS = 1 << 20  # gate scores (rows x blocks) held at once on CPU
_GPU_SCALE = 64  # GPUs hold this many times more gate scores at once
_GPU_SCORES = 1 << 27  # score elements of one fused call on a GPU (the matmul path materializes them)


# the grouped layout (one call per key block) pays off once blocks average this many picking rows: forward A/B
# on the 2-core CPU, 12% faster at 16K / block 512 and 27% at 8K / block 64 than padded chunks (no padding rows,
# no K/V copy per chunk)
_GROUP_ROWS = 1024
_OWN_TILE = 128


def _batch_rows(device: torch.device, block_size: int) -> int:
    return _BATCH_ROWS if device.type == "cpu" else max(_chunk_rows(block_size), _GPU_SCORES // block_size)


# On CPU the queries run as independent ranges ("parts"), one per intra-op thread, each on a single-threaded
# worker (see `workers`): robust on a busy machine, and faster idle since short ops overlap. A part has at least
# this many queries (below it, one part on the caller's threads).
_PART_ROWS = 512
# a query's gate work per block it scores (the score, masking, max passes, the pair scan), in attended keys: on
# the 2-core CPU the later of two equal-key parts took 15% longer at 128K / block 512; 2-4 balanced them
_GATE_WORK = 3


def query_parts(nq: int, nk: int, block_size: int, workers: int, top_k: int | None = None) -> list[tuple[int, int]]:
    """Query ranges [first, end) of about equal work, cut at block boundaries when the parts stay non-empty, so
    own blocks stay whole. A query's work is the keys it attends (up to top_k blocks, fewer near the start) plus
    its gate's work, `_GATE_WORK` keys per block it scores (equal sizes when top_k is None)."""
    count = min(workers, nq // _PART_ROWS)
    start, cuts = nk - nq, [0]
    work = None
    if top_k is not None and count > 1:
        position = torch.arange(start, nk, dtype=torch.float64)
        keys = (position + 1).clamp_(max=min(top_k * block_size, nk))  # a Python int past int64 would overflow
        work = (keys + _GATE_WORK * (position // block_size + 1)).cumsum(0)
    for i in range(1, count):
        cut = round(i * nq / count)
        if work is not None:
            cut = int(torch.searchsorted(work, work[-1] * i / count))
        aligned = round((start + cut) / block_size) * block_size - start
        cut = aligned if cuts[-1] < aligned < nq else cut
        if cuts[-1] < cut < nq:
            cuts.append(cut)
    return list(zip(cuts, cuts[1:] + [nq], strict=True))


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)  # tests fill it with NaN: unwritten rows must show


class _Plan:
    """Which pieces to run; built once, used by forward and backward.

    Rows are addressed flat over [B, Hq, Nq]: row = (b * Hq + head) * Nq + query; key blocks flat over
    [B, Hkv, n_blocks]: block = (b * Hkv + kv_head) * n_blocks + j.
    Own blocks: `own_full` (first, end) blocks wholly covered by queries (batched), `own_partial` the cut ones as
    (block, first query position, key end).
    Gated (row, block) pairs run as fused calls (`batches`: rows, chunks) of [chunks, 1, rows per chunk, D]
    queries against the chunks' key blocks, laid out either `_grouped` (one call per key block, when blocks are
    picked by many rows) or `_chunked` (padded chunks of several blocks per call). Within a call a row appears
    at most once, so calls merge into the output in place.
    """

    def __init__(self, q, k, block_size, earlier_slices, variants=(1, None)):
        """earlier_slices: (first query, bool [B, Hq, n, n_blocks] gated earlier blocks) over the queries, or None
        when no block is gated. variants (count, chunk): gated block j of query position p reads query variant
        min(p // chunk - j * block_size // chunk, count - 1) (see `moba_attention_torch_variants`)."""
        b, hq, nq, _ = q.shape
        hkv, nk = k.shape[1], k.shape[2]
        bs, g = block_size, hq // hkv
        self.finite_keys = all_finite(k)
        nb = num_blocks(nk, bs)
        start = nk - nq
        dev = q.device
        self.device = dev
        self.chunk = _chunk_rows(bs)
        full = [c for c in range(start // bs, nb) if c * bs >= start and (c + 1) * bs <= nk]
        self.own_full = (full[0], full[-1] + 1) if full else None
        self.own_partial = [
            (c, max(start, c * bs), min((c + 1) * bs, nk)) for c in range(start // bs, nb) if c not in full
        ]
        self.batches: list[tuple[slice, slice]] = []  # (rows, chunks) of each fused call
        self.padded = False  # some rows are padding (`dummy`)
        self.block_ids: list[int] | None = None  # grouped: each call's key block
        if earlier_slices is None:
            return
        rows, blocks = [], []
        for a, earlier in earlier_slices:  # each slice's pairs in row order, then block order
            ib, ih, iq, ij = earlier.nonzero().unbind(1)  # (a permuted nonzero, in block order, is ~8x slower)
            rows.append((ib * hq + ih) * nq + iq + a)
            blocks.append((ib * hkv + ih // g) * nb + ij)
        pairs = sum(r.numel() for r in rows)
        if pairs == 0:
            return
        rows, blocks = (torch.cat(t) if len(t) > 1 else t[0] for t in (rows, blocks))
        count, chunk = variants
        if fused_available(q) and self.finite_keys and pairs >= _GROUP_ROWS * (b * hkv * nb):
            blocks, order = torch.sort(blocks, stable=True)  # key-block order (a radix sort: cheap)
            keys, counts = torch.unique_consecutive(blocks, return_counts=True)
            self._grouped(rows[order], keys, counts)
        else:  # every row's pairs are consecutive (slices cover disjoint queries)
            self._chunked(rows, blocks, _batch_rows(dev, bs))
        if count > 1:  # the query variant each pair reads: by chunk distance between query and block
            pos, blk = self.rows % nq + start, self.blocks.repeat_interleave(self.chunk_rows) % nb
            which = (pos // chunk - blk * bs // chunk).clamp(max=count - 1)
            self.source = self.rows + which * (b * hq * nq)

    def _grouped(self, rows: torch.Tensor, keys: torch.Tensor, counts: torch.Tensor) -> None:
        """One fused call per key block with all the rows that picked it (no padding, the block's K/V not
        copied per chunk); a block picked by more than 2 x _BATCH_ROWS rows is cut into calls of equal size.
        rows: in key-block order (`keys`, picked by `counts` rows each)."""
        self.rows = self.source = rows
        self.dummy = torch.zeros(rows.numel(), dtype=torch.bool, device=rows.device)
        parts = [-(-n // (2 * _BATCH_ROWS)) for n in counts.tolist()]
        self.blocks = keys.repeat_interleave(torch.tensor(parts, device=rows.device))
        sizes = [n // m + (i < n % m) for n, m in zip(counts.tolist(), parts, strict=True) for i in range(m)]
        self.chunk_rows = torch.tensor(sizes, device=rows.device)
        self.block_ids = self.blocks.tolist()
        first = 0
        for i, size in enumerate(sizes):
            self.batches.append((slice(first, first + size), slice(i, i + 1)))
            first += size

    def _chunked(self, rows: torch.Tensor, blocks: torch.Tensor, batch_rows: int) -> None:
        """Pairs ordered by (slot, block), slot = rank of the pair within its row, so one slot's pairs touch each
        row at most once and merge in place; each (slot, block) group padded to whole chunks of `chunk` rows
        (padding repeats a real row of the group, marked `dummy`), so a batch of chunks is one fused call."""
        dev, nblk = rows.device, int(blocks.max()) + 1
        _, per_row = torch.unique_consecutive(rows, return_counts=True)
        slot = torch.arange(rows.numel(), device=dev) - torch.repeat_interleave(per_row.cumsum(0) - per_row, per_row)
        order = torch.argsort(slot * nblk + blocks, stable=True)
        rows, blocks, slot = rows[order], blocks[order], slot[order]
        keys, counts = torch.unique_consecutive(slot * nblk + blocks, return_counts=True)
        chunks = (counts + self.chunk - 1) // self.chunk
        padded = chunks * self.chunk
        first = counts.cumsum(0) - counts
        group = torch.repeat_interleave(torch.arange(counts.numel(), device=dev), counts)
        pos = (padded.cumsum(0) - padded)[group] + torch.arange(rows.numel(), device=dev) - first[group]
        self.rows = torch.repeat_interleave(rows[first], padded)
        self.rows[pos] = rows
        self.source = self.rows
        self.dummy = torch.ones(self.rows.numel(), dtype=torch.bool, device=dev)
        self.dummy[pos] = False
        self.padded = self.rows.numel() > rows.numel()
        self.blocks = torch.repeat_interleave(keys % nblk, chunks)
        self.chunk_rows = torch.full_like(self.blocks, self.chunk)
        # fused calls of at most batch_rows rows, never mixing two slots
        slot_chunks = torch.zeros(int(slot[-1]) + 1, dtype=torch.long, device=dev)
        slot_chunks.index_add_(0, keys // nblk, chunks)
        step = max(1, batch_rows // self.chunk)
        c0 = 0
        for n_chunks in slot_chunks.tolist():
            for c in range(c0, c0 + n_chunks, step):
                c_end = min(c + step, c0 + n_chunks)
                self.batches.append((slice(c * self.chunk, c_end * self.chunk), slice(c, c_end)))
            c0 += n_chunks


def _calls(chunks: slice) -> int:
    return chunks.stop - chunks.start


def _rows(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows (flat over the first three dims) of a [B, H, N, D] tensor of any strides -> [len(rows), D]."""
    if t.is_contiguous():
        return t.view(-1, t.shape[-1]).index_select(0, rows)
    h, n = t.shape[1], t.shape[2]
    return t[rows // (h * n), rows // n % h, rows % n]


def _key_blocks(t: torch.Tensor, blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """Whole key blocks (flat over [B, Hkv, n_blocks]) of [B, Hkv, Nk, D] -> [len(blocks), 1, block_size, D]."""
    h, n, d = t.shape[1], t.shape[2], t.shape[3]
    nb = num_blocks(n, block_size)
    if t.is_contiguous() and n == nb * block_size:
        return t.view(-1, block_size, d).index_select(0, blocks)[:, None]
    whole = t[:, :, : (n // block_size) * block_size].unflatten(2, (n // block_size, block_size))
    return whole[blocks // (h * nb), blocks // nb % h, blocks % nb][:, None]


def _key_block(t: torch.Tensor, block: int, block_size: int) -> torch.Tensor:
    """Key block `block` (flat over [B, Hkv, n_blocks]) of [B, Hkv, Nk, D] as a [1, 1, block_size, D] view."""
    h, nb = t.shape[1], num_blocks(t.shape[2], block_size)
    j = block % nb * block_size
    return t[block // (h * nb), block // nb % h, j : j + block_size][None, None]


def _own_tile(block_size: int, tile: int | None = None) -> int:
    """Rows per causal tile of an own block: the CPU kernel computes a causal square at the cost of the full one,
    so blocks of 256+ keys run as causal tiles of 128 plus unmasked earlier-tile pieces (5/8 of the work at 512)
    in the backward; the forward (`tile` = half that) runs each tile of 64 rows against the block's keys up to
    it in one masked call (no merge; 27% less time than the 128-row pieces at 512 on the 2-core CPU)."""
    tile = _OWN_TILE if tile is None else tile
    return tile if block_size % tile == 0 and block_size >= 2 * tile else block_size


def _tiles(t: torch.Tensor, tile: int) -> torch.Tensor:
    """[n, H, bs, ...] (blocks of bs positions) -> [n * bs // tile, H, tile, ...] tiles to read (may be a copy)."""
    return t.unflatten(2, (-1, tile)).transpose(1, 2).flatten(0, 1)


def _untile(t: torch.Tensor, blocks: int) -> torch.Tensor:
    """Inverse of `_tiles` as a view: [n * T, H, tile, ...] -> [n, H, T, tile, ...]; write it into
    `x.unflatten(2, (-1, tile))`, which is always a view of x, so nothing is written to a silent copy."""
    return t.unflatten(0, (blocks, -1)).transpose(1, 2)


def _blocks_view(t: torch.Tensor, bi: int, heads: slice, first: int, blocks: tuple[int, int], bs: int) -> torch.Tensor:
    """Blocks c0..c1-1 of [B, H, N, ...] (position p at index p - first) as [c1 - c0, H', bs, ...], a view."""
    c0, c1 = blocks
    x = t[bi, heads, c0 * bs - first : c1 * bs - first]
    return x.unflatten(1, (c1 - c0, bs)).transpose(0, 1)


def _own_pieces(plan: _Plan, b: int, hkv: int, g: int, bs: int, start: int, call_rows: int | None = None):
    """Own-block pieces: (batch, q heads, kv heads, blocks (c0, c1) or (query rows, keys), causal offset or None).
    Whole blocks come in batches of about `_batch_rows` rows, counting `call_rows` rows a block (default bs)."""
    for bi in range(b):
        for h in range(hkv):
            heads, kv = slice(h * g, (h + 1) * g), slice(h, h + 1)
            if plan.own_full is not None:
                step = max(1, _batch_rows(plan.device, bs) // (g * (call_rows or bs)))
                for c0 in range(plan.own_full[0], plan.own_full[1], step):
                    yield bi, heads, kv, (c0, min(c0 + step, plan.own_full[1])), None
            for c, first, end in plan.own_partial:
                yield bi, heads, kv, (slice(first - start, end - start), slice(c * bs, end)), first - c * bs


def _output_rows(b: int, hq: int, nq: int, d: int, parts: int, dtype: torch.dtype, device: torch.device):
    """Flat output and log-sum-exp rows over [B, Hq, Nq] plus one trash row per part (padding rows' results)."""
    return _empty((b * hq * nq + parts, d), dtype, device), _empty((b * hq * nq + parts,), dtype, device)


def _whole_rows(rows: torch.Tensor, nq: int, total: int, first: int) -> torch.Tensor:
    """Flat rows over a part's [B, Hq, nq] -> flat rows over the whole [B, Hq, total] (part at query `first`)."""
    return rows // nq * total + first + rows % nq


def _forward(q, k, v, plan: _Plan, block_size: int, scale: float, dtype: torch.dtype, q_gated=None, into=None):
    """Output and log-sum-exp; own blocks read q, gated pieces read `q_gated` (the whole queries' variants stacked,
    [V * B, Hq, Nq, D]; `plan.source` picks the variant) if given.

    into: (out rows, lse rows from `_output_rows`, first query, all queries Nq, part index, the whole contiguous
    queries): q is the view of queries [first, first + nq) of the whole; write them into the whole [B, Hq, Nq]
    output in place (parts run at once, on disjoint rows) and gather gated rows from the whole queries (no copy).
    """
    b, hq, nq, d = q.shape
    hkv = k.shape[1]
    g, bs, start = hq // hkv, block_size, k.shape[2] - nq
    out_rows, lse_rows, first, total, part, q_whole = into or (
        *_output_rows(b, hq, nq, d, 1, dtype, q.device),
        0,
        nq,
        0,
        q,
    )
    trash = b * hq * total + part
    out_rows[trash], lse_rows[trash] = 0, 0
    out = out_rows[: b * hq * total].view(b, hq, total, d)[:, :, first : first + nq]
    lse = lse_rows[: b * hq * total].view(b, hq, total)[:, :, first : first + nq]
    tile = _own_tile(bs, _OWN_TILE // 2)
    for bi, heads, kv, where, offset in _own_pieces(plan, b, hkv, g, bs, start, call_rows=tile):
        if offset is None:  # whole blocks, batched as [blocks, heads, bs, D]
            qb = _blocks_view(q, bi, heads, start, where, bs).to(dtype)
            kb, vb = (_blocks_view(t, bi, kv, 0, where, bs).to(dtype) for t in (k, v))
            ob, lb = _blocks_view(out, bi, heads, start, where, bs), _blocks_view(lse, bi, heads, start, where, bs)
            for t0 in range(0, bs, tile):  # a tile's rows see the block's keys up to their own (causal)
                rows, keys = slice(t0, t0 + tile), slice(0, t0 + tile)
                o, l_ = attention_with_lse(qb[:, :, rows], kb[:, :, keys], vb[:, :, keys], t0, scale)
                ob[:, :, rows] = o
                lb[:, :, rows] = l_
        else:
            rows, keys = where
            o, l_ = attention_with_lse(
                q[bi, heads, rows][None].to(dtype),
                k[bi, kv, keys][None].to(dtype),
                v[bi, kv, keys][None].to(dtype),
                offset,
                scale,
            )
            out[bi, heads, rows] = o[0]
            lse[bi, heads, rows] = l_[0]
    # with finite scores the gated pieces accumulate with weights (`_accumulate`), else merge pairwise; CPU only,
    # where reading back whether a reference must move costs no device synchronisation
    weights = None
    if plan.batches and plan.finite_keys and q.device.type == "cpu":
        weights = torch.ones(out_rows.shape[0], dtype=dtype, device=q.device)
    for rows, chunks in plan.batches:
        idx, src = plan.rows[rows], plan.source[rows]
        if total != nq:  # this part's flat rows -> rows of the whole output (and queries, of each variant)
            idx = _whole_rows(idx, nq, total, first)
            part_rows = b * hq * nq
            src = _whole_rows(src % part_rows, nq, total, first) + src // part_rows * (b * hq * total)
        dummy = plan.dummy[rows] if plan.padded else None
        dst = idx if dummy is None else idx.masked_fill(dummy, trash)
        if plan.block_ids is None:
            kb, vb = (_key_blocks(t, plan.blocks[chunks], bs).to(dtype) for t in (k, v))
        else:  # grouped: one key block a call, read in place
            kb, vb = (_key_block(t, plan.block_ids[chunks.start], bs).to(dtype) for t in (k, v))
        o, l_ = attention_with_lse(
            _rows(q_whole if q_gated is None else q_gated, src).to(dtype).view(_calls(chunks), 1, -1, d),
            kb,
            vb,
            None,
            scale,
        )
        if weights is None:  # log-sum-exp merge with what the row has so far (its own block and earlier slots)
            o_new, l_new = out_rows.index_select(0, dst), lse_rows.index_select(0, dst)
            merge_lse_(o_new, l_new, o.view(-1, d), l_.view(-1))
            out_rows.index_copy_(0, dst, o_new)
            lse_rows.index_copy_(0, dst, l_new)
        else:
            _accumulate(out_rows, lse_rows, weights, dst, o.view(-1, d), l_.view(-1), dummy)
    if weights is not None:
        weights = weights[: b * hq * total].view(b, hq, total)[:, :, first : first + nq]
        out.div_(weights[..., None])
        lse.add_(weights.log_())
    return out, lse


# how far above a row's reference log-sum-exp a piece may be before the reference moves up: weights stay below
# e^20 each, so thousands of them sum far from float32's overflow (e^88)
_REBASE = 20.0


def _accumulate(out_rows, lse_rows, weights, dst, o, l_, dummy) -> None:
    """Add a call's pieces to their rows as ``out += w * o``, ``weights += w`` with ``w = exp(l_ - ref)``, where
    the reference ``ref`` (in `lse_rows`) starts as the own block's log-sum-exp and `out` holds the own block's
    output with weight 1; `_forward` divides by the weights at the end. Exact as the pairwise log-sum-exp merge,
    without reading and rewriting each row's output per call. Finite scores only (finite keys): a reference
    below a piece by more than `_REBASE` moves up to it, rescaling what the row holds."""
    ref = lse_rows.index_select(0, dst)
    rise = l_ - ref
    high = rise > _REBASE
    if bool(high.any()):
        moved = dst[high]
        factor = (ref[high] - l_[high]).exp_()
        out_rows.index_copy_(0, moved, out_rows.index_select(0, moved).mul_(factor[:, None]))
        weights.index_copy_(0, moved, weights.index_select(0, moved).mul_(factor))
        lse_rows.index_copy_(0, moved, l_[high])
        rise.masked_fill_(high, 0)
    w = rise.exp_() if dummy is None else rise.exp_().masked_fill_(dummy, 0)  # padding rows add nothing
    out_rows.index_add_(0, dst, o.mul_(w[:, None]))
    weights.index_add_(0, dst, w)


def _backward(do, q, k, v, out, lse, plan: _Plan, block_size: int, scale: float, dtype: torch.dtype):
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    g, bs, start = hq // hkv, block_size, nk - nq
    nb = num_blocks(nk, bs)
    do = do.to(dtype).contiguous()  # e.g. the expanded gradient of out.sum(): gathers want real rows
    dq = torch.zeros(b, hq, nq, d, dtype=dtype, device=q.device)
    dk = torch.zeros(b, hkv, nb * bs, d, dtype=dtype, device=q.device)
    dv = torch.zeros(b, hkv, nb * bs, d, dtype=dtype, device=q.device)
    for bi, heads, kv, where, offset in _own_pieces(plan, b, hkv, g, bs, start):
        if offset is None:  # the forward's tiles: causal tiles, then each later tile against earlier ones
            dob, qb, ob, lb, dqb = (_blocks_view(t, bi, heads, start, where, bs) for t in (do, q, out, lse, dq))
            kb, vb, dkb, dvb = (_blocks_view(t, bi, kv, 0, where, bs) for t in (k, v, dk, dv))
            qb, kb, vb = qb.to(dtype), kb.to(dtype), vb.to(dtype)
            tile = _own_tile(bs)
            grads = attention_with_lse_backward(*(_tiles(t, tile) for t in (dob, qb, kb, vb, ob, lb)), 0, scale)
            for grad, acc in zip(grads, (dqb, dkb, dvb), strict=True):
                acc.unflatten(2, (-1, tile)).add_(_untile(grad, acc.shape[0]))
            for t0 in range(tile, bs, tile):
                rows, keys = slice(t0, t0 + tile), slice(0, t0)
                later = (t[:, :, rows] for t in (dob, qb))
                earlier = (t[:, :, keys] for t in (kb, vb))
                gq, gk, gv = attention_with_lse_backward(*later, *earlier, ob[:, :, rows], lb[:, :, rows], None, scale)
                dqb[:, :, rows].add_(gq)
                dkb[:, :, keys].add_(gk)
                dvb[:, :, keys].add_(gv)
        else:
            rows, keys = where
            gq, gk, gv = attention_with_lse_backward(
                do[bi, heads, rows][None],
                q[bi, heads, rows][None].to(dtype),
                k[bi, kv, keys][None].to(dtype),
                v[bi, kv, keys][None].to(dtype),
                out[bi, heads, rows][None],
                lse[bi, heads, rows][None],
                offset,
                scale,
            )
            dq[bi, heads, rows] += gq[0]
            dk[bi, kv, keys] += gk[0]
            dv[bi, kv, keys] += gv[0]
    dq_rows, dk_blocks, dv_blocks = dq.view(-1, d), dk.view(-1, bs, d), dv.view(-1, bs, d)
    lse_rows = lse.reshape(-1)
    for rows, chunks in plan.batches:
        idx = plan.rows[rows]
        # padding rows get lse = +inf: probability 0, so they add nothing to any gradient
        lse_g = lse_rows.index_select(0, idx).masked_fill_(plan.dummy[rows], float("inf"))
        gq, gk, gv = attention_with_lse_backward(
            _rows(do, idx).view(_calls(chunks), 1, -1, d),
            _rows(q, idx).to(dtype).view(_calls(chunks), 1, -1, d),
            _key_blocks(k, plan.blocks[chunks], bs).to(dtype),
            _key_blocks(v, plan.blocks[chunks], bs).to(dtype),
            _rows(out, idx).view(_calls(chunks), 1, -1, d),
            lse_g.view(_calls(chunks), 1, -1),
            None,
            scale,
        )
        dq_rows.index_add_(0, idx, gq.view(-1, d))
        dk_blocks.index_add_(0, plan.blocks[chunks], gk[:, 0])
        dv_blocks.index_add_(0, plan.blocks[chunks], gv[:, 0])
    return dq, dk[:, :, :nk], dv[:, :, :nk]


def _part(t: torch.Tensor, first: int, end: int) -> torch.Tensor:
    """Queries [first, end) of [B, H, Nq, ...] as a contiguous tensor (the pieces gather rows of it)."""
    return t if (first, end) == (0, t.shape[2]) else t[:, :, first:end].contiguous()


def _prefix(t: torch.Tensor, queries_end: int, nq: int) -> torch.Tensor:
    """The keys a part ending at query `queries_end` can see: the first Nk - Nq + queries_end (a view)."""
    return t[:, :, : t.shape[2] - nq + queries_end]


class _MobaTorch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, parts, block_size, moba, scale):
        dtype = gate_dtype(q.dtype)
        nq = q.shape[2]

        b, hq, _, d = q.shape
        out_rows, lse_rows = _output_rows(b, hq, nq, d, len(parts), dtype, q.device)

        def run(index: int, first: int, end: int) -> _Plan:
            qp, kp, vp = q[:, :, first:end], _prefix(k, end, nq), _prefix(v, end, nq)
            earlier = None
            if moba.reaches_back():
                nb = num_blocks(kp.shape[2], block_size)
                per = max(1, _GATE_ELEMENTS * (1 if q.device.type == "cpu" else _GPU_SCALE) // (b * hq * nb))
                slices = selection_slices(
                    qp, kp, block_size=block_size, top_k=moba.top_k, gate=moba.gate, slice_rows=per, trim=True
                )
                earlier = ((a, gated) for a, _, gated in slices)
            plan = _Plan(qp, kp, block_size, earlier)
            with fused_if(plan.finite_keys):
                _forward(qp, kp, vp, plan, block_size, scale, dtype, into=(out_rows, lse_rows, first, nq, index, q))
            return plan

        plans = run_all([lambda i=i, p=p: run(i, *p) for i, p in enumerate(parts)], len(parts))
        out = out_rows[: b * hq * nq].view(b, hq, nq, d)
        lse = lse_rows[: b * hq * nq].view(b, hq, nq)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.parts, ctx.plans = parts, plans
        ctx.block_size, ctx.scale, ctx.dtype = block_size, scale, dtype
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        nq = q.shape[2]

        def run(first: int, end: int, plan: _Plan):
            part = (_part(t, first, end) for t in (grad_out, q, out, lse))
            do, qp, op, lp = part
            kp, vp = _prefix(k, end, nq), _prefix(v, end, nq)
            with fused_if(plan.finite_keys):
                return _backward(do, qp, kp, vp, op, lp, plan, ctx.block_size, ctx.scale, ctx.dtype)

        jobs = [lambda p=p, plan=plan: run(*p, plan) for p, plan in zip(ctx.parts, ctx.plans, strict=True)]
        grads = run_all(jobs, len(jobs))
        if len(grads) == 1:
            dq, dk, dv = grads[0]
        else:  # each part's key gradients cover its prefix of the keys
            dq = torch.cat([g[0] for g in grads], dim=2)
            dk, dv = torch.zeros_like(k, dtype=ctx.dtype), torch.zeros_like(v, dtype=ctx.dtype)
            for _, gk, gv in grads:
                dk[:, :, : gk.shape[2]] += gk
                dv[:, :, : gv.shape[2]] += gv
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def moba_attention_torch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockPlan, scale: float | None = None
) -> torch.Tensor:
    """MoBA attention (same contract as `moba_attention_reference`) without N x N tensors; autograd-capable.

    q: [B, Hq, Nq, D]; k, v: [B, Hkv, Nk, D]; returns [B, Hq, Nq, D] in q's dtype.
    """
    check_call(q, k, v, plan)
    block_size = effective_block_size(plan.block_size, k.shape[2])  # bounded by the sequence
    if has_nonfinite(q, v):
        return propagate_moba_nonfinite(moba_attention_torch, q, k, v, plan, scale)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    # transformers hands over [B, N, H, D] transposed views; gathering rows of strided tensors is several times
    # slower than one copy (with block 64 it made an 8K forward 1.7x slower)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    parts = query_parts(q.shape[2], k.shape[2], block_size, worker_count(q.device), plan.top_k)
    return _MobaTorch.apply(q, k, v, parts, block_size, plan, scale)


@torch.no_grad()
def attention_with_query_variants(
    queries: torch.Tensor | Sequence[torch.Tensor],
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    selected: torch.Tensor | Callable[[int, int], Iterable[tuple[int, torch.Tensor]]],
    block_size: int,
    variant_chunk: int,
    scale: float,
    top_k: int | None = None,
) -> torch.Tensor:
    """Block-sparse attention over a given selection where a query has several versions (inference only).

    queries: 1..3 tensors [B, Hq, Nq, D] (the same queries, e.g. rotated at different positions), as a list or
    stacked [V, B, Hq, Nq, D] (read in place); selected: bool [B, Hq, Nq, n_blocks] including each query's own
    block, or a function select(first, end) yielding (query a, bool [B, Hq, n, m]: the blocks 0..m-1 queries
    a..a+n-1 select) over the queries [first, end), called on each worker's range (selection then runs in
    parallel and is never held whole; top_k balances the ranges). The own block (causal) uses queries[0]; a gated
    block j of the query at position p uses queries[min(p // variant_chunk - j * block_size // variant_chunk,
    len(queries) - 1)] (Dual Chunk Attention's intra / successive / inter query by chunk distance; block_size
    must divide variant_chunk). Returns [B, Hq, Nq, D] in float32 (float64 for float64 input).
    """
    if not 1 <= len(queries) <= 3 or any(t.shape != queries[0].shape for t in queries):
        raise ValueError(f"queries must be 1 to 3 tensors of one shape, got shapes {[tuple(t.shape) for t in queries]}")
    check_shapes(queries[0], k, v)
    check_count("block_size", block_size, 1)
    if variant_chunk < 1 or variant_chunk % block_size:
        raise ValueError(f"variant_chunk must be a positive multiple of block_size ({block_size}), got {variant_chunk}")
    expected = (*queries[0].shape[:3], num_blocks(k.shape[2], block_size))
    if not callable(selected) and (selected.dtype != torch.bool or tuple(selected.shape) != expected):
        raise ValueError(f"selected must be bool {expected}, got {selected.dtype} {tuple(selected.shape)}")
    stacked = (queries if isinstance(queries, torch.Tensor) else torch.stack(list(queries))).contiguous()
    q = stacked[0]
    q_gated = stacked.flatten(0, 1) if len(stacked) > 1 else None  # [V * B, Hq, Nq, D]: rows of every variant
    k, v = k.contiguous(), v.contiguous()
    nq, nk = q.shape[2], k.shape[2]
    dtype = gate_dtype(q.dtype)

    b, hq, _, d = q.shape
    parts = query_parts(nq, nk, block_size, worker_count(q.device), top_k)
    out_rows, lse_rows = _output_rows(b, hq, nq, d, len(parts), dtype, q.device)

    def run(index: int, first: int, end: int) -> None:
        qp, kp, vp = q[:, :, first:end], _prefix(k, end, nq), _prefix(v, end, nq)
        if callable(selected):
            chosen = selected(first, end)
        else:
            chosen = [(first, selected[:, :, first:end, : num_blocks(kp.shape[2], block_size)])]
        earlier = ((a - first, without_own_block(sel, nk - nq + a, block_size)) for a, sel in chosen)
        plan = _Plan(qp, kp, block_size, earlier, variants=(len(stacked), variant_chunk))
        with fused_if(plan.finite_keys):
            into = (out_rows, lse_rows, first, nq, index, q)
            _forward(qp, kp, vp, plan, block_size, scale, dtype, q_gated, into=into)

    run_all([lambda i=i, p=p: run(i, *p) for i, p in enumerate(parts)], len(parts))
    return out_rows[: b * hq * nq].view(b, hq, nq, d)
