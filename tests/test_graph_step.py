"""The fixed-shape decode step (`kernels.graph_step`): equal to the reference over every row's real tokens, its block
statistics equal to a recount, and traced whole, once for every step (no host read, no shape that changes)."""

import pytest
import torch

from moba_hf.kernels import causal_attention, moba_attention_reference
from moba_hf.kernels.checks import gate_dtype
from moba_hf.kernels.graph_step import graph_decode_step, graph_dense_step
from moba_hf.kernels.plan import BlockPlan
from moba_hf.kernels.pooling import BlockStats

# (B, Hq, Hkv, slots, D, block, top_k, pooling, sink, local, top_p)
CASES = [
    (2, 4, 2, 61, 8, 5, 3, "mean", 0, 0, None),
    (3, 9, 3, 80, 8, 8, 3, "mean", 0, 0, None),  # SmolLM2's GQA ratio
    (2, 6, 2, 64, 16, 8, 2, "max", 1, 0, None),
    (3, 4, 1, 50, 8, 7, 4, "mean+max", 0, 1, None),
    (2, 6, 3, 45, 8, 5, 3, "bound", 1, 1, None),
    (2, 4, 2, 40, 8, 4, 1, "mean", 0, 0, None),  # own block only
    (2, 4, 4, 37, 8, 4, 20, "mean", 0, 0, None),  # top_k >= blocks: every block
    (2, 4, 2, 70, 8, 6, 4, "mean", 1, 0, 0.6),  # the adaptive budget
]
# each row's slots: "pad" (left padding), "real", "gap" (a pad between real tokens); the new token is the last written
LAYOUTS = {
    "left_padded": lambda b, n: [[False] * r + [True] * (n - r) for r in (0, 3, 11)[:b]],
    "gaps": lambda b, n: [[(s % 7 != 3) or s == n - 1 for s in range(n)] for _ in range(b)],
    "new_pad": lambda b, n: [[True] * (n - 1) + [r != 1] for r in range(b)],  # row 1's new token is a pad
}


def _case_id(c):
    b, hq, hkv, n, d, bs, k, pool, sink, local, top_p = c
    return f"B{b}-N{n}-H{hkv}-HQ{hq}-blk{bs}-k{k}-{pool}-s{sink}l{local}-p{top_p}"


def _plan(case) -> BlockPlan:
    *_, bs, top_k, pooling, sink, local, top_p = case
    return BlockPlan.build(bs, top_k, pooling, sink, local, top_p, 1)


def _inputs(case, written: int, layout: str, seed: int = 0, dtype=torch.float32):
    """q, k, v (the cache, `written` of its slots filled), real [B, slots], last, and the block statistics of each
    row's real tokens before the new one."""
    b, hq, hkv, n, d, bs, *_ = case
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, 1, d, generator=gen, dtype=dtype)
    k = torch.randn(b, hkv, n, d, generator=gen, dtype=dtype)
    v = torch.randn(b, hkv, n, d, generator=gen, dtype=dtype)
    real = torch.zeros(b, n, dtype=torch.bool)
    real[:, :written] = torch.tensor(LAYOUTS[layout](b, written))
    before = real.clone()
    before[:, written - 1] = False
    return q, k, v, real, torch.tensor(written - 1), _recount(k, before, bs, _plan(case).gate.pooling)


