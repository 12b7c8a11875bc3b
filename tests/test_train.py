"""Training with MoBA on tiny models: loss goes down, the 90/10 switch lands on its step, sparsity is logged,
checkpoints reload with their MoBA setting, every kernel backend trains like the reference, LoRA works."""

import json

import pytest
import torch
from conftest import train_model
from transformers import AutoModelForCausalLM, TrainerCallback

import moba_hf
from moba_hf.kernels import BACKENDS, backend_available
from moba_hf.train import Document, PackedDataset, TrainConfig, pack, train
from moba_hf.train.cli import load_config, parse_override

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_dataset(seq_len=64, n_docs=40):
    """Learnable documents (arithmetic progressions), packed; lengths vary so blocks straddle documents."""
    g = torch.Generator().manual_seed(0)
    docs = []
    for i in range(n_docs):
        n = int(torch.randint(20, 70, (1,), generator=g))
        start = int(torch.randint(0, 128, (1,), generator=g))
        ids = ((start + torch.arange(n) * (i % 5 + 1)) % 128).tolist()
        docs.append(Document(ids, ids))
    return PackedDataset(pack(docs, seq_len))


def tiny_config(tmp_path, **sections):
    data = {
        "moba": {"block_size": 8, "top_k": 2, "backend": "reference"},  # backends are compared in their own test
        "train": {
            "max_steps": 10,
            "batch_size": 2,
            "learning_rate": 3e-3,
            "output_dir": str(tmp_path / "out"),
            "sparsity_every": 0,
            "save": False,
        },
    }
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return TrainConfig.from_dict(data)


class WhatRan(TrainerCallback):
    """Probe: per optimizer step, did a MoBA forward run (it records sparsity) or not."""

    def __init__(self):
        self.ran = {}

    def on_step_begin(self, args, state, control, **kwargs):
        self._stack = moba_hf.track_sparsity()
        self._stats = self._stack.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        self._stack.__exit__(None, None, None)
        self.ran[state.global_step - 1] = "moba" if self._stats.layers else "full"


def test_loss_decreases(tmp_path):
    result = train(tiny_config(tmp_path, train={"max_steps": 20}), model=train_model(), dataset=tiny_dataset())
    assert len(result.losses) == 20
    assert sum(result.losses[-3:]) / 3 < 0.8 * sum(result.losses[:3]) / 3


def test_switch_to_full_attention_at_the_configured_step(tmp_path):
    probe = WhatRan()
    config = tiny_config(tmp_path, schedule={"moba_fraction": 0.9}, train={"sparsity_every": 4})
    assert config.switch_step == 9
    result = train(config, model=train_model(), dataset=tiny_dataset(), callbacks=[probe])
    expected = {step: "moba" if step < 9 else "full" for step in range(10)}
    assert result.modes == expected
    assert probe.ran == expected  # what really executed, not just what the schedule said
    assert [r["step"] for r in result.sparsity] == [0, 4, 8]
    assert all(0.0 < s < 1.0 for r in result.sparsity for s in r["per_layer"].values())
    logged = [json.loads(line) for line in (tmp_path / "out" / "sparsity.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [0, 4, 8]


def test_last_layers_full_is_logged_dense(tmp_path):
    config = tiny_config(tmp_path, moba={"full_attn_layers": 1}, train={"max_steps": 2, "sparsity_every": 1})
    result = train(config, model=train_model(), dataset=tiny_dataset())
    per_layer = result.sparsity[0]["per_layer"]
    assert per_layer[1] == 0.0 and per_layer[0] > 0.0


def test_checkpoint_round_trip(tmp_path):
    config = tiny_config(
        tmp_path, moba={"full_attn_layers": 1}, schedule={"moba_fraction": 0.5}, train={"max_steps": 4, "save": True}
    )
    model = train_model()
    result = train(config, model=model, dataset=tiny_dataset())
    saved = json.loads((result.output_dir / "config.json").read_text())
    assert saved["moba_config"] == config.moba.to_dict()
    reloaded = AutoModelForCausalLM.from_pretrained(result.output_dir, attn_implementation="moba").eval()
    assert reloaded.config.moba_config == config.moba.to_dict()
    moba_hf.apply(model, config.moba)  # the run ended in full attention; compare both in MoBA mode
    ids = torch.randint(0, 128, (1, 40))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model.eval()(ids).logits, rtol=0, atol=0)  # same weights


BACKEND_NAMES = [b for b in BACKENDS if b not in ("auto", "reference")]


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_every_backend_trains_like_the_reference(tmp_path, backend):
    """Liger-style convergence check: 4 steps with `backend` vs the reference, same losses and parameters.
    Plain SGD, so parameter differences are gradient differences (Adam would magnify float noise in
    near-zero gradients). The backends order the same sums differently; each reduction has at most
    N = 2 rows x 64 tokens terms, so losses get rtol N * eps, and parameters, moved by lr x a gradient clipped
    to norm 1 per step, atol steps * lr * N * eps (measured: 2e-7 and 1.2e-7, ~100x inside)."""
    if not backend_available(backend):
        pytest.skip(f"backend {backend!r} not available here")
    runs = {}
    for name in ("reference", backend):
        # odd block size and top_k so partial blocks and real selection are exercised
        config = tiny_config(
            tmp_path / name,
            moba={"backend": name, "block_size": 7, "top_k": 3},
            train={"max_steps": 4, "optim": "sgd", "learning_rate": 0.5},
        )
        model = train_model()
        runs[name] = (train(config, model=model, dataset=tiny_dataset()).losses, model)
    (ref_losses, ref_model), (losses, model) = runs["reference"], runs[backend]
    n, eps = 2 * 64, torch.finfo(torch.float32).eps
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=n * eps, atol=0)
    atol = 4 * 0.5 * n * eps
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=atol, msg=lambda m, name=name: f"{name}: {m}")
    moved = min((p - q).abs().max() for p, q in zip(ref_model.parameters(), train_model().parameters(), strict=True))
    assert moved > 5 * atol, moved  # every tensor moves well beyond what rounding may explain


