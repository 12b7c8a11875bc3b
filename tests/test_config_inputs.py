"""What a config may hold and how it reaches a model: files that name no setting, integers the kernels cannot
index, numpy scalars, optional integers in files, unreadable files, server files, and `model.config.moba_config`
holding the resolved settings (a MobaConfig, a preset name or a file set there is stored as its values)."""

import json
import logging
import pathlib
import types

import numpy as np
import pytest
import torch
from tiny_models import tiny_model
from transformers import AutoModelForCausalLM

import moba_hf
from moba_hf import DcaConfig, MobaConfig
from moba_hf.kernels import moba_attention
from moba_hf.options import MAX_COUNT


# --- a config that names no setting ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name,text,what",
    [
        ("about.toml", '[about]\nsummary = "blocks of 64"\n', r"the config holds only an \[about\] description"),
        ("moba.toml", '[about]\nsummary = "blocks of 64"\n[moba]\n', r"the \[moba\] table is empty"),
        ("attention.toml", "[attention]\n", r"the \[attention\] table is empty"),
        ("moba.json", '{"moba": {}}', r"the \[moba\] table is empty"),
        ("moba.yaml", "moba: {}\n", r"the \[moba\] table is empty"),
        ("serving.toml", 'kv_cache_dtype = "fp16"\n', r"the config holds only serving options \(kv_cache_dtype\)"),
        ("kv.toml", '[attention.kv_cache]\ndtype = "fp16"\n',
         r"the \[attention\] table holds only serving options \(kv_cache_dtype\)"),
    ],
)  # fmt: skip
def test_a_file_naming_no_setting_is_refused(tmp_path, name, text, what):
    """Before: each loaded the defaults (block 512, top 3) without a word."""
    path = tmp_path / name
    path.write_text(text)
    message = rf"{name}: {what}: no MoBA setting, so the defaults \(MobaConfig\(block_size=512, top_k=3\)\) would run"
    with pytest.raises(ValueError, match=message):
        MobaConfig.from_file(path)
    with pytest.raises(ValueError, match=message):
        MobaConfig.from_spec(str(path))
    assert MobaConfig.from_dict({}) == MobaConfig()  # an empty mapping asks for nothing: the defaults


# --- integers past what the kernels index ----------------------------------------------------------------------
INT_FIELDS = ["block_size", "top_k", "sink_blocks", "local_blocks", "dense_tail", "decode_top_k", "full_attn_layers"]


@pytest.mark.parametrize("value", [MAX_COUNT + 1, 2**63, 10**30])
@pytest.mark.parametrize("field", [*INT_FIELDS, "min_top_k"])
def test_integers_past_the_bound_are_refused_naming_it(field, value):
    """Before: 2**63 wrapped inside torch (sink_blocks dropped the sink block, block_size gave NaN in cached
    decoding), 10**30 raised a bare OverflowError."""
    extra = dict(top_p=0.5, top_k=MAX_COUNT) if field == "min_top_k" else {}
    message = rf"{field} must be at most {MAX_COUNT} \(2\*\*62 - 1, .* got {value}"
    with pytest.raises(ValueError, match=message):
        MobaConfig(**{**extra, field: value})


@pytest.mark.parametrize("field", ["pretraining_length", "chunk_size", "local_window"])
def test_dca_lengths_past_the_bound_are_refused(field):
    with pytest.raises(ValueError, match=rf"{field} must be at most {MAX_COUNT} \(2\*\*62 - 1, .* got {2**63}"):
        DcaConfig(**{field: 2**63})


def test_a_file_integer_past_the_bound_names_the_key(tmp_path):
    path = tmp_path / "big.toml"
    path.write_text('[moba]\nsink_blocks = "9223372036854775808"\n')
    with pytest.raises(ValueError, match=rf"big.toml: sink_blocks must be at most {MAX_COUNT} \(2\*\*62 - 1, "):
        MobaConfig.from_file(path)
    path.write_text("top_k_blocks = 9223372036854775808\n")  # an alias: the message says which key set it
    with pytest.raises(ValueError, match=rf"top_k must be at most {MAX_COUNT} .* \(set by top_k_blocks\)"):
        MobaConfig.from_file(path)


@pytest.mark.parametrize("keyword", ["block_size", "top_k", "sink_blocks", "local_blocks", "dense_tail"])
@pytest.mark.parametrize("value", [2**63, 10**30])
def test_kernel_keywords_past_the_bound_are_refused(keyword, value):
    """Before: moba_attention took them; sink_blocks=2**63 silently attended no sink block."""
    q = torch.randn(1, 2, 16, 8)
    kwargs = dict(block_size=4, top_k=2) | {keyword: value}
    with pytest.raises(ValueError, match=rf"{keyword} must be at most {MAX_COUNT} \(2\*\*62 - 1, .*, got {value}"):
        moba_attention(q, q, q, **kwargs)


