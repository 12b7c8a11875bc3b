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

With decode = "moba" the gate's pooled keys are kept beside the pool (`PoolGateKeys`): a decode step then reads
one statistics entry per block and the selected blocks' keys, never its whole sequence (`core.decode`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from .. import core
from ..kernels.checks import gate_dtype
from ..kernels.pooling import BlockStats


def gather_sequence(buffer: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """buffer: (pool_slots, kv_heads, D); slots: (n,) a sequence's slots in position order -> (kv_heads, n, D)."""
    return buffer.index_select(0, slots.long()).transpose(0, 1)


@dataclasses.dataclass(frozen=True)
class PoolCache:
    """One sequence's keys and values in SGLang's pool, read as the windows sparse decode asks for
    (`kernels.decode.CacheWindows`): only the selected positions are copied."""

    k_buffer: torch.Tensor  # (pool_slots, kv_heads, D)
    v_buffer: torch.Tensor
    slots: torch.Tensor  # (length,) long: the sequence's slots in position order

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (1, self.k_buffer.shape[1], self.slots.shape[0], self.k_buffer.shape[2])

    def windows(self, start: torch.Tensor, width: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        pos = start[..., None] + torch.arange(width, device=start.device)  # (1, Hkv, U, W)
        slot = self.slots[pos]
        head = torch.arange(start.shape[1], device=start.device)[None, :, None, None]
        keys, values = self.k_buffer[slot, head], self.v_buffer[slot, head]  # (1, Hkv, U, W, D)
        return keys.flatten(2, 3).to(dtype), values.flatten(2, 3).to(dtype)


class PoolGateKeys:
    """The gate's pooled keys of one layer kept beside SGLang's KV pool, so a decode step never reads a whole
    sequence.

    A MoBA block's statistics (`kernels.pooling.BlockStats`, float32) are stored at the pool slot of the block's
    last token, (pool_slots, kv_heads, width): a block's keys never change while its slots are allocated, so the
    entry is right for every sequence whose `req_to_token` row shares that slot (a radix-cache prefix). `update`
    computes the blocks that the forward's new tokens complete, in whichever request completes them; a freed and
    reused slot gets a new entry when a block of its new owner ends there, and no other entry is read.
    """

    def __init__(self, k_buffer: torch.Tensor, block_size: int, pooling: str) -> None:
        num_slots, hkv, d = k_buffer.shape
        self.block_size = block_size
        self.dtype = gate_dtype(k_buffer.dtype)
        self.pool = BlockStats.of(pooling, d)
        self.stats = torch.zeros((num_slots, hkv, self.pool.width), dtype=self.dtype, device=k_buffer.device)

    def update(self, k_buffer: torch.Tensor, slots: torch.Tensor, first_new: int) -> None:
        """Compute the blocks completed by positions first_new .. len(slots) - 1 of a sequence (slots: its
        slots in position order, the new tokens' keys already in the pool)."""
        size = self.block_size
        first, last = first_new // size, slots.shape[0] // size  # blocks first .. last - 1 end among the new tokens
        if last <= first:
            return
        keys = k_buffer.index_select(0, slots[first * size : last * size].long()).to(self.dtype).transpose(0, 1)
        stats = self.pool.reduce_blocks(keys, size)  # (Hkv, blocks, width)
        ends = slots[first * size + size - 1 : last * size : size].long()
        self.stats.index_copy_(0, ends, stats.transpose(0, 1))

    def block_keys(self, slots: torch.Tensor, length: int) -> torch.Tensor:
        """Pooled keys (1, Hkv, n_blocks, width) of a sequence of `length` tokens in `slots`, as
        `kernels.pooling.pooled_keys` gives them for every block before the last; the last (the decode
        query's own block) is zeros."""
        size = self.block_size
        hkv, width = self.stats.shape[1:]
        before = (length - 1) // size  # complete blocks before the query's own
        own = self.stats.new_zeros(1, hkv, 1, width)
        if before == 0:
            return own
        ends = slots[size - 1 : before * size : size].long()
        keys = self.pool.pooled(self.stats.index_select(0, ends).transpose(0, 1), size)
        return torch.cat([keys[None], own], dim=2)


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
    plan: core.AttentionPlan,
    scale: float | None,
    dense: bool = False,
    dca: core.Dca | None = None,
    gate_keys: PoolGateKeys | None = None,
) -> None:
    """Write every sequence's attention into `output`, in place.

    query, output: (tokens, q_heads, D), the sequences' new tokens one after the other; k_buffer, v_buffer: one
    layer's pool (pool_slots, kv_heads, D), the new tokens' keys already written; req_to_token: (max_requests,
    max_context) slot ids; req_pool_indices, seq_lens, extend_lens: per sequence, its row of req_to_token, its
    positions so far (new ones included) and how many are new; plan: what the server's config resolved to
    (`startup.Setup.plan`). dense: a full-attention layer (causal attention;
    with `dca`, dense DCA). dca: queries and the pool's keys at their DCA positions. gate_keys: the pooled keys
    beside the pool (decode = "moba"), brought up to date here with the blocks the new tokens complete; decode steps
    then read only their selected blocks.
    """
    start = 0
    for row, length, nq in zip(req_pool_indices, seq_lens, extend_lens, strict=True):
        row, length, nq = int(row), int(length), int(nq)
        end = start + nq
        if nq == 0:
            continue
        q = query[start:end].transpose(0, 1).unsqueeze(0)
        slots = req_to_token[row, :length]
        route = core.route(core.runs_dense(plan, nq, dense), length, dca)
        if gate_keys is not None:
            gate_keys.update(k_buffer, slots, length - nq)
            if nq == 1 and route == "moba" and dca is None:
                cache = PoolCache(k_buffer, v_buffer, slots.long())
                out = core.decode(q, cache, gate_keys.block_keys(slots, length), plan, scale)
                output[start:end] = out[0].transpose(0, 1).to(output.dtype)
                start = end
                continue
        k = gather_sequence(k_buffer, slots).unsqueeze(0).to(q.dtype)
        v = gather_sequence(v_buffer, slots).unsqueeze(0).to(q.dtype)
        out = core.attend(q, k, v, plan, scale, route, dca)
        output[start:end] = out[0].transpose(0, 1).to(output.dtype)
        start = end
