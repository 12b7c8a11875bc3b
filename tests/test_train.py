"""Training with MoBA on tiny models: loss goes down, the 90/10 switch lands on its step, sparsity is logged,
checkpoints reload with their MoBA setting, every kernel backend trains like the reference, LoRA works."""

import json

import pytest
import torch
from tiny_models import train_model
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
        config = tiny_config(tmp_path / str(checkpointing), model={"gradient_checkpointing": checkpointing},
                             train={"max_steps": 3})  # fmt: skip
        runs.append(train(config, model=train_model(), dataset=tiny_dataset()).losses)
    assert runs[1] == runs[0]  # recomputation repeats the same arithmetic in the same order: bit-identical


def test_lora_and_trainable_subsets(tmp_path):
    before = train_model()
    config = tiny_config(
        tmp_path / "lora", lora={"enabled": True, "r": 4, "alpha": 8}, train={"max_steps": 3, "save": True}
    )
    result = train(config, model=train_model(), dataset=tiny_dataset())
    merged = AutoModelForCausalLM.from_pretrained(result.output_dir, attn_implementation="moba")
    assert merged.config.moba_config == config.moba.to_dict()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    changed = {
        n for (n, p), q in zip(merged.named_parameters(), before.parameters(), strict=True) if not torch.equal(p, q)
    }
    assert changed and all(any(t in n for t in ("q_proj", "k_proj", "v_proj", "o_proj")) for n in changed)

    model = train_model()
    config = tiny_config(tmp_path / "subset", model={"trainable": ["k_proj"]}, train={"max_steps": 2})
    train(config, model=model, dataset=tiny_dataset())
    changed = {
        n for (n, p), q in zip(model.named_parameters(), before.parameters(), strict=True) if not torch.equal(p, q)
    }
    assert changed == {f"model.layers.{i}.self_attn.k_proj.weight" for i in range(2)}


def test_config_errors_and_overrides(tmp_path):
    with pytest.raises(ValueError, match=r"schedule.moba_fraction must be a number in \[0, 1\], got 1.5"):
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


@pytest.mark.parametrize(
    ("override", "shown"),
    [
        ("abc", "'abc'"),
        ('"1e-4"', "'1e-4' (a quoted number is a string"),  # --set reads literals: quoted is a string, as in TOML
        ("inf", "'inf'"),  # not a Python literal: the bare string "inf"
        ("-1e-4", "-0.0001"),
        ("0", "0"),
        ("true", "True"),
    ],
)
def test_a_bad_learning_rate_names_key_value_and_range(tmp_path, override, shown):
    path = tmp_path / "c.toml"
    path.write_text("[train]\nmax_steps = 2\n")
    with pytest.raises(ValueError) as err:
        load_config(str(path), [f"train.learning_rate={override}"])
    assert str(err.value).startswith(f"train.learning_rate must be a finite number > 0, got {shown}")


@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_a_non_finite_number_in_the_file_is_refused(tmp_path, value):
    path = tmp_path / "c.toml"
    path.write_text(f"[train]\nlearning_rate = {value}\n[schedule]\nmoba_fraction = 1.0\n")  # TOML floats
    with pytest.raises(ValueError, match=rf"train.learning_rate must be a finite number > 0, got {value}"):
        load_config(str(path))


def test_every_key_is_type_checked():
    cases = {
        ("train", "max_steps", 2.5): "train.max_steps must be an integer >= 1, got 2.5",
        ("train", "batch_size", True): "train.batch_size must be an integer >= 1, got True",
        ("data", "seq_len", "64"): "data.seq_len must be an integer >= 2, got '64' (a quoted number",
        ("model", "trainable", "q_proj"): "model.trainable must be a list of strings, got 'q_proj'",
        ("train", "use_cpu", 1): "train.use_cpu must be true or false or none, got 1",
        ("train", "max_grad_norm", float("nan")): "train.max_grad_norm must be a finite number >= 0",
        ("lora", "dropout", 1.0): "lora.dropout must be a number in [0, 1), got 1.0",
    }
    for (section, key, value), message in cases.items():
        with pytest.raises(ValueError) as err:
            TrainConfig.from_dict({section: {key: value}})
        assert str(err.value).startswith(message), (key, str(err.value))
    config = TrainConfig.from_dict({"train": {"learning_rate": 1, "use_cpu": None}, "data": {"max_documents": None}})
    assert config.train.learning_rate == 1