@pytest.mark.parametrize("keyword", ["top_k", "sink_blocks", "local_blocks", "dense_tail", "block_size"])
def test_kernel_keywords_at_the_bound_act_as_the_whole_sequence(keyword):
    """At 2**62 - 1 each count covers the sequence, exactly as a count just past it (10**6 on 40 tokens)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 8, dtype=torch.float64) for _ in range(3))
    for backend in ("reference", "torch"):
        base = dict(block_size=4, top_k=2, backend=backend)
        at_bound = moba_attention(q, k, v, **base | {keyword: MAX_COUNT})
        torch.testing.assert_close(at_bound, moba_attention(q, k, v, **base | {keyword: 10**6}), rtol=0, atol=0)


def test_the_work_split_takes_counts_at_the_bound():
    """Before: top_k * block_size past int64 raised OverflowError inside the torch backend's work split."""
    from moba_hf.kernels.torch_impl import query_parts

    parts = query_parts(4096, 4096, 4096, 4, top_k=MAX_COUNT)
    assert parts == query_parts(4096, 4096, 4096, 4, top_k=10**6)
    assert parts[0][0] == 0 and parts[-1][1] == 4096


def test_cached_decoding_at_the_bound_equals_a_block_past_the_sequence():
    """block_size 2**63 gave NaN in cached decoding (it wrapped); at the bound it is one block, as 10**6 is."""
    ids = torch.randint(0, 97, (1, 30))
    tokens = []
    for block_size in (MAX_COUNT, 10**6):
        torch.manual_seed(1)
        model = tiny_model("llama", moba=MobaConfig(block_size=block_size, top_k=2, sink_blocks=MAX_COUNT))
        with torch.no_grad():
            out = model.generate(
                ids, max_new_tokens=5, do_sample=False, output_scores=True, return_dict_in_generate=True
            )
        assert all(torch.isfinite(s).all() for s in out.scores)
        tokens.append(out.sequences)
    assert torch.equal(*tokens)


# --- numbers as Python numbers ---------------------------------------------------------------------------------
def test_numpy_scalars_become_python_numbers():
    """Before: top_p=np.float32(0.5) was accepted, then the first forward raised a JSON TypeError."""
    cfg = MobaConfig(
        block_size=np.int64(8), top_k=np.int32(3), top_p=np.float32(0.5), min_top_k=np.int64(2),
        full_attn_layer_ids=[np.int64(0)], dca=DcaConfig(pretraining_length=np.int64(4096)),
    )  # fmt: skip
    assert cfg == MobaConfig(
        block_size=8, top_k=3, top_p=0.5, min_top_k=2, full_attn_layer_ids=[0], dca=DcaConfig(4096)
    )
    assert type(cfg.top_p) is float and type(cfg.block_size) is int and type(cfg.full_attn_layer_ids[0]) is int
    json.dumps(cfg.to_dict())
    assert MobaConfig(top_p=np.float32(0.5)).replace(top_k=np.int64(4)).top_k == 4
    with pytest.raises(ValueError, match=r"block_size must be an integer >= 1, got 8.0"):
        MobaConfig(block_size=np.float64(8.0))
    with pytest.raises(ValueError, match="sparse must be true or false"):
        MobaConfig(sparse=np.bool_(True))


def test_a_numpy_top_p_runs_a_forward():
    model = tiny_model("llama", moba=MobaConfig(block_size=4, top_k=3, top_p=np.float32(0.5)))
    with torch.no_grad():
        assert torch.isfinite(model(torch.randint(0, 97, (1, 20))).logits).all()
    assert model.config.moba_config["top_p"] == 0.5
    json.dumps(model.config.to_dict())


@pytest.mark.parametrize("top_k", ["3", None, 2.5])
def test_a_top_k_that_is_no_integer_is_named_beside_min_top_k(top_k):
    """Before: moba_attention(top_k="3", min_top_k=2, top_p=...) raised a bare TypeError from a comparison."""
    q = torch.randn(1, 2, 16, 8)
    with pytest.raises(ValueError, match=rf"top_k must be an integer >= 1, got {top_k!r}"):
        moba_attention(q, q, q, block_size=4, top_k=top_k, min_top_k=2, top_p=0.5)
    with pytest.raises(ValueError, match=rf"top_k must be an integer >= 1, got {top_k!r}"):
        MobaConfig(top_k=top_k, min_top_k=2, top_p=0.5)


