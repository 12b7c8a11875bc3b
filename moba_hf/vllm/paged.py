"""MoBA over vLLM's paged KV cache, per sequence of a mixed batch (pure torch, no vLLM import).

vLLM hands one forward a flat run of tokens from many sequences; `query_start_loc` cuts it, `seq_lens` says
how many keys each sequence has so far (cached + new), `block_table` lists its cache pages::

    tokens     | a a a a a | b | c c c |        query_start_loc = [0, 5, 6, 9]
    seq_lens     5           40  103            a: whole prompt, b: a decode step, c: a chunk (or a prompt
    queries    = the last (query_start_loc[i+1] - query_start_loc[i]) of seq_lens[i] keys     after a cached prefix)

Each sequence's keys are gathered from its own pages only (never the whole cache), and its queries attend
exactly as `moba_attention(q, k, v)` with q the last Nq of its Nk keys. MoBA's block size is independent of
the page size: the gathered keys are contiguous positions 0..Nk-1.

With Dual Chunk Attention (`PagedDca`) vLLM's model has rotated q and k at each token's index p in its
sequence; keys move to ``p mod s`` before they are written to the cache (so the cache holds DCA keys for
every later step), queries the same before they attend, and a sequence longer than one chunk attends as
`kernels.dca.dca_attention`, dense or with MoBA.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from ..config import MobaConfig
from ..dca.config import DcaParams
from ..kernels import causal_attention, moba_attention
from ..kernels.dca import dca_attention
from ..kernels.rope import rotate


def gather_sequence(cache: torch.Tensor, pages: torch.Tensor, length: int, *, transposed: bool = False) -> torch.Tensor:
    """The first `length` positions of one sequence: (kv_heads, length, head_dim).

    cache: (num_pages, kv_heads, page_size, head_dim), or (num_pages, kv_heads, head_dim, page_size) when
    `transposed` (how vLLM's CPU backend stores keys); any strides (its pages interleave K and V).
    pages: (>= ceil(length / page_size),) page ids of the sequence in order.
    """
    page = cache.shape[3] if transposed else cache.shape[2]
    used = pages[: -(-length // page)].long()
    rows = cache.index_select(0, used)  # this sequence's pages only
    if transposed:
        rows = rows.transpose(2, 3)  # (n_pages, Hkv, page, D)
    return rows.transpose(0, 1).flatten(1, 2)[:, :length]


def is_decode(query_len: int) -> bool:
    # one new token is a decode step, as in the transformers path (nq == 1)
    return query_len == 1


@dataclasses.dataclass(frozen=True)
class PagedDca:
    """DCA for the paged path: resolved c, s, temperature, and the model's RoPE inverse frequencies [D / 2]."""

    params: DcaParams
    inv_freq: torch.Tensor

    def deltas(self, query_start_loc: Sequence[int], seq_lens: Sequence[int]) -> torch.Tensor:
        """(tokens,) int64: how far each new token moves, from its index p in its sequence to p mod s.

        The new tokens of sequence i are the last (query_start_loc[i+1] - query_start_loc[i]) of its
        seq_lens[i] positions.
        """
        starts = torch.as_tensor(query_start_loc, dtype=torch.long)
        ends = starts[1:]
        owner = torch.repeat_interleave(torch.arange(len(ends)), ends - starts[:-1])
        p = torch.as_tensor(seq_lens, dtype=torch.long)[owner] - ends[owner] + torch.arange(int(starts[-1]))
        return p % self.params.chunk_size - p

    def move(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """x: (tokens, heads, D) rotated at p -> rotated at p + delta (delta: (tokens,) or fewer: the first
        len(delta) rows move, the rest, vLLM's padding, stays)."""
        n = delta.shape[0]
        work = torch.float64 if x.dtype == torch.float64 else torch.float32  # one rounding back to x's dtype
        moved = rotate(x[:n], delta[:, None], self.inv_freq, work).to(x.dtype)
        return moved if n == x.shape[0] else torch.cat([moved, x[n:]])


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
    config: MobaConfig,
    scale: float,
    skip_decodes: bool = False,
    dense: bool = False,
    dca: PagedDca | None = None,
) -> None:
    """Write attention of every sequence's queries into `output`, in place.

    query: (tokens, q_heads, D); key, value: (tokens, kv_heads, D), the new tokens (already in the cache);
    key_cache: (num_pages, kv_heads, D, page_size), value_cache: (num_pages, kv_heads, page_size, D), vLLM's CPU
    layout; output: (tokens, q_heads, D);
    query_start_loc: (num_seqs + 1,) token offsets; seq_lens: (num_seqs,) keys per sequence including the new
    ones; block_table: (num_seqs, max_pages). skip_decodes: leave one-token queries to the caller (vLLM's
    dense decode kernel for decode="full"). dense: causal attention (with DCA: dense DCA) instead of MoBA.
    dca: Dual Chunk Attention, with query and key already moved to p mod s (`PagedDca.move`) and the cache
    holding keys at their p mod s.
    """
    for i, length in enumerate(seq_lens):
        start, end = int(query_start_loc[i]), int(query_start_loc[i + 1])
        nq, length = end - start, int(length)
        if nq == 0 or (skip_decodes and is_decode(nq)):
            continue
        if nq == length:  # nothing cached before these tokens: read them directly
            k = key[start:end].transpose(0, 1)
            v = value[start:end].transpose(0, 1)
        else:
            k = gather_sequence(key_cache, block_table[i], length, transposed=True)
            v = gather_sequence(value_cache, block_table[i], length)
        q = query[start:end].transpose(0, 1).unsqueeze(0)
        k, v = k.unsqueeze(0).to(q.dtype), v.unsqueeze(0).to(q.dtype)
        dense_here = dense or (is_decode(nq) and config.decode == "full")
        if dca is not None and length > dca.params.chunk_size:  # within one chunk DCA changes nothing
            p = dca.params
            moba = {} if dense_here else config.kernel_kwargs()
            out = dca_attention(
                q, k, v, pretraining_length=p.pretraining_length, chunk_size=p.chunk_size, inv_freq=dca.inv_freq,
                scale=scale, temperature=p.temperature_factor(length), **moba,
            )  # fmt: skip
        elif dense_here:
            out = causal_attention(q, k, v, scale=scale)
        else:
            out = moba_attention(q, k, v, scale=scale, backend=config.backend, **config.kernel_kwargs())
        output[start:end] = out[0].transpose(0, 1).to(output.dtype)
