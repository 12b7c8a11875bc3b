"""Sparse MoBA decode: a few new queries read the pooled block keys and only their selected cache blocks.

The caller keeps the pooled keys of the cache's blocks up to date (running sums, see
`moba_hf.integration.cache`), so a step costs O(blocks) for the gate plus O(top_k * block_size) for attention,
not O(cache length). Rows may start at different cache positions (left padding)::

    cache row b   pad pad | x x x x | x x x x | x q      starts[b] = 2, block_size = 4
    sequence pos          | 0 1 2 3 | 4 5 6 7 | 8 9      the query is at sequence position 9, block 2

Selection goes through `selected_blocks` itself (with one "key" per block, block_size 1), so decode picks
the blocks prefill would pick for a query at the same position, ties included.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Protocol

import torch

from .common import (
    GateOptions,
    check_inputs,
    check_moba_args,
    gate_dtype,
    gate_queries,
    gate_width,
    masked_matmul,
    pooled_keys,
    selected_blocks,
)
from .workers import run_single_threaded


def check_decode_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_keys: torch.Tensor,
    *,
    block_size: int,
    top_k: int,
    gate: GateOptions,
    starts: torch.Tensor | None,
    scale: object = None,
) -> None:
    check_inputs(q, k, v, scale)
    check_moba_args(q, k, v, block_size=block_size, top_k=top_k)
    if block_keys.dim() != 4:
        raise ValueError(f"block_keys must be 4-D, got shape {tuple(block_keys.shape)}")
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    width = gate_width(d, gate.pooling)
    if block_keys.shape[:2] != (b, hkv) or block_keys.shape[3] != width:
        raise ValueError(
            f"block_keys must be [B={b}, Hkv={hkv}, n_blocks, {width}] for pooling={gate.pooling!r}, "
            f"got {tuple(block_keys.shape)}"
        )
    if starts is not None and (starts.shape != (b,) or bool((starts < 0).any()) or bool((nk - starts < nq).any())):
        raise ValueError(f"starts must be [B={b}] cache positions with at least Nq={nq} tokens after them (Nk={nk})")


def decode_selection(
    q: torch.Tensor,
    block_keys: torch.Tensor,
    lengths: list[int],
    *,
    block_size: int,
    top_k: int,
    gate: GateOptions,
) -> torch.Tensor:
    """Blocks each query attends: bool [B, Hq, Nq, n_blocks] (n_blocks = block_keys.shape[2]).

    q: [B, Hq, Nq, D], the last Nq tokens of row b's sequence of `lengths[b]` tokens;
    block_keys: [B, Hkv, n_blocks, D] pooled keys (2D for "mean+max" and "bound", see `pooled_keys`).
    """
    b, hq, nq, _ = q.shape
    nb = block_keys.shape[2]
    gate_q = gate_queries(q, gate.pooling)  # one dot product with the pooled keys gives the gate score
    pooled_gate = dataclasses.replace(gate, pooling="mean")  # the mean of one key is that key
    out = torch.zeros(b, hq, nq, nb, dtype=torch.bool, device=q.device)
    for i in range(nq):
        # rows whose query i sits in the same block select together (usually all rows)
        current = [(lengths[r] - nq + i) // block_size for r in range(b)]
        for c in sorted(set(current)):
            rows = [r for r in range(b) if current[r] == c]
            index = torch.tensor(rows, device=q.device) if len(rows) < b else slice(None)
            sel = selected_blocks(
                gate_q[index, :, i : i + 1],
                block_keys[index, :, : c + 1],
                block_size=1,  # one pooled key per block: the gate sees the same scores as in prefill
                top_k=top_k,
                gate=pooled_gate,
                q_start=c,
            )
            out[index, :, i : i + 1, : c + 1] = sel
    return out


def moba_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_keys: torch.Tensor,
    *,
    block_size: int,
    top_k: int,
    scale: float | None = None,
    pooling: str = "mean",
    sink_blocks: int = 0,
    local_blocks: int = 0,
    starts: torch.Tensor | None = None,
    return_selection: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """MoBA attention of a few new queries over a KV cache, reading only the selected blocks.

    q: [B, Hq, Nq, D] -- the last Nq positions of the cache (Nq small: decode, speculative steps).
    k, v: [B, Hkv, Nk, D] -- the cache including the queries' own keys.
    block_keys: [B, Hkv, n_blocks, D] (2D for "mean+max" and "bound") -- each block's pooled keys in row b's sequence
        layout, covering at least the blocks of all Nk - starts[b] tokens; later entries are ignored.
    starts: [B] long -- cache position where row b's sequence begins (left padding); None means 0.
        Row b's sequence is cache positions starts[b] .. Nk - 1, all real tokens.
    Returns [B, Hq, Nq, D] in q's dtype (and the selection [B, Hq, Nq, n_blocks] if `return_selection`):
    exactly `moba_attention(q_b, k_b, v_b, ...)` for every row's sequence, with `block_keys` as the gate's keys.
    """
    gate = GateOptions(pooling, sink_blocks, local_blocks)
    check_decode_args(q, k, v, block_keys, block_size=block_size, top_k=top_k, gate=gate, starts=starts, scale=scale)
    # a decode step is dozens of small ops: one thread runs them faster than several (see `workers`)
    return run_single_threaded(
        lambda: _decode(q, DenseCache(k, v), block_keys, block_size, top_k, scale, gate, starts, return_selection),
        q.device,
    )


class CacheWindows(Protocol):
    """A KV cache that sparse decode reads a few windows of: `shape` is (B, Hkv, Nk, D)."""

    shape: tuple[int, int, int, int]

    def windows(self, start: torch.Tensor, width: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of cache positions start .. start + width - 1 for every start [B, Hkv, U], in `dtype`:
        each [B, Hkv, U * width, D]."""
        ...