@pytest.mark.parametrize("written,expected", [('"4"', 4), (" 4", 4), ('" 6 "', 6)])
def test_decode_top_k_in_quotes_is_read_as_the_other_integers(tmp_path, written, expected):
    """Before: decode_top_k = "4" was refused while every other integer field took digit strings."""
    path = tmp_path / "cfg.toml"
    path.write_text(f"[moba]\ntop_k = 8\ndecode_top_k ={written}\n")
    assert MobaConfig.from_file(path) == MobaConfig(top_k=8, decode_top_k=expected)
    assert MobaConfig.from_dict({"decode_top_k": None}) == MobaConfig()
    with pytest.raises(ValueError, match=r'decode_top_k must be an integer \(a number, or digits in quotes like "2"\)'):
        MobaConfig.from_dict({"decode_top_k": "four"})


# --- unreadable files ------------------------------------------------------------------------------------------
def _unreadable(monkeypatch, path):
    """`path` exists but reading it fails as a file without read permission does (tests run as root, who reads
    any file, so the refusal is played by the read itself)."""
    read_bytes = pathlib.Path.read_bytes

    def refuse(self):
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return read_bytes(self)

    monkeypatch.setattr(pathlib.Path, "read_bytes", refuse)


def test_an_unreadable_config_file_is_refused_naming_it(tmp_path, monkeypatch):
    path = tmp_path / "server.toml"
    path.write_text("block_size = 64\ntop_k = 3\n")
    _unreadable(monkeypatch, path)
    with pytest.raises(ValueError, match=rf"config file {path} cannot be read: Permission denied"):
        MobaConfig.from_file(path)


def test_an_unreadable_moba_hf_config_is_the_plugins_setup_error(tmp_path, monkeypatch):
    """Before: a raw PermissionError out of the vLLM plugin's startup."""
    from moba_hf.vllm import startup

    path = tmp_path / "server.toml"
    path.write_text('block_size = 64\ntop_k = 3\nkv_cache_dtype = "fp16"\n')
    _unreadable(monkeypatch, path)
    monkeypatch.setenv(startup.ENV, str(path))
    hf_config = types.SimpleNamespace()
    model_config = types.SimpleNamespace(hf_overrides={}, hf_config=hf_config, hf_text_config=hf_config)
    with pytest.raises(startup.MobaSetupError, match=rf"MOBA_HF_CONFIG={path}: config file {path} cannot be read"):
        startup.resolve(types.SimpleNamespace(model_config=model_config))


# --- server files ----------------------------------------------------------------------------------------------
def test_flash_attn_version_means_the_flash_backend_and_nothing_else(tmp_path):
    """One meaning, documented in docs/serving.md: `flash_attn_version = 2` is `backend = "flash"`."""
    assert MobaConfig.from_dict({"flash_attn_version": 2}) == MobaConfig(backend="flash")
    assert MobaConfig.from_dict({"attention": {"flash_attn_version": "2"}}) == MobaConfig(backend="flash")
    with pytest.raises(ValueError, match="flash_attn_version = 2 contradicts backend = 'torch' .* keep one"):
        MobaConfig.from_dict({"flash_attn_version": 2, "backend": "torch"})


def test_every_server_key_has_its_meaning_in_the_serving_docs():
    from moba_hf import config_vocabularies as names

    text = (pathlib.Path(__file__).parent.parent / "docs" / "serving.md").read_text()
    section = text[text.index("### Server files") :]
    section = section[: section.index("\n## ")]
    for key in (*names.ALIASES, *names.ALWAYS_TRUE, *names.SERVING_KEYS, *names.SERVER_KEYS):
        assert f"`{key}`" in section, key


def test_a_full_server_file_loads_its_moba_settings_and_says_the_rest_is_the_servers(tmp_path, caplog):
    """Before: MobaConfig.from_file refused every server file that carried kv_cache_dtype / max_context_tokens."""
    path = tmp_path / "server.json"
    path.write_text(
        '{"attention_type": "moba", "block_size": "2048", "top_k_blocks": 3, "force_current_block": true, '
        '"causal_mask": true, "kv_cache_dtype": "fp16", "max_context_tokens": 131072}'
    )
    with caplog.at_level(logging.WARNING, logger="moba_hf"):
        assert MobaConfig.from_file(path) == MobaConfig(block_size=2048, top_k=3)
        assert MobaConfig.from_spec(str(path)) == MobaConfig(block_size=2048, top_k=3)
    told = [r.getMessage() for r in caplog.records]
    assert len(told) == 1, told
    assert f"{path} also holds kv_cache_dtype='float16', max_context_tokens=131072: serving options" in told[0]


