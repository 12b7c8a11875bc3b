"""moba_hf inside transformers: registration, tiny Llama / Qwen2 / Qwen3, hybrid layers, generate, save/load."""

import logging

import pytest
import tiny_models
import torch
from tiny_models import ARCHS
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

import moba_hf
from moba_hf import MobaConfig
from moba_hf.integration import state


def tiny_model(arch, **config):
    return tiny_models.tiny_model(arch, layers=3, **config)


@pytest.fixture(params=sorted(ARCHS))
def arch(request):
    return request.param


def test_registered_with_both_transformers_registries():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    assert "moba" in AttentionInterface._global_mapping
    assert "moba" in AttentionMaskInterface._global_mapping
    moba_hf.register()  # idempotent
    assert AttentionInterface._global_mapping["moba"] is moba_hf.integration.moba_attention_forward


def test_full_coverage_equals_sdpa_logits(arch):
    model = tiny_model(arch)
    ids = torch.randint(0, 97, (2, 45))
    want = model(ids).logits
    moba_hf.apply(model, MobaConfig(block_size=8, top_k=6))
    assert model.config._attn_implementation == "moba"
    torch.testing.assert_close(model(ids).logits, want, rtol=1e-9, atol=1e-9)


def test_sparse_setting_changes_logits_and_is_tracked(arch):
    model = tiny_model(arch)
    ids = torch.randint(0, 97, (1, 40))
    want = model(ids).logits
    moba_hf.apply(model, MobaConfig(block_size=4, top_k=2))
    with moba_hf.track_sparsity() as stats:
        got = model(ids).logits
    assert (got - want).abs().max() > 1e-3
    cfg = MobaConfig(block_size=4, top_k=2)
    for sparsity in stats.per_layer().values():
        assert sparsity == pytest.approx(cfg.theoretical_sparsity(40))


def test_hybrid_layers_run_dense_and_report_zero_sparsity():
    model = tiny_model("llama")
    ids = torch.randint(0, 97, (1, 40))
    for cfg, dense in [
        (MobaConfig(block_size=4, top_k=2, full_attn_layers=1), {2}),
        (MobaConfig(block_size=4, top_k=2, full_attn_layer_ids=[0, 2]), {0, 2}),
    ]:
        moba_hf.apply(model, cfg)
        with moba_hf.track_sparsity() as stats:
            model(ids)
        per_layer = stats.per_layer()
        assert {layer for layer, s in per_layer.items() if s == 0} == dense
        assert all(per_layer[layer] > 0.3 for layer in set(range(3)) - dense)
        assert {stats.backends[layer] for layer in dense} == {"sdpa"}


def test_hybrid_dense_layers_match_sdpa_layers():
    # all layers dense through full_attn_layers == every layer -> exactly the sdpa model
    model = tiny_model("qwen2")
    ids = torch.randint(0, 97, (2, 33))
    want = model(ids).logits
    moba_hf.apply(model, MobaConfig(block_size=4, top_k=1, full_attn_layers=3))
    torch.testing.assert_close(model(ids).logits, want)


def test_generate_with_cache_matches_sdpa_under_full_coverage(arch):
    model = tiny_model(arch)
    ids = torch.randint(0, 97, (1, 21))
    want = model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    moba_hf.apply(model, MobaConfig(block_size=4, top_k=100))
    got = model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert torch.equal(got, want)
    moba_hf.apply(model, MobaConfig(block_size=4, top_k=2))
    assert model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False).shape == want.shape


def test_config_roundtrips_through_save_pretrained(tmp_path, arch):
    model = tiny_model(arch)
    cfg = MobaConfig(block_size=8, top_k=2, full_attn_layers=1)
    moba_hf.apply(model, cfg)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="moba", dtype=torch.float64)
    assert loaded.config._attn_implementation == "moba"
    assert MobaConfig.from_dict(loaded.config.moba_config) == cfg
    ids = torch.randint(0, 97, (1, 30))
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
    again = moba_hf.from_pretrained(tmp_path, dtype=torch.float64)
    assert MobaConfig.from_dict(again.config.moba_config) == cfg
    override = moba_hf.from_pretrained(tmp_path, moba={"block_size": 16, "top_k": 1}, dtype=torch.float64)
    assert MobaConfig.from_dict(override.config.moba_config) == MobaConfig(block_size=16, top_k=1)


def test_checkpoint_without_config_uses_defaults_and_says_so(tmp_path, caplog):
    model = tiny_model("llama")
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="moba", dtype=torch.float64)
    with caplog.at_level(logging.WARNING, logger="moba_hf"):
        loaded(torch.randint(0, 97, (1, 10)))
        loaded(torch.randint(0, 97, (1, 10)))
    lines = [r.message for r in caplog.records if "no moba_config" in r.message]
    assert len(lines) == 1 and "block_size=512" in lines[0]