@dataclasses.dataclass(frozen=True)
class DenseCache:
    """k, v: [B, Hkv, Nk, D] tensors; a window is one 2-D row gather of the flattened keys (no other copy)."""

    k: torch.Tensor
    v: torch.Tensor

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return tuple(self.k.shape)

    def windows(self, start: torch.Tensor, width: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        b, hkv, nk, d = self.k.shape
        dev = self.k.device
        first = (torch.arange(b, device=dev)[:, None, None] * hkv + torch.arange(hkv, device=dev)[:, None]) * nk
        rows = ((first + start).flatten()[:, None] + torch.arange(width, device=dev)).flatten()
        return tuple(
            t.contiguous().view(-1, d).index_select(0, rows).view(b, hkv, -1, d).to(dtype) for t in (self.k, self.v)
        )


def moba_decode_cache(
    q: torch.Tensor,
    cache: CacheWindows,
    block_keys: torch.Tensor,
    *,
    block_size: int,
    top_k: int,
    gate: GateOptions,
    scale: float | None = None,
) -> torch.Tensor:
    """`moba_decode` over any cache that reads windows of positions (e.g. a paged one), every row starting at
    cache position 0. q: [B, Hq, Nq, D], the last Nq positions; block_keys as in `moba_decode`; checked by the
    caller (shapes of a paged cache are the caller's to get right)."""
    return run_single_threaded(
        lambda: _decode(q, cache, block_keys, block_size, top_k, scale, gate, None, False), q.device
    )


def _decode(q, cache, block_keys, block_size, top_k, scale, gate, starts, return_selection):
    b, hq, nq, d = q.shape
    hkv, nk = cache.shape[1], cache.shape[2]
    scale = d**-0.5 if scale is None else scale
    dev = q.device
    if starts is None:
        starts = torch.zeros(b, dtype=torch.long, device=dev)
    starts = starts.to(device=dev, dtype=torch.long)
    lengths = (nk - starts).tolist()
    needed = -(-max(lengths) // block_size)
    if block_keys.shape[2] < needed:
        raise ValueError(f"block_keys has {block_keys.shape[2]} blocks, the sequences need {needed}")
    selected = decode_selection(
        q, block_keys[:, :, :needed], lengths, block_size=block_size, top_k=top_k, gate=gate
    )  # [B, Hq, Nq, nb]

    # per KV head, the union of the blocks its query heads selected: each is copied once and shared by the group
    g = hq // hkv
    by_head = selected.view(b, hkv, g * nq, -1)  # [B, Hkv, g*Nq, nb], rows ordered (query head, query)
    union = by_head.any(dim=2)  # [B, Hkv, nb]
    n_union = int(union.sum(-1).max())
    in_union, blk = union.to(torch.int8).topk(n_union, dim=-1)  # [B, Hkv, U]; pad entries have in_union 0
    # each block is read as one window of W contiguous cache keys (only those rows are copied);
    # a partial last block's window is shifted left to end at Nk and the keys outside the block are masked
    width = min(block_size, nk)
    block_start = blk * block_size + starts[:, None, None]  # cache position of each block's first key
    win_start = block_start.clamp(max=nk - width)
    dtype = gate_dtype(q.dtype)
    k_sel, v_sel = cache.windows(win_start, width, dtype)  # [B, Hkv, U*W, D]

    key_pos = (win_start[..., None] + torch.arange(width, device=dev)).flatten(-2)[:, :, None]  # [B, Hkv, 1, U*W]
    q_pos = (nk - nq + torch.arange(nq, device=dev)).repeat(g)[None, None, :, None]  # [1, 1, g*Nq, 1]
    wanted = by_head.gather(-1, blk[:, :, None].expand(-1, -1, g * nq, -1)) & in_union.bool()[:, :, None]
    block_start = block_start.repeat_interleave(width, dim=-1)[:, :, None]
    valid = wanted.repeat_interleave(width, dim=-1) & (key_pos >= block_start)  # [B, Hkv, g*Nq, U*W]
    valid &= (key_pos < block_start + block_size) & (key_pos <= q_pos)

    scores = (q.reshape(b, hkv, g * nq, d).to(dtype) @ k_sel.transpose(-1, -2)) * scale
    probs = scores.masked_fill(~valid, float("-inf")).softmax(dim=-1)
    out = masked_matmul(probs, valid, v_sel).view(b, hq, nq, d).to(q.dtype)  # NaN values reach only their rows
    return (out, selected) if return_selection else out


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


# --- when sparse decode pays ------------------------------------------------------------------------------------
CROSSOVER_ENV = "MOBA_HF_DECODE_CROSSOVER"  # blocks; 0 = always sparse (what tests of the sparse path use)
_MAX_CALIBRATION_KEYS = 1 << 16
_crossovers: dict[tuple, int] = {}


def decode_crossover(q: torch.Tensor, k: torch.Tensor, *, block_size: int, top_k: int, gate: GateOptions) -> int:
    """The fewest cache blocks from which a sparse decode step (`moba_decode`: gate + selected blocks) is faster
    than dense attention over the whole cache, for q's device and dtype, these head counts and this gate.

    Below it a decode step costs less as dense attention, which attends a superset of MoBA's blocks. Measured once
    per setting on random inputs (one query per row, doubling cache lengths up to 64K keys; best of five, the two
    alternated) and kept for the process; if sparse never wins in that range, twice the longest length tried.
    `MOBA_HF_DECODE_CROSSOVER=<blocks>` fixes it instead (0: always sparse).
    """
    fixed = os.environ.get(CROSSOVER_ENV)
    if fixed is not None:
        if not fixed.strip().isdigit():
            raise ValueError(f"{CROSSOVER_ENV} must be a whole number of blocks >= 0, got {fixed!r}")
        return int(fixed)
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[3]
    key = (q.device, q.dtype, hq, hkv, d, block_size, top_k, gate, torch.get_num_threads())
    if key not in _crossovers:
        _crossovers[key] = _measure_crossover(q, hkv, block_size, top_k, gate)
    return _crossovers[key]


def _seconds(fn, device: torch.device) -> float:
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def step_times(q: torch.Tensor, hkv: int, n: int, *, block_size: int, top_k: int, gate: GateOptions) -> tuple:
    """Best of five (sparse, dense) seconds of one decode step over `n` random cached keys, alternated."""
    from .common import causal_attention  # the dense step transformers' "sdpa" runs

    gen = torch.Generator(device=q.device).manual_seed(0)
    hq, d = q.shape[1], q.shape[3]
    query = torch.randn(1, hq, 1, d, generator=gen, device=q.device).to(q.dtype)
    keys, values = (torch.randn(1, hkv, n, d, generator=gen, device=q.device).to(q.dtype) for _ in range(2))
    pooled = pooled_keys(keys, block_size, gate.pooling)
    steps = (
        lambda: moba_decode(query, keys, values, pooled, block_size=block_size, top_k=top_k, **gate.as_kwargs()),
        lambda: causal_attention(query, keys, values),
    )
    for step in steps:
        step()  # warm up
    times = [[_seconds(step, q.device) for step in steps] for _ in range(5)]
    return min(t for t, _ in times), min(t for _, t in times)


def _measure_crossover(q: torch.Tensor, hkv: int, block_size: int, top_k: int, gate: GateOptions) -> int:
    blocks = top_k + gate.sink_blocks + gate.local_blocks + 1  # fewer: every block is attended anyway
    while True:
        t_sparse, t_dense = step_times(q, hkv, blocks * block_size, block_size=block_size, top_k=top_k, gate=gate)
        if t_sparse <= t_dense:
            return blocks
        if 2 * blocks * block_size > _MAX_CALIBRATION_KEYS:
            return 2 * blocks
        blocks *= 2
