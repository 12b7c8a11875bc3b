"""The one-line load: `moba_config=` through transformers' own from_pretrained, presets by name, refusals and the
log lines that say what attention a checkpoint really runs."""

import json
import logging

import pytest
import torch
from tiny_models import tiny_model
from transformers import AutoModelForCausalLM

import moba_hf
from moba_hf import MobaConfig


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_llama")
    model = tiny_model(dtype=torch.float32, hidden_size=64, intermediate_size=128, max_position_embeddings=512)
    model.save_pretrained(path)
    return path


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_moba_config_keyword_reaches_the_model(checkpoint, tmp_path, one_thread):
    ids = torch.randint(0, 97, (1, 40))
    dense = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="sdpa")
    every_block = AutoModelForCausalLM.from_pretrained(
        checkpoint, attn_implementation="moba", moba_config={"block_size": 8, "top_k": 100}
    )
    torch.testing.assert_close(_logits(every_block, ids), _logits(dense, ids), atol=1e-5, rtol=1e-5)

    sparse = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="moba", moba_config="paper-8k")
    sparse.config.moba_config = {"block_size": 8, "top_k": 1}  # own block only: must differ from dense
    assert (_logits(sparse, ids) - _logits(dense, ids)).abs().max() > 1e-3

    by_name = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="moba", moba_config="paper-8k")
    _logits(by_name, ids)  # the first forward resolves the preset name into its settings
    assert by_name.config.moba_config == MobaConfig.preset("paper-8k").to_dict()
    by_name.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["moba_config"]["block_size"] == 512


def test_our_loader_takes_presets_and_refuses_contradictions(checkpoint):
    model = moba_hf.from_pretrained(checkpoint, moba="paper-8k")
    assert MobaConfig.from_dict(model.config.moba_config) == MobaConfig.preset("paper-8k")
    with pytest.raises(ValueError, match="asks for MoBA but attn_implementation='sdpa'"):
        moba_hf.from_pretrained(checkpoint, moba="paper-8k", attn_implementation="sdpa")
    with pytest.raises(ValueError, match="not both"):
        moba_hf.from_pretrained(checkpoint, moba="paper-8k", moba_config="paper-1m")
    with pytest.raises(ValueError, match="neither a preset"):
        moba_hf.from_pretrained(checkpoint, moba="no-such-preset")


def test_logs_say_what_attention_runs(checkpoint, tmp_path, caplog, one_thread):
    ids = torch.randint(0, 97, (1, 12))
    with caplog.at_level(logging.WARNING, logger="moba_hf"):
        _logits(AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="moba"), ids)
    assert "no moba_config" in caplog.text and "moba_config='training-free'" in caplog.text

    moba_hf.from_pretrained(checkpoint, moba="paper-8k").save_pretrained(tmp_path)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="moba_hf"):
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert reloaded.config._attn_implementation != "moba"
    assert "carries a moba_config but loads with attn_implementation='sdpa'" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="moba_hf"):
        AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="moba")
    assert "carries a moba_config" not in caplog.text


def test_revert_restores_a_model_without_moba_config(checkpoint):
    model = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="sdpa")
    moba_hf.apply(model, "paper-8k")
    moba_hf.revert(model)
    assert "moba_config" not in vars(model.config) and model.config.moba_config is None
    assert model.config._attn_implementation == "sdpa"