# --- model.config.moba_config holds the settings ---------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_llama3")
    tiny_model("llama", layers=3).save_pretrained(path)
    return path


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _saved_moba_config(path):
    return json.loads((path / "config.json").read_text())["moba_config"]


def test_a_moba_config_object_loads_prints_and_saves(checkpoint, tmp_path, one_thread):
    """Before: from_pretrained(..., moba_config=MobaConfig(...)) failed while loading with a JSON TypeError, and a
    MobaConfig assigned to model.config.moba_config broke save_pretrained and print(config)."""
    cfg = MobaConfig(block_size=4, top_k=2, sink_blocks=1)
    ids = torch.randint(0, 97, (1, 30))
    model = AutoModelForCausalLM.from_pretrained(
        checkpoint, attn_implementation="moba", moba_config=cfg, dtype=torch.float64
    )
    assert model.config.moba_config == cfg.to_dict()
    want = _logits(model, ids)
    torch.testing.assert_close(want, _logits(tiny_model_from(checkpoint, cfg), ids), rtol=0, atol=0)

    other = MobaConfig(block_size=8, top_k=1, top_p=np.float32(0.5), min_top_k=1)
    model.config.moba_config = other
    assert model.config.moba_config == other.to_dict() and "moba_config" in str(model.config)
    model.save_pretrained(tmp_path)
    assert _saved_moba_config(tmp_path) == other.to_dict()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="moba", dtype=torch.float64)
    assert MobaConfig.from_dict(reloaded.config.moba_config) == other
    torch.testing.assert_close(_logits(reloaded, ids), _logits(model, ids), rtol=0, atol=0)


def tiny_model_from(checkpoint, cfg):
    model = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="sdpa", dtype=torch.float64)
    return moba_hf.apply(model, cfg)


def test_a_bad_moba_config_is_kept_for_the_checks_to_refuse(checkpoint):
    """transformers' and vLLM's config loaders set moba_config before moba_hf's checks run: a value that does not
    resolve is kept as given, and the first forward (vLLM: the plugin's setup) refuses it by name."""
    ids = torch.randint(0, 97, (1, 12))
    model = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="moba", moba_config="no-such-preset")
    assert model.config.moba_config == "no-such-preset"
    with pytest.raises(ValueError, match="MoBA config 'no-such-preset' is neither a preset"):
        _logits(model, ids)
    model.config.moba_config = {"top_k": 0}
    with pytest.raises(ValueError, match="top_k must be an integer >= 1, got 0"):
        _logits(model, ids)
    with pytest.raises(ValueError, match="top_k must be an integer >= 1, got 0"):
        moba_hf.apply(model)


CHANGED_PRESET = """[about]
summary = "a later package's training-free: other blocks"
measured = "not measured"

[moba]
block_size = 4
top_k = 1
"""


@pytest.mark.parametrize("spec", ["preset", "file"])
def test_a_saved_model_keeps_its_attention_when_the_preset_changes(checkpoint, tmp_path, monkeypatch, spec, one_thread):
    """Before: a model loaded with moba_config="training-free" and saved stored the string "training-free", so
    reloading it after the preset changed ran the changed preset."""
    from moba_hf import presets

    ids = torch.randint(0, 97, (1, 40))
    source = "training-free"
    if spec == "file":
        source = tmp_path / "mine.toml"
        source.write_text(presets.path("training-free").read_text())
    model = AutoModelForCausalLM.from_pretrained(
        checkpoint, attn_implementation="moba", moba_config=str(source), dtype=torch.float64
    )
    saved = tmp_path / "saved"
    model.save_pretrained(saved)  # before any forward
    resolved = MobaConfig.preset("training-free")
    assert _saved_moba_config(saved) == resolved.to_dict()
    want = _logits(model, ids)

    later = tmp_path / "later_presets"  # the preset as a later package may ship it
    later.mkdir()
    (later / "training-free.toml").write_text(CHANGED_PRESET)
    monkeypatch.setattr(presets, "DIRECTORY", later)
    if spec == "file":
        source.write_text(CHANGED_PRESET)
    assert MobaConfig.from_spec(str(source)) == MobaConfig(block_size=4, top_k=1)  # the change is in effect

    reloaded = AutoModelForCausalLM.from_pretrained(saved, attn_implementation="moba", dtype=torch.float64)
    assert MobaConfig.from_dict(reloaded.config.moba_config) == resolved
    torch.testing.assert_close(_logits(reloaded, ids), want, rtol=0, atol=0)
    changed = AutoModelForCausalLM.from_pretrained(
        checkpoint, attn_implementation="moba", moba_config=str(source), dtype=torch.float64
    )
    assert (_logits(changed, ids) - want).abs().max() > 1e-3  # the comparison can tell the two apart
