"""MoBA over SGLang's KV pool, per sequence of a batch (pure torch, no SGLang import).

SGLang keeps each layer's keys and values in token slots of one pool (`k_buffer`, `v_buffer`: (slots, kv_heads,
D)); a request's row of `req_to_token` lists its slots in position order, the slots a radix-cache prefix shares
included. A forward runs either an extend (prompts, chunks of a chunked prefill, a prompt after a radix-cache hit)
or a decode step (one new token per request); either way sequence i's new tokens are the last `extend_lens[i]`
of its `seq_lens[i]` positions::

    tokens      | a a a a a | b b b | c |      extend_lens = [5, 3, 1]    seq_lens = [5, 103, 40]
                  a: a whole prompt, b: a chunk (or a prompt after 100 cached tokens), c: a decode step

Each sequence's keys are gathered from its own slots only, and its queries attend exactly as `core.attend` with
q the last Nq of its Nk keys: the core decides and computes everything, this module only reads the pool.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import core
from ..config import MobaConfig


def gather_sequence(buffer: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """buffer: (pool_slots, kv_heads, D); slots: (n,) a sequence's slots in position order -> (kv_heads, n, D)."""
    return buffer.index_select(0, slots.long()).transpose(0, 1)


def moba_pool(
    query: torch.Tensor,
    output: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    *,
    req_pool_indices: Sequence[int],
    seq_lens: Sequence[int],
    extend_lens: Sequence[int],
    config: MobaConfig,
    scale: float | None,
    dense: bool = False,
    dca: core.Dca | None = None,
) -> None:
    """Write every sequence's attention into `output`, in place.

    query, output: (tokens, q_heads, D), the sequences' new tokens one after the other; k_buffer, v_buffer: one
    layer's pool (pool_slots, kv_heads, D), the new tokens' keys already written; req_to_token: (max_requests,
    max_context) slot ids; req_pool_indices, seq_lens, extend_lens: per sequence, its row of req_to_token, its
    positions so far (new ones included) and how many are new. dense: a full-attention layer (causal attention;
    with `dca`, dense DCA). dca: queries and the pool's keys at their DCA positions.
    """
    start = 0
    for row, length, nq in zip(req_pool_indices, seq_lens, extend_lens, strict=True):
        row, length, nq = int(row), int(length), int(nq)
        end = start + nq
        if nq == 0:
            continue
        q = query[start:end].transpose(0, 1).unsqueeze(0)
        slots = req_to_token[row, :length]
        k = gather_sequence(k_buffer, slots).unsqueeze(0).to(q.dtype)
        v = gather_sequence(v_buffer, slots).unsqueeze(0).to(q.dtype)
        route = core.path(config, nq, length, dense_layer=dense, dca=dca)
        out = core.attend(q, k, v, config, scale, route, dca)
        output[start:end] = out[0].transpose(0, 1).to(output.dtype)
        start = end
