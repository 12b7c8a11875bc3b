"""Paged batches and their per-sequence answers, shared by the tests of every cache layout (test_paged.py: vLLM's
CPU layout; test_gpu_layout.py: its Triton / FlashAttention layout).

A layout's test hands `paged_batch` an empty cache and a writer that stores keys and values at slots
(page * PAGE + offset) the way that backend's vLLM cache write does; the answers come from the kernels on each
sequence's contiguous q / k / v.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moba_hf import MobaConfig, causal_attention, core
from moba_hf.kernels import attend_plan
from moba_hf.kernels.dual_chunk import dca_attention
from moba_hf.kernels.rope import rotate
from moba_hf.serving import ServedDca
from moba_hf.vllm.paged import PagedGateKeys, moba_paged

PAGE, HQ, HKV, D = 32, 6, 2, 64
# a fresh prompt, a decode step, a chunk starting inside a MoBA block (110 = 64 + 46), a prompt after a cached
# prefix of 96 tokens (three pages, one and a half MoBA blocks), a one-token prompt, a decode step over 300
SEQ_LENS = [70, 75, 150, 200, 1, 300]
QUERY_LENS = [70, 1, 40, 104, 1, 1]
# DCA with c = 64, s = 48 (MoBA blocks of 16 tile a chunk): a prompt over four chunks, a decode step, a chunk of
# 40 crossing a DCA chunk boundary (90 cached), a prompt after a cached prefix of 96, a one-token prompt, a prompt
# and a decode step inside the first chunk (plain attention there)
DCA_SEQ_LENS = [150, 175, 130, 200, 1, 30, 40]
DCA_QUERY_LENS = [150, 1, 40, 104, 1, 30, 1]
C, S = 64, 48
# (MoBA config, DCA temperature) of the DCA mixed-batch checks
DCA_CONFIGS = {
    "dense": (MobaConfig(sparse=False), False),
    "blk16-k3-temperature": (MobaConfig(block_size=16, top_k=3), True),
    "blk16-k2-bound-sink1-local1-decodefull": (
        MobaConfig(block_size=16, top_k=2, pooling="bound", sink_blocks=1, local_blocks=1, decode="full"),
        False,
    ),
    "blk16-k2-bound-tail5": (MobaConfig(block_size=16, top_k=2, pooling="bound", dense_tail=5), True),
    "blk16-k4-topp0.6": (MobaConfig(block_size=16, top_k=4, top_p=0.6, min_top_k=2), False),
}
# gate settings of the mixed-batch checks
CONFIGS = {
    "blk64-k2": MobaConfig(block_size=64, top_k=2),
    "blk48-k3-bound-sink1-local1": MobaConfig(block_size=48, top_k=3, pooling="bound", sink_blocks=1, local_blocks=1),
    "blk20-k2-decodefull": MobaConfig(block_size=20, top_k=2, decode="full", pooling="mean+max"),
    "blk48-k2-bound-tail30": MobaConfig(block_size=48, top_k=2, pooling="bound", dense_tail=30),
    "blk16-k5-bound-sink1-topp0.5": MobaConfig(block_size=16, top_k=5, pooling="bound", sink_blocks=1, top_p=0.5),
    "blk16-k2-decodek4": MobaConfig(block_size=16, top_k=2, decode_top_k=4),
}

# (kv_cache, keys (n, kv_heads, D), values, slots (n,)) -> None: stores them as the backend's cache write does
Writer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def slots_of(pages: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Cache slots of a sequence's positions, its pages in order."""
    return pages.long()[positions // PAGE] * PAGE + positions % PAGE


def paged_batch(seq_lens, query_lens, empty_cache: Callable[[int], torch.Tensor], write: Writer, seed=0, hq=HQ):
    """Random K/V of several sequences written by `write` into shuffled pages of `empty_cache(num_pages)` (three
    pages spare). Returns the cache, block table, query_start_loc, each sequence's keys and values, and the batch's
    queries, new keys and new values."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-n // PAGE) for n in seq_lens]
    order = torch.randperm(sum(pages_per_seq) + 3, generator=gen)[: sum(pages_per_seq)]
    kv_cache = empty_cache(sum(pages_per_seq) + 3)
    block_table = torch.zeros(len(seq_lens), max(pages_per_seq), dtype=torch.int32)
    keys, values, queries, new_k, new_v = [], [], [], [], []
    used = 0
    for i, (n, nq) in enumerate(zip(seq_lens, query_lens, strict=True)):
        pages = order[used : used + pages_per_seq[i]]
        used += pages_per_seq[i]
        block_table[i, : len(pages)] = pages.int()
        k, v = torch.randn(n, HKV, D, generator=gen), torch.randn(n, HKV, D, generator=gen)
        write(kv_cache, k, v, slots_of(pages, torch.arange(n)))
        keys.append(k), values.append(v), new_k.append(k[n - nq :]), new_v.append(v[n - nq :])
        queries.append(torch.randn(nq, hq, D, generator=gen))
    starts = [0]
    for nq in query_lens:
        starts.append(starts[-1] + nq)
    return kv_cache, block_table, starts, keys, values, torch.cat(queries), torch.cat(new_k), torch.cat(new_v)


def check_mixed_batch(config: MobaConfig, batch: tuple, layout: Callable, *, pooled_beside_pages: bool) -> None:
    """`moba_paged` over the `paged_batch` `batch`, its cache read through `layout`, == `moba_answer` per sequence;
    with `pooled_beside_pages` the gate reads `PagedGateKeys` (decode = "moba" steps read only their blocks)."""
    kv_cache, table, starts, keys, values, query, key, value = batch
    key_cache, value_cache = layout(kv_cache)
    assert key_cache.shape == value_cache.shape == (kv_cache.shape[0], HKV, PAGE, D)
    gate_keys = None
    if pooled_beside_pages:
        gate_keys = PagedGateKeys(key_cache, config.block_size, config.pooling)
        gate_keys.update(key_cache, torch.arange(kv_cache.shape[0]))
    output = torch.full_like(query, float("nan"))
    scale = D**-0.5
    seq_lens = [k.shape[0] for k in keys]
    moba_paged(
        query, key, value, key_cache, value_cache, output, query_start_loc=starts, seq_lens=seq_lens,
        block_table=table, plan=core.plan_for(config, 2), scale=scale, gate_keys=gate_keys,
    )  # fmt: skip
    for i in range(len(seq_lens)):
        q = query[starts[i] : starts[i + 1]].transpose(0, 1)[None]
        k, v = keys[i].transpose(0, 1)[None], values[i].transpose(0, 1)[None]
        want = moba_answer(config, q, k, v, scale)
        got = output[starts[i] : starts[i + 1]].transpose(0, 1)[None]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"sequence {i}")


def moba_answer(config: MobaConfig, q, k, v, scale: float, *, dense: bool = False) -> torch.Tensor:
    """What the plugin must give one sequence: q (1, Hq, Nq, D), its last Nq of k / v (1, Hkv, Nk, D); decode =
    "full" steps and `dense` layers causal, a prompt's or a chunk's last `dense_tail` queries too."""
    nq = q.shape[2]
    if dense or (nq == 1 and config.decode == "full"):
        return causal_attention(q, k, v, scale=scale)
    want = attend_plan(q, k, v, config.plan(nq).sparse, scale)
    tail = min(config.dense_tail, nq) if nq > 1 else 0  # a prompt's or a chunk's last queries, not a decode
    if tail:
        want[:, :, nq - tail :] = causal_attention(q[:, :, nq - tail :], k, v, scale=scale)
    return want


def dca_inputs(dca: ServedDca, raw_q, raw_k, seq_lens, query_lens, starts):
    """What vLLM hands the backend with DCA: the new tokens' q / k rotated at their index p (vLLM's RoPE), and the
    cached keys at p mod s (written by earlier steps): (cached keys per sequence, query, new keys)."""
    cached, queries, new_k = [], [], []
    for i, (n, nq) in enumerate(zip(seq_lens, query_lens, strict=True)):
        p = torch.arange(n)
        cached.append(rotate(raw_k[i][: n - nq], (p % S)[: n - nq, None], dca.inv_freq))
        new_k.append(rotate(raw_k[i][n - nq :], p[n - nq :, None], dca.inv_freq))
        queries.append(rotate(raw_q[starts[i] : starts[i + 1]], p[n - nq :, None], dca.inv_freq))
    return cached, torch.cat(queries), torch.cat(new_k)


def dca_answer(config: MobaConfig, dca: ServedDca, raw_q, raw_k, v, n: int, scale: float) -> torch.Tensor:
    """What the plugin must give one sequence with DCA: raw (unrotated) q (Nq, Hq, D), k / v (n, Hkv, D) rotated
    straight to their DCA positions (i mod s, j mod s)."""
    nq = raw_q.shape[0]
    p = torch.arange(n)
    q = rotate(raw_q, p[n - nq :, None] % S, dca.inv_freq).transpose(0, 1)[None]
    k = rotate(raw_k, p[:, None] % S, dca.inv_freq).transpose(0, 1)[None]
    v = v.transpose(0, 1)[None]
    dense = not config.sparse or (nq == 1 and config.decode == "full")
    plan = None if dense else config.plan(nq).sparse
    dca_args = dict(pretraining_length=C, chunk_size=S, inv_freq=dca.inv_freq, scale=scale,
                    temperature=dca.params.temperature_factor(n))  # fmt: skip
    if n > S:
        want = dca_attention(q, k, v, **dca_args, plan=plan)
    elif dense:
        want = causal_attention(q, k, v, scale=scale)
    else:
        want = attend_plan(q, k, v, plan, scale)
    tail = min(config.dense_tail, nq) if nq > 1 and not dense else 0  # the last queries of a prompt or chunk
    if tail:  # attend as dense DCA (plain causal attention within one chunk) over all n keys
        dense_rows = dca_attention(q, k, v, **dca_args) if n > S else causal_attention(q, k, v, scale=scale)
        want[:, :, nq - tail :] = dense_rows[:, :, nq - tail :]
    return want


def dca_paged_batch(dca: ServedDca, seq_lens, query_lens, empty_cache: Callable[[int], torch.Tensor], write: Writer):
    """A batch as vLLM hands it to the backend with DCA (`dca_inputs`), the cached keys at p mod s and the new keys
    moved by `ServedDca.move` and written by `write`, as `do_kv_cache_update` does. Returns the cache, block table,
    query_start_loc, each sequence's raw (unrotated) q, k and v, and the moved queries, moved new keys, new values."""
    kv_cache, table, starts, raw_k, values, raw_q, _, new_v = paged_batch(
        seq_lens, query_lens, empty_cache, lambda *args: None, seed=1
    )
    cached, query, key = dca_inputs(dca, raw_q, raw_k, seq_lens, query_lens, starts)
    for i, (n, nq) in enumerate(zip(seq_lens, query_lens, strict=True)):
        write(kv_cache, cached[i], values[i][: n - nq], slots_of(table[i], torch.arange(n - nq)))
    delta = dca.deltas(starts, seq_lens)
    moved = dca.move(key, delta)
    slots = torch.cat(
        [
            slots_of(table[i], torch.arange(n - nq, n))
            for i, (n, nq) in enumerate(zip(seq_lens, query_lens, strict=True))
        ]
    )
    write(kv_cache, moved, new_v, slots)
    return kv_cache, table, starts, raw_q, raw_k, values, dca.move(query, delta), moved, new_v


