import json

import pytest

from moba_hf import MobaConfig


def test_defaults_are_the_papers_8k_setting():
    cfg = MobaConfig()
    assert (cfg.block_size, cfg.top_k, cfg.full_attn_layers, cfg.decode, cfg.backend) == (512, 3, 0, "moba", "auto")


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"block_size": 0}, "block_size must be an integer >= 1, got 0"),
        ({"top_k": -2}, "top_k must be an integer >= 1, got -2"),
        ({"top_k": True}, "top_k must be an integer >= 1, got True"),
        ({"full_attn_layers": -1}, "full_attn_layers must be an integer >= 0"),
        ({"decode": "sparse"}, "decode must be one of 'moba', 'full', got 'sparse'"),
        ({"backend": "cudnn"}, "backend must be one of"),
        ({"pooling": "min"}, "pooling must be one of"),
        ({"full_attn_layer_ids": "0,1"}, "full_attn_layer_ids must be a list of integers"),
        ({"full_attn_layers": 2, "full_attn_layer_ids": [0]}, "not both"),
    ],
)
def test_invalid_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MobaConfig(**kwargs)


def test_full_layer_sets():
    assert MobaConfig(full_attn_layers=3).full_layer_set(30) == {27, 28, 29}
    assert MobaConfig(full_attn_layer_ids=[0, -1]).full_layer_set(30) == {0, 29}
    assert MobaConfig().full_layer_set(30) == frozenset()
    with pytest.raises(ValueError, match=r"outside the model's layers \[-4, 3\]"):
        MobaConfig(full_attn_layer_ids=[4]).full_layer_set(4)
    with pytest.raises(ValueError, match="exceeds the model's 4 layers"):
        MobaConfig(full_attn_layers=5).full_layer_set(4)


def test_dict_roundtrip_and_unknown_keys():
    cfg = MobaConfig(block_size=64, top_k=16, full_attn_layer_ids=[1, 2], sink_blocks=1)
    assert MobaConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    with pytest.raises(ValueError, match="unknown MoBA config keys \\['blocksize'\\]"):
        MobaConfig.from_dict({"blocksize": 3})


@pytest.mark.parametrize("suffix", [".toml", ".json", ".yaml"])
def test_file_formats(tmp_path, suffix):
    text = {
        ".toml": "[moba]\nblock_size = 128\ntop_k = 4\nfull_attn_layers = 2\n",
        ".json": '{"block_size": 128, "top_k": 4, "full_attn_layers": 2}',
        ".yaml": "block_size: 128\ntop_k: 4\nfull_attn_layers: 2\n",
    }[suffix]
    path = tmp_path / f"cfg{suffix}"
    path.write_text(text)
    assert MobaConfig.from_file(path) == MobaConfig(block_size=128, top_k=4, full_attn_layers=2)


def test_presets_are_shipped_and_named():
    from moba_hf import presets

    assert {"training-free", "paper-8k", "paper-1m", "dca-dense", "dca-moba", "serving-long-doc"} <= set(
        presets.names()
    )
    assert MobaConfig.preset("paper-8k") == MobaConfig(block_size=512, top_k=3)
    assert MobaConfig.preset("paper-1m") == MobaConfig(block_size=4096, top_k=12, full_attn_layers=3)
    assert MobaConfig.preset("serving-long-doc") == MobaConfig(
        block_size=4096, top_k=4, full_attn_layers=2, decode="full"
    )
    for name in presets.names():
        info = presets.about(name)
        assert info["summary"] and info["measured"], name
    with pytest.raises(ValueError, match="unknown MoBA preset 'trainingfree'; presets: dca-dense"):
        MobaConfig.preset("trainingfree")


