"""`revert` returns a model to exactly what it had before its first `apply`, for every way a model gets MoBA:
the attention implementation, the moba_config (present or absent, its value), and so the same logits, the same
per-layer sparsity and the same cached decoding."""

import copy

import pytest
import torch
from tiny_models import tiny_model
from transformers import AutoModelForCausalLM

import moba_hf
from moba_hf import MobaConfig
from moba_hf.integration import state

# 48 tokens in blocks of 4: 12 blocks, so top_k 1 and 3 select differently; the last of 3 layers dense
LOADED = MobaConfig(block_size=4, top_k=1, full_attn_layers=1)
OTHER = LOADED.replace(top_k=3, full_attn_layers=0)
IDS = torch.randint(0, 97, (1, 48), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_llama")
    tiny_model(layers=3).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def moba_checkpoint(tmp_path_factory, checkpoint):
    """The same weights saved with LOADED as the config's moba_config."""
    path = tmp_path_factory.mktemp("tiny_llama_moba")
    moba_hf.from_pretrained(checkpoint, moba=LOADED, dtype=torch.float64).save_pretrained(path)
    return path


def _state(model) -> dict:
    """What revert must give back: config fields, logits, per-layer sparsity, a cached greedy continuation."""
    config = model.config
    with torch.no_grad(), moba_hf.track_sparsity() as stats:
        logits = model(IDS).logits
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        generated = model.generate(IDS[:, :40], max_new_tokens=6, do_sample=False)
    return {
        "attn": config._attn_implementation,
        "has_moba_config": "moba_config" in vars(config),
        "moba_config": copy.deepcopy(config.moba_config),
        "logits": logits,
        "sparsity": stats.per_layer(),
        "generated": generated,
    }


def _assert_same(got: dict, want: dict) -> None:
    for key in ("attn", "has_moba_config", "moba_config", "sparsity"):
        assert got[key] == want[key], (key, got[key], want[key])
    torch.testing.assert_close(got["logits"], want["logits"], rtol=0, atol=1e-12)  # the same float64 computation
    assert torch.equal(got["generated"], want["generated"])


def _apply_other_then_revert(model, want: dict) -> None:
    moba_hf.apply(model, OTHER)
    changed = _state(model)
    assert changed["moba_config"] == OTHER.to_dict() and changed["attn"] == "moba"
    assert (changed["logits"] - want["logits"]).abs().max() > 1e-3  # the switch really changed the attention
    moba_hf.apply(model, OTHER.replace(top_k=2))  # a second apply must not move what revert returns to
    assert moba_hf.revert(model) is model
    _assert_same(_state(model), want)
    moba_hf.revert(model)  # nothing left to revert: unchanged
    _assert_same(_state(model), want)


def test_our_loader_reverts_to_the_moba_it_loaded_with(checkpoint):
    model = moba_hf.from_pretrained(checkpoint, moba=LOADED, dtype=torch.float64)
    want = _state(model)
    assert want["attn"] == "moba" and want["moba_config"] == LOADED.to_dict()
    assert want["sparsity"][2] == 0 and want["sparsity"][0] > 0  # full_attn_layers=1: the last layer dense
    _apply_other_then_revert(model, want)


def test_apply_on_a_dense_model_reverts_to_sdpa_without_moba_config(checkpoint):
    model = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="sdpa", dtype=torch.float64)
    want = _state(model)
    assert want["attn"] == "sdpa" and not want["has_moba_config"] and want["sparsity"] == {}
    _apply_other_then_revert(model, want)


@pytest.mark.parametrize("spec", [LOADED.to_dict(), "paper-8k"], ids=["mapping", "preset-name"])
def test_transformers_loader_reverts_to_its_moba_config(checkpoint, spec):
    model = AutoModelForCausalLM.from_pretrained(
        checkpoint, attn_implementation="moba", moba_config=spec, dtype=torch.float64
    )
    want = _state(model)
    assert want["attn"] == "moba" and want["has_moba_config"]
    _apply_other_then_revert(model, want)


@pytest.mark.parametrize("attn", ["sdpa", "moba"])
def test_checkpoint_with_moba_config_reverts_to_what_it_loaded_with(moba_checkpoint, attn):
    model = AutoModelForCausalLM.from_pretrained(moba_checkpoint, attn_implementation=attn, dtype=torch.float64)
    want = _state(model)
    assert want["attn"] == attn and want["moba_config"] == LOADED.to_dict()
    _apply_other_then_revert(model, want)


def test_revert_without_apply_changes_nothing(checkpoint):
    dense = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="sdpa", dtype=torch.float64)
    want = _state(dense)
    _assert_same(_state(moba_hf.revert(dense)), want)
    loaded = moba_hf.from_pretrained(checkpoint, moba=LOADED, dtype=torch.float64)
    want = _state(loaded)
    _assert_same(_state(moba_hf.revert(loaded)), want)  # it loaded with MoBA: there is no "before" to go back to


def test_a_refused_apply_records_nothing(checkpoint):
    model = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="sdpa", dtype=torch.float64)
    want = _state(model)
    with pytest.raises(ValueError, match="full_attn_layer_ids"):
        moba_hf.apply(model, MobaConfig(block_size=4, top_k=1, full_attn_layer_ids=(7,)))
    assert not state.has_before_apply(model)
    _assert_same(_state(model), want)


def test_apply_sets_nothing_on_the_model_and_a_copy_has_no_record(checkpoint):
    """What revert restores is kept beside the model: apply adds no attribute to it, revert restores from the
    table, and a deep copy of an applied model (which has no record) is returned unchanged."""
    import copy

    model = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="sdpa", dtype=torch.float64)
    want = _state(model)
    names = set(vars(model))
    moba_hf.apply(model, LOADED)
    assert set(vars(model)) == names and state.has_before_apply(model)
    twin = copy.deepcopy(model)
    assert not state.has_before_apply(twin)
    assert _state(moba_hf.revert(twin))["attn"] == "moba"
    _assert_same(_state(moba_hf.revert(model)), want)
    assert not state.has_before_apply(model)
