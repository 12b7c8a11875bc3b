"""MoBA over vLLM's paged KV cache, per sequence of a mixed batch (pure torch, no vLLM import).

vLLM hands one forward a flat run of tokens from many sequences; `query_start_loc` cuts it, `seq_lens` says
how many keys each sequence has so far (cached + new), `block_table` lists its cache pages::

    tokens     | a a a a a | b | c c c |        query_start_loc = [0, 5, 6, 9]
    seq_lens     5           40  103            a: whole prompt, b: a decode step, c: a chunk (or a prompt
    queries    = the last (query_start_loc[i+1] - query_start_loc[i]) of seq_lens[i] keys     after a cached prefix)

Each sequence's keys are gathered from its own pages only (never the whole cache), and its queries attend
exactly as `moba_attention(q, k, v)` with q the last Nq of its Nk keys. MoBA's block size is independent of
the page size: the gathered keys are contiguous positions 0..Nk-1.

With Dual Chunk Attention (`serving.ServedDca`) vLLM's model has rotated q and k at each token's
index p in its sequence; keys move to ``p mod s`` before they are written to the cache (so the cache holds DCA keys
for every later step), queries the same before they attend, and a sequence longer than one chunk attends as
`kernels.dual_chunk.dca_attention`, dense or with MoBA.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Container, Sequence

import torch

from .. import core
from ..kernels.checks import gate_dtype
from ..kernels.pooling import BlockStats
from ..serving import ServedDca  # the DCA moves every server plugin shares


def gather_sequence(cache: torch.Tensor, pages: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` positions of one sequence: (kv_heads, length, head_dim).

    cache: (num_pages, kv_heads, page_size, head_dim), a layout's view (any strides).
    pages: (>= ceil(length / page_size),) page ids of the sequence in order.
    """
    page = cache.shape[2]
    used = pages[: -(-length // page)].long()
    rows = cache.index_select(0, used)  # this sequence's pages only: (n_pages, Hkv, page, D)
    return rows.transpose(0, 1).flatten(1, 2)[:, :length]


@dataclasses.dataclass(frozen=True)
class PagedCache:
    """One sequence's keys and values in vLLM's pages, read as the windows sparse decode asks for
    (`kernels.decode.CacheWindows`): only the selected positions are copied."""

    key_cache: torch.Tensor  # (num_pages, kv_heads, page_size, D), a layout's view
    value_cache: torch.Tensor  # (num_pages, kv_heads, page_size, D)
    pages: torch.Tensor  # (>= ceil(length / page_size),) long
    length: int

    @property
    def shape(self) -> tuple[int, int, int, int]:
        _, hkv, _, d = self.key_cache.shape
        return (1, hkv, self.length, d)

    def windows(self, start: torch.Tensor, width: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        page_size = self.key_cache.shape[2]
        pos = start[..., None] + torch.arange(width, device=start.device)  # (1, Hkv, U, W)
        page, offset = self.pages[pos // page_size], pos % page_size
        head = torch.arange(start.shape[1], device=start.device)[None, :, None, None]
        keys = self.key_cache[page, head, offset]  # (1, Hkv, U, W, D)
        values = self.value_cache[page, head, offset]
        return keys.flatten(2, 3).to(dtype), values.flatten(2, 3).to(dtype)


class PagedGateKeys:
    """The gate's pooled keys kept beside vLLM's paged cache, so a decode step never reads a whole sequence.

    Each page is cut into units of gcd(MoBA block, page size) tokens; per unit and KV head it holds the pooling's
    statistics (`kernels.pooling.BlockStats`) in float32, (num_pages, kv_heads, units_per_page, width). A MoBA
    block's pooled key merges its units, so the block size and the page size are independent. `update`
    recomputes the pages a cache write touched; a unit is right once its last token is written, which every
    block before a query's own is (the own block's pooled key is never scored). Pages shared by the prefix
    cache keep their content, hence their statistics.
    """

    def __init__(self, key_cache: torch.Tensor, block_size: int, pooling: str) -> None:
        num_pages, hkv, page_size, d = key_cache.shape
        self.block_size = block_size
        self.unit = math.gcd(block_size, page_size)
        self.dtype = gate_dtype(key_cache.dtype)
        self.pool = BlockStats.of(pooling, d)
        shape = (num_pages, hkv, page_size // self.unit, self.pool.width)
        self.stats = torch.zeros(shape, dtype=self.dtype, device=key_cache.device)

    def update(self, key_cache: torch.Tensor, pages: torch.Tensor) -> None:
        """Recompute the statistics of `pages` (long, unique) from the cache (a layout's key view)."""
        keys = key_cache.index_select(0, pages).to(self.dtype)  # (P, Hkv, page, D)
        self.stats.index_copy_(0, pages, self.pool.reduce_blocks(keys, self.unit))

    def block_keys(self, pages: torch.Tensor, length: int) -> torch.Tensor:
        """Pooled keys (1, Hkv, n_blocks, width) of a sequence of `length` tokens in `pages`, as
        `kernels.pooling.pooled_keys` gives them for every block before the last; the last (the decode
        query's own block) is zeros."""
        hkv, units_per_page, width = self.stats.shape[1:]
        before = (length - 1) // self.block_size  # complete blocks before the query's own
        own = self.stats.new_zeros(1, hkv, 1, width)
        if before == 0:
            return own
        per_block = self.block_size // self.unit
        needed_pages = -(-before * per_block // units_per_page)
        units = self.stats.index_select(0, pages[:needed_pages]).transpose(0, 1).flatten(1, 2)  # (Hkv, units, W)
        units = units[:, : before * per_block].unflatten(1, (before, per_block))
        keys = self.pool.pooled(self.pool.merge(units, 2), self.block_size)
        return torch.cat([keys[None], own], dim=2)


def is_decode(query_len: int) -> bool:
    # one new token is a decode step, as in the transformers path (nq == 1)
    return query_len == 1


def dense_decodes(query_lens: Sequence[int], plan: core.AttentionPlan) -> list[int]:
    """Sequences whose decode step runs dense: every one with decode = "full", none with decode = "moba" (which
    attends MoBA's blocks at every step, whatever the sequence length)."""
    return [i for i, nq in enumerate(query_lens) if plan.dense_decode(nq)]


def moba_paged(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    output: torch.Tensor,
    *,
    query_start_loc: Sequence[int],
    seq_lens: Sequence[int],
    block_table: torch.Tensor,
    plan: core.AttentionPlan,
    scale: float,
    skip: Container[int] = (),
    dense: bool = False,
    dca: ServedDca | None = None,
    gate_keys: PagedGateKeys | None = None,
) -> None:
    """Write attention of every sequence's queries into `output`, in place.

    query: (tokens, q_heads, D); key, value: (tokens, kv_heads, D), the new tokens (already in the cache);
    key_cache, value_cache: (num_pages, kv_heads, page_size, D), a layout's views (`layouts`) of vLLM's cache;
    output: (tokens, q_heads, D);
    query_start_loc: (num_seqs + 1,) token offsets; seq_lens: (num_seqs,) keys per sequence including the new
    ones; block_table: (num_seqs, max_pages); plan: what the engine's config resolved to (`startup.Setup.plan`).
    skip: sequences (indices) the caller computes (decode steps it runs on vLLM's dense kernel). dense: causal
    attention (with DCA: dense DCA) instead of MoBA.
    gate_keys: the pooled keys kept beside the cache (up to date for every page): decode steps (decode="moba")
    then read only their selected blocks; without it they gather their whole sequence.
    dca: Dual Chunk Attention, with query and key already moved to p mod s (`ServedDca.move`) and the cache
    holding keys at their p mod s.
    """
    for i, length in enumerate(seq_lens):
        start, end = int(query_start_loc[i]), int(query_start_loc[i + 1])
        nq, length = end - start, int(length)
        if nq == 0 or i in skip:
            continue
        q = query[start:end].transpose(0, 1).unsqueeze(0)
        route = core.route(core.runs_dense(plan, nq, dense), length, dca)
        if gate_keys is not None and is_decode(nq) and route == "moba" and dca is None:
            pages = block_table[i].long()
            cache = PagedCache(key_cache, value_cache, pages, length)
            out = core.decode(q, cache, gate_keys.block_keys(pages, length), plan, scale)
            output[start:end] = out[0].transpose(0, 1).to(output.dtype)
            continue
        if nq == length:  # nothing cached before these tokens: read them directly
            k = key[start:end].transpose(0, 1)
            v = value[start:end].transpose(0, 1)
        else:
            k = gather_sequence(key_cache, block_table[i], length)
            v = gather_sequence(value_cache, block_table[i], length)
        k, v = k.unsqueeze(0).to(q.dtype), v.unsqueeze(0).to(q.dtype)
        out = core.attend(q, k, v, plan, scale, route, dca)
        output[start:end] = out[0].transpose(0, 1).to(output.dtype)