def test_cli_refuses_a_bad_value_in_one_line(tmp_path, capsys):
    from moba_hf.cli import main

    path = tmp_path / "c.toml"
    path.write_text("[train]\nmax_steps = 2\n")
    assert main(["train", str(path), "--set", "train.learning_rate=abc"]) == 2
    err = capsys.readouterr().err
    assert err == "moba-hf train: error: train.learning_rate must be a finite number > 0, got 'abc'\n"
    assert main(["train", str(path), "--allow-config-change"]) == 2
    assert "--allow-config-change applies to a resume: add --resume" in capsys.readouterr().err


def short_window_model(positions):
    from tiny_models import TINY, TRAIN
    from transformers import AutoConfig

    torch.manual_seed(0)
    sizes = {**TINY, **TRAIN, "num_hidden_layers": 1, "max_position_embeddings": positions}
    config = AutoConfig.for_model("llama", **sizes)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).train()


def doc(ids):
    return Document(ids, list(ids))


def rows_of(length, n_docs=4, seq_len=None):
    """n_docs documents of `length` tokens, packed into rows of `seq_len` (default: one document per row)."""
    docs = [doc([(i + 3 * t) % 128 for t in range(length)]) for i in range(n_docs)]
    return PackedDataset(pack(docs, seq_len or length))


def test_seq_len_past_the_trained_window_warns(tmp_path, caplog):
    config = tiny_config(tmp_path, data={"seq_len": 64}, train={"max_steps": 1})
    with caplog.at_level("WARNING", logger="moba_hf"):
        train(config, model=short_window_model(32), dataset=rows_of(64))
    notes = [m for m in caplog.messages if "trained window" in m]
    assert len(notes) == 1, caplog.messages
    assert notes[0].startswith("moba_hf: data.seq_len=64 uses 64 positions, past the model's trained window of 32 ")
    assert "32 positions (max_position_embeddings)" in notes[0]
    assert "DCA" in notes[0] and "RoPE scaling" in notes[0]
    caplog.clear()
    with caplog.at_level("WARNING", logger="moba_hf"):
        train(config, model=short_window_model(64), dataset=rows_of(64), output_dir=tmp_path / "wide")
    assert not [m for m in caplog.messages if "trained window" in m]


def test_positions_continued_across_rows_count_against_the_window(tmp_path, caplog):
    """split_documents = true continues a cut document's positions in the next row: 40-token documents in
    16-token rows reach position 39, past a 32-position window, though seq_len is 16."""
    config = tiny_config(tmp_path, data={"seq_len": 16}, train={"max_steps": 1})
    with caplog.at_level("WARNING", logger="moba_hf"):
        train(config, model=short_window_model(32), dataset=rows_of(40, seq_len=16))
    notes = [m for m in caplog.messages if "trained window" in m]
    assert len(notes) == 1 and "data.seq_len=16 with data.split_documents = true" in notes[0], caplog.messages
    assert "uses 40 positions" in notes[0]


def test_seq_len_past_a_learned_position_table_is_refused(tmp_path):
    from transformers import AutoConfig

    config = AutoConfig.for_model("gpt2", n_positions=32, n_embd=32, n_layer=1, n_head=2, vocab_size=128)
    model = AutoModelForCausalLM.from_config(config)
    run = tiny_config(tmp_path, data={"seq_len": 64}, train={"max_steps": 1})
    with pytest.raises(ValueError, match="data.seq_len=64 needs 64 positions, but this model has a learned table"):
        train(run, model=model, dataset=rows_of(64))
    assert not (tmp_path / "out").exists()  # refused before anything was written
