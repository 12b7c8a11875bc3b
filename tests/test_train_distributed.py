"""DDP through the Trainer, no custom communication: 2 CPU processes (torchrun, gloo) x batch 1 give the
losses and weights of 1 process x batch 2 on the same rows."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from moba_hf.train.cli import load_config
from moba_hf.train.trainer import train

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.slow  # two fresh processes import torch + transformers
def test_two_process_ddp_matches_one_process(tmp_path):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path / "model")
    g = torch.Generator().manual_seed(0)
    with open(tmp_path / "data.jsonl", "w") as f:
        for i in range(24):
            n = int(torch.randint(20, 70, (1,), generator=g))
            f.write(json.dumps({"input_ids": ((torch.arange(n) * (i % 5 + 1)) % 128).tolist()}) + "\n")
    (tmp_path / "run.toml").write_text(
        f'[model]\nname = "{tmp_path / "model"}"\n[moba]\nblock_size = 8\ntop_k = 2\n'
        f'[data]\nsource = "{tmp_path / "data.jsonl"}"\nseq_len = 64\n'
        "[train]\nmax_steps = 3\nbatch_size = 1\nlearning_rate = 3e-3\nshuffle = false\nsparsity_every = 0\n"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "moba_hf.cli", "train"]
    cmd += [str(tmp_path / "run.toml"), "--output-dir", str(tmp_path / "ddp")]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]

    single = train(
        load_config(
            str(tmp_path / "run.toml"), ["train.batch_size=2"], {("train", "output_dir"): str(tmp_path / "one")}
        )
    )
    ddp_losses = json.loads((tmp_path / "ddp" / "train_summary.json").read_text())["losses"]
    assert len(ddp_losses) == 3
    torch.testing.assert_close(torch.tensor(ddp_losses), torch.tensor(single.losses), rtol=1e-5, atol=1e-5)
    ddp_weights = load_file(tmp_path / "ddp" / "model.safetensors")
    one_weights = load_file(tmp_path / "one" / "model.safetensors")
    assert ddp_weights.keys() == one_weights.keys()
    for name, w in one_weights.items():
        # Adam normalises the (differently summed) gradients: allow 1e-5, a few % of one 3e-3 step
        torch.testing.assert_close(ddp_weights[name], w, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    start = load_file(tmp_path / "model" / "model.safetensors")
    assert not torch.equal(
        start["model.layers.0.self_attn.q_proj.weight"], w := one_weights["model.layers.0.self_attn.q_proj.weight"]
    ), w