def test_revert_restores_previous_implementation():
    model = tiny_model("llama")
    ids = torch.randint(0, 97, (1, 30))
    want = model(ids).logits
    moba_hf.apply(model, MobaConfig(block_size=4, top_k=1))
    moba_hf.apply(model, MobaConfig(block_size=4, top_k=2))  # re-apply keeps the original to revert to
    moba_hf.revert(model)
    assert model.config._attn_implementation == "sdpa"
    assert getattr(model.config, "moba_config", None) is None
    torch.testing.assert_close(model(ids).logits, want)


def test_config_is_checked_once_per_change_not_per_layer_and_token(monkeypatch):
    """The support check (with the moba_config parse behind it) runs again only when moba_config is assigned anew;
    an edit in place is refused by name, so none goes unseen."""
    from moba_hf.integration import attention

    checks = []
    check = attention.check_supported
    monkeypatch.setattr(attention, "check_supported", lambda config: checks.append(config) or check(config))
    model = tiny_model("llama", moba=MobaConfig(block_size=4, top_k=2))
    model.generation_config.eos_token_id = None
    ids = torch.randint(0, 97, (1, 12))
    with torch.no_grad():
        model.generate(ids, max_new_tokens=6, do_sample=False)  # 6 forwards x 3 layers
    assert len(checks) == 1
    with pytest.raises(TypeError, match=r"moba_config is read-only: assign new settings"):
        model.config.moba_config["top_k"] = 1
    with pytest.raises(TypeError, match="read-only"):
        model.config.moba_config["full_attn_layer_ids"] = [0]
    assert model.config.moba_config["top_k"] == 2
    model.config.moba_config = {**model.config.moba_config, "top_k": 1}
    with torch.no_grad():
        model(ids)
    assert len(checks) == 2
    plans = {attention.resolved_config(m).plan for m in model.modules() if hasattr(m, "layer_idx")}
    assert [plan.blocks(12).top_k for plan in plans] == [1]
    model.config.use_bidirectional_attention = True  # the model's other fields are read with the settings
    model.config.moba_config = MobaConfig(block_size=4, top_k=2)
    with pytest.raises(ValueError, match="use_bidirectional_attention=True"):
        model(ids)
    with pytest.raises(ValueError, match="use_bidirectional_attention=True"):
        moba_hf.apply(model, MobaConfig(block_size=4, top_k=2))


def test_settings_stored_past_the_property_are_stored_anew_read_only():
    """A plain dict put into the config's __dict__ (a config made before moba_hf was imported) is resolved once and
    stored back read-only, so a later edit is refused instead of going unseen."""
    model = tiny_model("llama", moba=MobaConfig(block_size=4, top_k=2))
    vars(model.config)["moba_config"] = {"block_size": 4, "top_k": 1}
    model(torch.randint(0, 97, (1, 12)))
    assert model.config.moba_config["top_k"] == 1
    with pytest.raises(TypeError, match="read-only"):
        model.config.moba_config["top_k"] = 3


def test_stored_settings_save_copy_and_pickle_as_their_values(tmp_path):
    """Pickled, the settings stay read-only; deep-copied (transformers edits its copies when saving) they are
    plain, and a copied config stores them read-only again on its first forward."""
    import copy
    import json
    import pickle

    model = tiny_model("llama", moba=MobaConfig(block_size=4, top_k=2, full_attn_layer_ids=[0]))
    settings = model.config.moba_config
    unpickled = pickle.loads(pickle.dumps(settings))
    assert unpickled == settings and type(unpickled) is type(settings)
    with pytest.raises(TypeError, match="read-only"):
        unpickled["full_attn_layer_ids"].append(1)
    copied = copy.deepcopy(model)
    assert type(copied.config.moba_config) is dict and copied.config.moba_config == settings
    copied(torch.randint(0, 97, (1, 12)))
    with pytest.raises(TypeError, match="read-only"):
        copied.config.moba_config["top_k"] = 3
    model.save_pretrained(tmp_path)
    want = MobaConfig(block_size=4, top_k=2, full_attn_layer_ids=[0]).to_dict()
    assert json.loads((tmp_path / "config.json").read_text())["moba_config"] == want


