"""The attention plan: built once per config, validated once when built, the same answer as the keyword API, and the
one pair count behind sparsity tracking and `MobaConfig.theoretical_sparsity`."""

from __future__ import annotations

import ast
import math
import types
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_model

import moba_hf
from moba_hf import MobaConfig, core
from moba_hf.dca.config import DcaParams
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


# --- the attention plan every host reads (`core.AttentionPlan`) ---------------------------------------------------
def test_plan_for_resolves_once_per_config():
    config = MobaConfig(block_size=8, top_k=3, decode_top_k=5, dense_tail=4, full_attn_layers=1, backend="torch")
    plan = core.plan_for(config, 4)
    assert core.plan_for(config, 4) is plan
    assert core.plan_for(MobaConfig(**config.to_dict()), 4) is plan  # an equal config, read again from its fields
    assert plan.blocks(40) is config.plan(40) and plan.blocks(1) is config.plan(1)  # the config's own BlockPlans
    assert (plan.block_size, plan.pooling, plan.decode, plan.sparse, plan.backend) == (8, "mean", "moba", True, "torch")
    assert plan.full_layers == frozenset({3}) and plan.dca is None
    assert core.plan_for(config, 5).full_layers == frozenset({4})  # another model: another plan
    dca = DcaParams(pretraining_length=96, chunk_size=64)
    assert core.plan_for(config, 4, dca).dca is dca
    asked = []
    resolver = lambda setting, block_size: asked.append((setting, block_size)) or dca  # noqa: E731
    assert core.plan_for(MobaConfig(block_size=8, dca=True), 4, resolver).dca is dca
    assert core.plan_for(MobaConfig(block_size=8, sparse=False), 4, resolver).dca is dca
    assert asked == [(True, 8), (None, None)]  # the host's resolution gets MoBA's block size only when sparse


def test_a_resolved_model_config_keeps_its_plan():
    """The transformers host resolves the plan once per config change: a change that leaves the MobaConfig as it
    was (here an unrelated attribute) checks again and gets the very same plan object."""
    from moba_hf.integration import attention

    model = tiny_model("llama", MobaConfig(block_size=4, top_k=2, full_attn_layers=1), layers=2)
    layer = next(m for m in model.modules() if hasattr(m, "layer_idx"))
    plan = attention.resolved_config(layer).plan
    assert attention.resolved_config(layer).plan is plan and plan.full_layers == frozenset({1})
    model.config.some_unrelated_setting = 1
    resolved = attention.resolved_config(layer)
    assert resolved.holds_for(model.config) and resolved.plan is plan
    model.config.moba_config = {**model.config.moba_config, "top_k": 3}
    assert attention.resolved_config(layer).plan.blocks(8).top_k == 3


@pytest.mark.parametrize(
    "fields, layer, dense_layer, sparse_decode, dense_step",
    [
        ({}, 0, False, True, False),
        ({"full_attn_layers": 1}, 3, True, False, False),
        ({"full_attn_layer_ids": (0, -1)}, 0, True, False, False),
        ({"full_attn_layers": 1}, None, False, True, False),  # a module without a layer index is never a full one
        ({"sparse": False}, 0, True, False, False),
        ({"decode": "full"}, 0, False, False, True),
    ],
)
def test_the_plan_answers_the_hosts_questions(fields, layer, dense_layer, sparse_decode, dense_step):
    plan = core.plan_for(MobaConfig(block_size=8, **fields), 4)
    assert plan.dense_layer(layer) == dense_layer
    assert plan.sparse_decode(layer) == sparse_decode
    assert plan.dense_decode(1) == dense_step and not plan.dense_decode(2)
    assert core.runs_dense(plan, 1, plan.dense_layer(layer)) == (dense_layer or dense_step)
    with_dca = core.plan_for(MobaConfig(block_size=8, **fields), 4, DcaParams(pretraining_length=96, chunk_size=64))
    assert not with_dca.sparse_decode(layer)  # DCA's decode steps attend per sequence


def test_plan_for_names_bad_layer_ids():
    with pytest.raises(ValueError, match=r"full_attn_layer_ids contains 4, outside the model's layers \[-4, 3\]"):
        core.plan_for(MobaConfig(full_attn_layer_ids=[4]), 4)
    from moba_hf.serving import MobaSetupError, attention_plan

    with pytest.raises(MobaSetupError, match="bad MoBA config from the test: full_attn_layers=5 exceeds"):
        attention_plan(MobaConfig(full_attn_layers=5), types.SimpleNamespace(num_hidden_layers=4), "the test", None)


# attributes of a MobaConfig that decide which keys each query sees: read only by `core.plan_for` on the attention
# path (and by the code that builds configs from user input, and the servers' startup checks)
MATH_ATTRIBUTES = frozenset(
    {
        "block_size", "top_k", "decode_top_k", "pooling", "sink_blocks", "local_blocks", "top_p", "min_top_k",
        "dense_tail", "decode", "sparse", "full_attn_layers", "full_attn_layer_ids", "dca", "backend",
        "plan", "tail_queries", "full_layer_set",
    }
)  # fmt: skip
CONFIG_NAMES = frozenset({"config", "moba", "moba_config"})  # what the hosts call a MobaConfig they hold
HOSTS = ("integration", "vllm", "sglang")
STARTUP = ("vllm/startup.py", "sglang/startup.py")  # validate and describe the serving options


def config_reads(source: str) -> list[tuple[int, str]]:
    """(line, `name.attribute`) for every read of a MoBA math attribute on a name (or `self.name`) called like a
    MobaConfig, or annotated as one."""
    tree = ast.parse(source)
    typed = {
        arg.arg
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        for arg in (*node.args.args, *node.args.kwonlyargs, *node.args.posonlyargs)
        if arg.annotation is not None and "MobaConfig" in ast.unparse(arg.annotation)
    }
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or node.attr not in MATH_ATTRIBUTES:
            continue
        owner = node.value
        name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else None
        if name in CONFIG_NAMES or name in typed:
            found.append((node.lineno, f"{name}.{node.attr}"))
    return found


def test_hosts_read_the_plan_not_the_config():
    package = Path(moba_hf.__file__).parent
    reads = []
    for host in HOSTS:
        for path in sorted((package / host).rglob("*.py")):
            relative = path.relative_to(package).as_posix()
            if relative not in STARTUP:
                reads += [f"{relative}:{line} {read}" for line, read in config_reads(path.read_text())]
    assert reads == []


def test_the_config_read_check_sees_what_it_looks_for():
    source = """
def a(config, scale):
    return config.block_size + scale.top_k
def b(cfg: MobaConfig):
    return cfg.plan(1)
class C:
    def d(self):
        return self.moba.decode == "moba" and self.plan.decode == "moba" and model.config.num_hidden_layers
"""
    assert config_reads(source) == [(3, "config.block_size"), (5, "cfg.plan"), (8, "moba.decode")]