def test_from_spec_takes_presets_files_mappings(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text("block_size = 32\n")
    assert MobaConfig.from_spec("training-free") == MobaConfig.preset("training-free")
    assert MobaConfig.from_spec(path) == MobaConfig.from_spec(str(path)) == MobaConfig(block_size=32)
    assert MobaConfig.from_spec({"top_k": 5}) == MobaConfig(top_k=5)
    assert MobaConfig.from_spec(None) == MobaConfig()
    with pytest.raises(ValueError, match="neither a preset .* nor an existing"):
        MobaConfig.from_spec("no-such-preset")
    with pytest.raises(ValueError, match="got int"):
        MobaConfig.from_spec(5)


SEED_JSON = {
    "attention_type": "moba",
    "block_size": 4096,
    "top_k_blocks": 4,
    "force_current_block": True,
    "causal_mask": True,
    "enable_full_attention_fallback": True,
    "fallback_layers": 2,
    "score_pooling": "mean",
    "flash_attn_version": 2,
    "kv_cache_dtype": "bfloat16",
    "max_context_tokens": 131072,
}
SEED_TOML = """
[attention]
type = "moba"
block_size = 4096
top_k_blocks = 4
force_current_block = true
causal_mask = true

[attention.fallback]
enable = true
layers = 2

[attention.kv_cache]
dtype = "bfloat16"
max_context_tokens = 131072
"""


def test_seed_style_server_configs_load(tmp_path):
    from moba_hf.config import read_config_file

    (tmp_path / "seed.json").write_text(json.dumps(SEED_JSON))
    (tmp_path / "seed.toml").write_text(SEED_TOML)
    json_settings = read_config_file(tmp_path / "seed.json")
    assert json_settings.moba == MobaConfig(block_size=4096, top_k=4, full_attn_layers=2, backend="flash")
    assert json_settings.serving == {"kv_cache_dtype": "bfloat16", "max_context_tokens": 131072}
    toml_settings = read_config_file(tmp_path / "seed.toml")
    assert toml_settings.moba == MobaConfig(block_size=4096, top_k=4, full_attn_layers=2)
    assert toml_settings.serving == json_settings.serving
    # a MobaConfig alone has no place for serving options: refused by name, not dropped
    with pytest.raises(ValueError, match="seed.json: kv_cache_dtype='bfloat16', max_context_tokens=131072: serving"):
        MobaConfig.from_file(tmp_path / "seed.json")
    # the reference MoBA code's names
    assert MobaConfig.from_dict({"moba_chunk_size": 256, "moba_topk": 2}) == MobaConfig(block_size=256, top_k=2)


@pytest.mark.parametrize(
    "data,match",
    [
        ({"force_current_block": False}, "force_current_block = False is not possible: MoBA always attends"),
        ({"causal_mask": False}, "causal_mask = False is not possible: MoBA attention is causal"),
        ({"attention_type": "linear"}, "attention_type must be 'moba' or 'full'"),
        ({"enable_full_attention_fallback": False, "fallback_layers": 2}, "contradicts enable_full_attention"),
        ({"enable_full_attention_fallback": True}, "needs fallback_layers"),
        ({"flash_attn_version": 3}, "flash_attn_version must be 2"),
        ({"block_size": 64, "moba_chunk_size": 64}, "block_size is given twice"),
        ({"moba": 5}, "moba must be a table of settings, got int 5"),
        ({"block_size": 64, "moba": {"top_k": 2}}, r"keys \['block_size'\] sit beside the \[moba\] table"),
        ({"attention": {"type": "moba", "window": 3}}, r"unknown MoBA config keys \['window'\]"),
        ({"attention": {"type": "moba"}, "extra": 1}, r"keys \['extra'\] sit beside the \[attention\] table"),
    ],
)
def test_config_keys_are_used_or_refused(data, match):
    with pytest.raises(ValueError, match=match):
        MobaConfig.from_dict(data)


def test_fallback_layer_list_and_full_attention_type():
    cfg = MobaConfig.from_dict({"enable_full_attention_fallback": True, "fallback_layers": [0, -1]})
    assert cfg.full_attn_layer_ids == (0, -1)
    assert MobaConfig.from_dict({"attention_type": "full"}).sparse is False


@pytest.mark.parametrize(
    "name,text,match",
    [
        ("empty.toml", "", "empty.toml is empty"),
        ("empty.yaml", "# nothing\n", "empty.yaml is empty"),
        ("empty.json", "", "empty.json is empty"),
        ("bad.toml", "block_size = \n", "bad.toml: invalid TOML"),
        ("bad.json", '{"block_size": 64,}', "bad.json: invalid JSON"),
        ("bad.yaml", "block_size: [1\n", "bad.yaml: invalid YAML"),
        ("list.json", "[1, 2]", "list.json must hold a table of settings, got list"),
        ("cfg.ini", "block_size = 3", "must end in .toml, .json, .yaml or .yml"),
        ("typo.toml", "[moba]\nblocksize = 3\n", r"typo.toml: unknown MoBA config keys \['blocksize'\]"),
    ],
)
def test_bad_files_name_the_file(tmp_path, name, text, match):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        MobaConfig.from_file(path)


def test_theoretical_sparsity_counts_pairs_exactly():
    # 8 tokens, block 2, top_k 2: brute-force count of attended causal pairs
    cfg = MobaConfig(block_size=2, top_k=2)
    attended = sum((p % 2 + 1) + (2 if p >= 2 else 0) for p in range(8))
    assert cfg.theoretical_sparsity(8) == pytest.approx(1 - attended / 36)
    assert MobaConfig(block_size=512, top_k=100).theoretical_sparsity(4096) == 0.0
    assert 0.9 < MobaConfig(block_size=4096, top_k=12).theoretical_sparsity(1 << 20) < 0.92


def test_training_free_preset_is_the_swept_setting():
    preset = MobaConfig.preset("training-free")
    assert preset == MobaConfig(
        block_size=64, top_k=5, full_attn_layer_ids=(0, 1), pooling="bound", sink_blocks=1, local_blocks=1,
        dense_tail=64,
    )  # fmt: skip
    from moba_hf.eval.sweep import DEFAULT_GRID

    assert preset in {cfg for _, cfg in DEFAULT_GRID}
