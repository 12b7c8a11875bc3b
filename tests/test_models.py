"""The one model loader (`moba_hf.models.load_model`): what it loads, and that the eval commands, training and
`models.load` all go through it with their own defaults."""

import pytest
import torch
from tiny_models import tiny_model

from moba_hf import MobaConfig, models


@pytest.fixture(scope="module")
def bare_dir(tmp_path_factory):
    """A saved tiny random Llama without a tokenizer."""
    path = tmp_path_factory.mktemp("bare_llama")
    tiny_model("llama", dtype=torch.float32).save_pretrained(path)
    return path


def test_loads_a_checkpoint_dense_in_eval_mode(tiny_dir):
    model, tokenizer = models.load_model(str(tiny_dir))
    assert model.config._attn_implementation == "sdpa" and not model.training
    assert next(model.parameters()).dtype == torch.float32 and next(model.parameters()).device.type == "cpu"
    assert tokenizer("a passkey").input_ids  # the checkpoint's own tokenizer
    model, _ = models.load_model(str(tiny_dir), dtype="bfloat16", device="cpu", tokenizer=tokenizer)
    assert next(model.parameters()).dtype == torch.bfloat16


def test_switches_moba_or_another_attention_on(tiny_dir):
    model, _ = models.load_model(str(tiny_dir), moba={"block_size": 16, "top_k": 2})
    assert model.config._attn_implementation == "moba"
    assert MobaConfig.from_dict(model.config.moba_config) == MobaConfig(block_size=16, top_k=2)
    model, _ = models.load_model(str(tiny_dir), attn_implementation="eager")
    assert model.config._attn_implementation == "eager"


def test_tokenizer_required_optional_or_given(bare_dir, tiny_dir):
    model, tokenizer = models.load_model(str(bare_dir), tokenizer="optional")
    assert tokenizer is None and model.config.model_type == "llama"
    with pytest.raises((OSError, ValueError, TypeError)):
        models.load_model(str(bare_dir))  # "required" is the default
    given = object()
    assert models.load_model(str(bare_dir), tokenizer=given)[1] is given


def test_pick_device():
    assert models.pick_device(None) is None and models.pick_device("cuda:1") == "cuda:1"
    assert models.pick_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")


class Loaded(Exception):
    """Raised by the recording loader: the test stops where the model would be used."""


@pytest.fixture
def calls(monkeypatch):
    """Records the calls of models.load_model instead of loading."""
    made = []

    def record(name, **kwargs):
        made.append((name, kwargs))
        return "model", kwargs.get("tokenizer")

    monkeypatch.setattr(models, "load_model", record)
    return made


@pytest.fixture
def stop_at_load(calls, monkeypatch):
    """models.load_model records its call, then raises Loaded."""
    record = models.load_model

    def record_and_stop(name, **kwargs):
        record(name, **kwargs)
        raise Loaded

    monkeypatch.setattr(models, "load_model", record_and_stop)
    return calls


def test_commands_pick_bfloat16_only_on_cuda():
    assert models.pick_dtype("auto", "cpu") == "float32"
    assert models.pick_dtype("auto", "cuda:1") == "bfloat16"  # --dtype auto on CUDA
    assert models.pick_dtype("float16", "cpu") == "float16" and models.pick_dtype("auto", None) == "float32"
    assert models.pick_dtype() == ("bfloat16" if torch.cuda.is_available() else "float32")


@pytest.mark.parametrize(
    ("argv", "dtype", "device"),
    [
        ([], "float32", "cpu"),
        ([], "bfloat16", "cuda:1"),  # --dtype auto on CUDA
        (["--dtype", "float16"], "float16", "cpu"),
    ],
)
def test_eval_commands_load_through_it(stop_at_load, tiny_dir, tmp_path, argv, dtype, device):
    from moba_hf import cli

    out = str(tmp_path / "out")
    with pytest.raises(Loaded):
        cli.main(["eval", "passkey", "--model", str(tiny_dir), "--device", device, "--out", out, *argv])
    [(name, kwargs)] = stop_at_load
    assert name == str(tiny_dir) and kwargs["dtype"] == dtype and kwargs["device"] == device
    assert kwargs["tokenizer"] is not None  # the tokenizer the command checked the lengths with
    assert set(kwargs) == {"dtype", "device", "tokenizer"}  # dense: settings are switched on later


def test_training_loads_through_it(stop_at_load):
    from moba_hf.train import TrainConfig, build_trainer

    with pytest.raises(Loaded):
        build_trainer(TrainConfig.from_dict({"model": {"name": "some/checkpoint", "dtype": "bfloat16"}}))
    assert stop_at_load == [("some/checkpoint", {"dtype": "bfloat16", "tokenizer": "optional"})]


def test_load_is_the_loader_for_embedded_names(calls):
    models.load("smollm2", attn_implementation="moba", moba="training-free")
    models.load("smollm2", dtype="bfloat16")
    assert calls == [
        ("smollm2", {"attn_implementation": "moba", "moba": "training-free", "dtype": "float32"}),
        ("smollm2", {"attn_implementation": "sdpa", "moba": None, "dtype": "bfloat16"}),
    ]
    with pytest.raises(ValueError, match="unknown embedded model 'tiny'; available: \\['smollm2'\\]"):
        models.load("tiny")
    assert len(calls) == 2


def test_embedded_name_is_public_and_resolved(monkeypatch, tmp_path, capsys):
    import moba_hf
    from moba_hf import cli

    assert moba_hf.embedded_path is models.embedded_path and models.local_path is models.embedded_path
    assert "embedded_path" in moba_hf.__all__
    made = tmp_path / "smollm2-dir"
    monkeypatch.setattr(models, "embedded_path", lambda name="smollm2": made)
    assert models.resolve("smollm2") == made and models.resolve("org/name") == "org/name"
    seen = {}

    def from_pretrained(name_or_path, moba=None, **kwargs):
        seen.update(path=name_or_path, moba=moba, **kwargs)
        return "model"

    import moba_hf.integration as integration

    monkeypatch.setattr(integration, "from_pretrained", from_pretrained)
    assert moba_hf.from_pretrained("smollm2", moba="training-free", dtype="float32") == "model"
    assert seen == {"path": made, "moba": "training-free", "dtype": "float32"}  # the embedded directory
    assert cli.main(["model-path", "smollm2"]) == 0
    assert capsys.readouterr().out == f"{made}\n"  # only the path on stdout: "$(moba-hf model-path smollm2)"


@pytest.mark.slow
def test_from_pretrained_loads_the_embedded_model_by_name():
    import moba_hf

    model = moba_hf.from_pretrained("smollm2", moba="training-free")
    assert model.config._attn_implementation == "moba"
    assert model.config.name_or_path == str(models.embedded_path("smollm2"))
