"""The attention plan: built once per config, validated once when built, the same answer as the keyword API, and the
one pair count behind sparsity tracking and `MobaConfig.theoretical_sparsity`."""

from __future__ import annotations

import math

import pytest
import torch

from moba_hf import MobaConfig
from moba_hf.kernels import BlockPlan, attend_plan, moba_attention
from moba_hf.kernels.decode import block_keys_from_cache, decode_plan, moba_decode


def test_a_config_builds_its_plans_once():
    config = MobaConfig(block_size=8, top_k=3, decode_top_k=5, dense_tail=4, sink_blocks=1, pooling="max")
    prompt, step = config.plan(40), config.plan(1)
    assert config.plan(40) is prompt and config.plan(2) is prompt and config.plan(1) is step
    assert prompt == BlockPlan.build(8, 3, "max", sink_blocks=1, dense_tail=4)
    assert step == BlockPlan.build(8, 5, "max", sink_blocks=1)  # a decode step: decode_top_k, no dense tail
    assert MobaConfig(block_size=8, top_k=3).plan(1) == BlockPlan(8, 3)  # decode_top_k None: top_k


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"block_size": 0}, "block_size must be an integer >= 1, got 0"),
        ({"top_k": 0}, "top_k must be an integer >= 1, got 0"),
        ({"top_k": 2.0}, "top_k must be an integer >= 1, got 2.0"),
        ({"dense_tail": -1}, "dense_tail must be an integer >= 0, got -1"),
        ({"sink_blocks": -1}, "sink_blocks must be an integer >= 0, got -1"),
        ({"local_blocks": True}, "local_blocks must be an integer >= 0, got True"),
        ({"pooling": "median"}, "pooling must be one of"),
        ({"top_p": 0.0}, r"top_p must be None \(a fixed top_k budget\) or a number in \(0, 1\], got 0.0"),
        ({"min_top_k": 2}, "min_top_k applies only with top_p"),
        ({"top_p": 0.5, "min_top_k": 3}, r"min_top_k must be between 1 and top_k \(2\), got 3"),
    ],
)
def test_the_plan_refuses_bad_values_before_any_work(fields, message):
    kw = {"block_size": 4, "top_k": 2, **fields}
    with pytest.raises(ValueError, match=message):
        BlockPlan.build(**kw)
    # the public entries build the plan first: the tensors are not even looked at
    with pytest.raises(ValueError, match=message):
        moba_attention("not a tensor", None, None, **kw)
    if "dense_tail" not in fields:
        with pytest.raises(ValueError, match=message):
            moba_decode("not a tensor", None, None, None, **kw)


def test_a_plan_takes_a_gate_and_backends_refuse_a_tail():
    with pytest.raises(ValueError, match="gate must be a GateOptions, got dict"):
        BlockPlan(4, 2, {"pooling": "max"})
    q = torch.randn(1, 2, 9, 8)
    with pytest.raises(ValueError, match="plan must be a BlockPlan, got dict"):
        attend_plan(q, q, q, {"block_size": 4})
    from moba_hf.kernels.reference import moba_attention_reference

    with pytest.raises(ValueError, match="a backend runs a plan without a dense tail, got dense_tail=3"):
        moba_attention_reference(q, q, q, BlockPlan(4, 2, dense_tail=3))


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize(
    "options",
    [{}, {"pooling": "bound", "sink_blocks": 1, "local_blocks": 1, "dense_tail": 5}, {"top_p": 0.7, "min_top_k": 2}],
)
def test_attend_plan_equals_the_keyword_call(backend, options):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 30, 8, dtype=torch.float64, generator=gen)
    k, v = (torch.randn(2, 2, 45, 8, dtype=torch.float64, generator=gen) for _ in range(2))
    want = moba_attention(q, k, v, block_size=8, top_k=3, scale=0.4, backend=backend, **options)
    plan = BlockPlan.build(8, 3, **options)
    assert torch.equal(attend_plan(q, k, v, plan, 0.4, backend=backend), want)


def test_decode_plan_equals_the_keyword_call():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 1, 8, generator=gen)
    k, v = (torch.randn(2, 2, 50, 8, generator=gen) for _ in range(2))
    keys = block_keys_from_cache(k, 8, "max")
    want = moba_decode(q, k, v, keys, block_size=8, top_k=3, pooling="max", local_blocks=1)
    got = decode_plan(q, k, v, keys, BlockPlan.build(8, 3, "max", local_blocks=1))
    assert torch.equal(got, want)


def _theoretical_sparsity_before(config: MobaConfig, seq_len: int) -> float:
    """`MobaConfig.theoretical_sparsity` as it was written before the plan counted it (the oracle)."""
    if not config.sparse:
        return 0.0
    bs = config.block_size
    causal_pairs = seq_len * (seq_len + 1) // 2
    extra = config.top_k - 1 + config.sink_blocks + config.local_blocks
    tail = config.tail_queries(seq_len)
    head = seq_len - tail
    attended = 0
    for c in range(math.ceil(head / bs)):
        n = min(bs, head - c * bs)
        attended += n * (n + 1) // 2 + n * min(c, extra) * bs
    attended += causal_pairs - head * (head + 1) // 2
    return 1.0 - attended / causal_pairs


def _rule_pairs_before(heads, q_length, kv_length, *, block_size, top_k, sink_blocks=0, local_blocks=0, dense_tail=0):
    """`integration.sparsity.rule_pairs` as it was written before the plan counted it (the oracle)."""
    p = torch.arange(kv_length - q_length, kv_length)
    current = p // block_size
    sink = current.clamp(max=sink_blocks)
    local = current.clamp(max=local_blocks)
    overlap = (sink - (current - local_blocks).clamp(min=0)).clamp(min=0)
    forced = sink + local - overlap
    picks = (current - forced).clamp(min=0, max=max(top_k - 1, 0))
    attended = p - current * block_size + 1 + block_size * (forced + picks)
    tail = min(dense_tail, q_length)
    if tail:
        attended[q_length - tail :] = p[q_length - tail :] + 1
    return heads * int(attended.sum())


RULES = [
    dict(block_size=8, top_k=3),
    dict(block_size=8, top_k=1),
    dict(block_size=5, top_k=2, sink_blocks=1, local_blocks=2),
    dict(block_size=7, top_k=4, sink_blocks=3, dense_tail=10),
    dict(block_size=16, top_k=2, local_blocks=1, dense_tail=100),
    dict(block_size=1, top_k=3, sink_blocks=2, local_blocks=2, dense_tail=3),
]


@pytest.mark.parametrize("rule", RULES, ids=lambda r: "-".join(f"{k}={v}" for k, v in r.items()))
def test_theoretical_sparsity_and_the_pair_count_are_unchanged(rule):
    config = MobaConfig(**rule)
    plan = BlockPlan.build(**rule)
    for n in (1, 2, 7, 8, 9, 40, 61, 130):
        assert config.theoretical_sparsity(n) == _theoretical_sparsity_before(config, n)
        for nq in {q for q in (1, 2, n // 2, n) if 1 <= q <= n}:
            assert plan.attended_pairs(nq, n) == _rule_pairs_before(1, nq, n, **rule)
    assert MobaConfig(sparse=False, **rule).theoretical_sparsity(40) == 0.0