def check_dca_mixed_batch(case: str, empty_cache: Callable[[int], torch.Tensor], write: Writer, layout: Callable):
    """`moba_paged` with DCA over a `dca_paged_batch` (`DCA_CONFIGS[case]`), its cache read through `layout`,
    == `dca_answer` per sequence."""
    from moba_hf.dca.config import DcaParams
    from moba_hf.kernels.rope import default_inv_freq

    config, temperature = DCA_CONFIGS[case]
    dca = ServedDca(DcaParams(pretraining_length=C, chunk_size=S, temperature=temperature), default_inv_freq(D, 1e4))
    kv_cache, table, starts, raw_q, raw_k, values, query, key, value = dca_paged_batch(
        dca, DCA_SEQ_LENS, DCA_QUERY_LENS, empty_cache, write
    )
    key_cache, value_cache = layout(kv_cache)
    output = torch.full_like(query, float("nan"))
    scale = D**-0.5
    moba_paged(
        query, key, value, key_cache, value_cache, output, query_start_loc=starts, seq_lens=DCA_SEQ_LENS,
        block_table=table, plan=core.plan_for(config, 2, dca.params), scale=scale, dense=not config.sparse, dca=dca,
    )  # fmt: skip
    for i, n in enumerate(DCA_SEQ_LENS):
        raw = raw_q[starts[i] : starts[i + 1]]
        want = dca_answer(config, dca, raw, raw_k[i], values[i], n, scale)
        got = output[starts[i] : starts[i + 1]].transpose(0, 1)[None]
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5, msg=f"sequence {i}")