def test_apply_installs_and_revert_removes_what_moba_adds():
    """apply hooks every attention module for the KV cache; revert removes the hooks and DCA's cached frequencies."""
    model = tiny_model("llama")
    attentions = [m for m in model.modules() if type(m).__name__ == "LlamaAttention"]
    moba_hf.apply(model, MobaConfig(block_size=4, top_k=2, dca=moba_hf.DcaConfig(pretraining_length=16)))
    # one pre-hook (a graph break under torch.compile), and what it stashes is taken by the attention call
    assert all(len(m._forward_pre_hooks) == 1 and not m._forward_hooks for m in attentions)
    model(torch.randint(0, 97, (1, 40)), use_cache=True)
    kept = [state.layer_if_any(m) for m in attentions]
    assert all(s is not None and s.inv_freq is not None and s.resolved is not None for s in kept)
    assert all(s.call is None for s in kept)  # a later `module.forward(...)`, past the hook, finds no stale call
    assert not any(k.startswith("_moba") for m in attentions for k in vars(m))  # nothing set on the modules
    moba_hf.revert(model)
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in attentions)
    assert not any(state.layer_if_any(m) for m in model.modules())
    assert not any(k.startswith("_moba") for m in model.modules() for k in vars(m))


def test_a_model_and_its_cache_pickle_and_copy_after_moba_ran(tmp_path):
    """Nothing moba_hf keeps is set on the model or the cache: torch.save of both works after a cached decode, the
    reloaded model decodes as the original, and a deep copy does not add its hooks twice."""
    import copy

    from transformers import DynamicCache

    model = tiny_model("llama", dca=None)
    moba_hf.apply(model, MobaConfig(block_size=4, top_k=2))
    ids = torch.randint(0, 97, (1, 21))
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(ids[:, :20], past_key_values=cache, use_cache=True)
        want = model(ids[:, 20:], past_key_values=cache, use_cache=True).logits
        torch.save({"model": model, "cache": cache}, tmp_path / "all.pt")
        loaded = torch.load(tmp_path / "all.pt", weights_only=False)["model"]
        torch.testing.assert_close(loaded(ids).logits[:, -1:], want, rtol=1e-9, atol=1e-9)
    twin = copy.deepcopy(model)
    twin(ids)
    assert all(len(m._forward_pre_hooks) == 1 for m in twin.modules() if type(m).__name__ == "LlamaAttention")


def test_unsupported_model_is_refused():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match="cannot run model_type='gpt2': .*no RoPE.*verified by tests: .*llama"):
        moba_hf.apply(gpt2, MobaConfig())


def test_sliding_window_qwen2_is_refused():
    model = tiny_model("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1)
    with pytest.raises(ValueError, match="sliding_attention"):
        moba_hf.apply(model, MobaConfig())


def test_bad_layer_ids_refused_at_apply():
    with pytest.raises(ValueError, match="full_attn_layer_ids contains 7"):
        moba_hf.apply(tiny_model("llama"), MobaConfig(full_attn_layer_ids=[7]))


def test_static_cache_generates_as_the_default_cache():
    """cache_implementation="static" runs (tests/test_static_cache.py covers it in depth)."""
    model = tiny_model("llama")
    moba_hf.apply(model, MobaConfig(block_size=4, top_k=2))
    ids = torch.randint(0, 97, (1, 8))
    kwargs = dict(max_new_tokens=10, do_sample=False, min_new_tokens=10)
    assert torch.equal(model.generate(ids, cache_implementation="static", **kwargs), model.generate(ids, **kwargs))


RULE_CASES = [
    # B, Hq, Hkv, Nq, Nk, block, top_k, sink, local
    (2, 4, 2, 63, 63, 8, 3, 0, 0),
    (1, 3, 1, 40, 111, 16, 2, 1, 1),  # Nq < Nk
    (1, 2, 2, 1, 90, 8, 4, 2, 3),  # decode, sink and local overlap early on
    (1, 2, 1, 70, 70, 4, 30, 1, 0),  # top_k covers everything
    (2, 2, 1, 33, 33, 8, 1, 0, 2),  # top_k = 1 with local blocks
    (1, 2, 1, 50, 50, 4, 3, 2, 2),  # early queries: the sink and local blocks overlap
]


@pytest.mark.parametrize("case", RULE_CASES, ids=lambda c: "B{}-HQ{}-H{}-Q{}-K{}-blk{}-k{}-s{}-l{}".format(*c))
def test_rule_pair_count_equals_count_of_the_real_selection(case):
    from moba_hf.integration import sparsity
    from moba_hf.kernels import BlockPlan, selected_blocks

    b, hq, hkv, nq, nk, block, top_k, sink, local = case
    q, k = torch.randn(b, hq, nq, 8), torch.randn(b, hkv, nk, 8)
    plan = BlockPlan.build(block, top_k, sink_blocks=sink, local_blocks=local)
    selected = selected_blocks(q, k, block_size=block, top_k=top_k, gate=plan.gate)
    want = sparsity.attended_pairs(selected, nk, block)
    assert b * hq * plan.attended_pairs(nq, nk) == want