def test_gradient_checkpointing_gives_the_same_training(tmp_path):
    runs = []
    for checkpointing in (False, True):
        config = tiny_config(tmp_path, model={"gradient_checkpointing": checkpointing}, train={"max_steps": 3})
        runs.append(train(config, model=train_model(), dataset=tiny_dataset()).losses)
    assert runs[1] == runs[0]  # recomputation repeats the same arithmetic in the same order: bit-identical


def test_lora_and_trainable_subsets(tmp_path):
    before = train_model()
    config = tiny_config(tmp_path, lora={"enabled": True, "r": 4, "alpha": 8}, train={"max_steps": 3, "save": True})
    result = train(config, model=train_model(), dataset=tiny_dataset())
    merged = AutoModelForCausalLM.from_pretrained(result.output_dir, attn_implementation="moba")
    assert merged.config.moba_config == config.moba.to_dict()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    changed = {
        n for (n, p), q in zip(merged.named_parameters(), before.parameters(), strict=True) if not torch.equal(p, q)
    }
    assert changed and all(any(t in n for t in ("q_proj", "k_proj", "v_proj", "o_proj")) for n in changed)

    model = train_model()
    config = tiny_config(tmp_path, model={"trainable": ["k_proj"]}, train={"max_steps": 2})
    train(config, model=model, dataset=tiny_dataset())
    changed = {
        n for (n, p), q in zip(model.named_parameters(), before.parameters(), strict=True) if not torch.equal(p, q)
    }
    assert changed == {f"model.layers.{i}.self_attn.k_proj.weight" for i in range(2)}


def test_config_errors_and_overrides(tmp_path):
    with pytest.raises(ValueError, match=r"schedule.moba_fraction must be \[0, 1\], got 1.5"):
        TrainConfig.from_dict({"schedule": {"moba_fraction": 1.5}})
    with pytest.raises(ValueError, match="unknown keys \\['lr'\\] in \\[train\\]"):
        TrainConfig.from_dict({"train": {"lr": 1}})
    with pytest.raises(ValueError, match="unknown training config sections"):
        TrainConfig.from_dict({"optimizer": {}})
    with pytest.raises(ValueError, match="top_k must be an integer >= 1, got 0"):
        TrainConfig.from_dict({"moba": {"top_k": 0}})
    with pytest.raises(ValueError, match="train.precision"):
        TrainConfig.from_dict({"train": {"precision": "fp16"}})
    assert parse_override("train.learning_rate=2e-4") == ("train", "learning_rate", 2e-4)
    assert parse_override("model.gradient_checkpointing=true") == ("model", "gradient_checkpointing", True)
    assert parse_override("model.name=/some/path") == ("model", "name", "/some/path")
    with pytest.raises(ValueError, match="SECTION.KEY=VALUE"):
        parse_override("top_k=3")
    path = tmp_path / "c.toml"
    path.write_text("[moba]\nblock_size = 64\n[train]\nmax_steps = 5\n")
    config = load_config(str(path), ["moba.top_k=4"], {("train", "max_steps"): 7, ("model", "name"): None})
    assert (config.moba.block_size, config.moba.top_k, config.train.max_steps) == (64, 4, 7)


@pytest.mark.parametrize("name", ["train_cpu_demo.toml", "train_gpu.toml"])
def test_shipped_configs_load(name):
    from pathlib import Path

    config = TrainConfig.from_file(Path(__file__).parent.parent / "configs" / name)
    assert config.data.seq_len >= config.moba.block_size