def _recount(k, real, block_size, pooling):
    """The statistics of each row's real keys in blocks of its sequence: [B, Hkv, ceil(slots / block), width]."""
    b, hkv, n, d = k.shape
    pool = BlockStats.of(pooling, d)
    stats = pool.empty(b, hkv, -(-n // block_size), dtype=gate_dtype(k.dtype), device=k.device)
    for r in range(b):
        keys = k[r : r + 1, :, real[r]].to(stats.dtype)
        if keys.shape[2]:
            counted = pool.reduce_blocks(keys, block_size)
            stats[r : r + 1, :, : counted.shape[2]] = counted
    return stats


def _want(q, k, v, real, last, plan):
    """The reference over each row's real tokens, for the rows whose new token is real (zeros for the others)."""
    out = torch.zeros_like(q)
    for r in range(q.shape[0]):
        if real[r, last]:
            keys, values = k[r : r + 1, :, real[r]], v[r : r + 1, :, real[r]]
            out[r : r + 1] = moba_attention_reference(q[r : r + 1], keys, values, plan)
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_graph_step_equals_the_reference_and_keeps_the_block_statistics(case, layout):
    plan = _plan(case)
    n, bs = case[3], case[5]
    for written in (n // 3, n - 2, n):  # inside a block, past several, the cache's last slot
        q, k, v, real, last, stats = _inputs(case, written, layout, seed=written)
        got = graph_decode_step(q, k, v, stats, real, last, plan)
        torch.testing.assert_close(got, _want(q, k, v, real, last, plan), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(stats, _recount(k, real, bs, plan.gate.pooling), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_graph_dense_step_equals_dense_attention_over_each_rows_real_tokens(layout):
    """A dense layer's or decode="full"'s captured step: causal attention of the new token over its row's real
    tokens (zeros for a pad), GQA, a NaN value in a pad slot reaching no row."""
    case = (3, 6, 2, 50, 8, 8, 3, "mean", 0, 0, None)
    q, k, v, real, last, _ = _inputs(case, 41, layout)
    pad_slots = (~real[:, :41]).nonzero()
    v[pad_slots[:, 0], :, pad_slots[:, 1]] = float("nan")
    got = graph_dense_step(q, k, v, real, last)
    for r in range(q.shape[0]):
        if real[r, last]:
            want = causal_attention(q[r : r + 1], k[r : r + 1, :, real[r]], v[r : r + 1, :, real[r]])
        else:
            want = torch.zeros_like(q[r : r + 1])
        torch.testing.assert_close(got[r : r + 1], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda a: {**a, "q": a["q"].expand(-1, -1, 2, -1)}, "one new token per row"),
        (lambda a: {**a, "real": a["real"].to(torch.int8)}, "real must be a bool"),
        (lambda a: {**a, "real": a["real"][:, :-1]}, "real must be a bool"),
        (lambda a: {**a, "last": a["last"].view(1)}, "last must be a 0-d integer"),
        (lambda a: {**a, "stats": a["stats"][:, :, :3]}, "stats must be"),
        (lambda a: {**a, "v": a["v"][:, :, :-1]}, "k and v must have the same shape"),
    ],
)
def test_graph_step_refuses_bad_arguments_by_name(change, match):
    case = (2, 4, 2, 40, 8, 8, 3, "mean", 0, 0, None)
    q, k, v, real, last, stats = _inputs(case, 30, "left_padded")
    args = change({"q": q, "k": k, "v": v, "stats": stats, "real": real, "last": last})
    with pytest.raises(ValueError, match=match):
        graph_decode_step(**args, plan=_plan(case))


def test_graph_step_in_bfloat16_scores_in_float32_as_the_reference():
    """16-bit caches (a GPU's): the statistics, the gate and the softmax in float32, as the reference computes them;
    the output within bfloat16's rounding of it."""
    case = (2, 9, 3, 80, 16, 8, 3, "mean", 1, 1, None)
    plan = _plan(case)
    q, k, v, real, last, stats = _inputs(case, 70, "left_padded", dtype=torch.bfloat16)
    assert stats.dtype == torch.float32
    got = graph_decode_step(q, k, v, stats, real, last, plan)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, _want(q, k, v, real, last, plan), rtol=2**-7, atol=2**-7)


@pytest.mark.parametrize("where", ["picked", "not_picked"])
def test_graph_step_shows_a_nan_value_it_attends_and_no_other(where):
    """A NaN value in a block the row attends reaches its output; one in a block it does not attend reaches nothing
    (0 * NaN would, through a matmul over the unmasked slots)."""
    case = (1, 2, 1, 48, 8, 8, 2, "mean", 0, 0, None)
    plan = _plan(case)
    q, k, v, real, last, stats = _inputs(case, 48, "left_padded")
    own_block = 47 // 8
    ref = graph_decode_step(q, k, v, stats.clone(), real, last, plan)
    assert ref.isfinite().all()
    slot = own_block * 8
    if where == "not_picked":  # the first block neither head picks (2 picks of 5 candidates: one is left)
        slot = next(
            s for s in range(0, own_block * 8, 8) if _want(q, k, _nan_at(v, s), real, last, plan).isfinite().all()
        )
    v = _nan_at(v, slot)
    got = graph_decode_step(q, k, v, stats, real, last, plan)
    want = _want(q, k, v, real, last, plan)
    torch.testing.assert_close(got, want, equal_nan=True)
    assert got.isnan().any() == (where == "picked")


def _nan_at(v, slot):
    return v.index_fill(2, torch.tensor([slot]), float("nan"))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_graph_step_traces_whole_and_once_for_every_step(backend):
    """Traced with fullgraph (no break: nothing read on the host), then stepped over a growing cache: no step
    compiles again, and every step equals the eager call."""
    import torch._dynamo

    case = (2, 6, 2, 64, 8, 8, 3, "mean", 1, 1, None)
    plan = _plan(case)
    compiled = torch.compile(graph_decode_step, fullgraph=True, backend=backend, dynamic=False)
    torch._dynamo.reset()
    q, k, v, real, last, stats = _inputs(case, 20, "left_padded")
    eager_stats = stats.clone()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for written in range(20, 40):
            real[:, written - 1] = True
            last = torch.tensor(written - 1)
            q = torch.randn(q.shape, generator=torch.Generator().manual_seed(written))
            got = compiled(q, k, v, stats, real, last, plan)
            want = graph_decode_step(q, k, v, eager_stats, real, last, plan)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got, _want(q, k, v, real, last, plan), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stats, eager_stats)
