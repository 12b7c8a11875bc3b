import json

import pytest

from moba_hf import MobaConfig

CONFIG_DIR = __import__("pathlib").Path(__file__).resolve().parents[1] / "configs"


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


def test_shipped_configs_load():
    files = sorted(CONFIG_DIR.glob("moba*.toml"))
    assert {"moba_8k.toml", "moba_1m.toml", "moba_demo.toml"} <= {f.name for f in files}
    assert MobaConfig.from_file(CONFIG_DIR / "moba_8k.toml") == MobaConfig(block_size=512, top_k=3)
    assert MobaConfig.from_file(CONFIG_DIR / "moba_1m.toml") == MobaConfig(
        block_size=4096, top_k=12, full_attn_layers=3
    )


def test_theoretical_sparsity_counts_pairs_exactly():
    # 8 tokens, block 2, top_k 2: brute-force count of attended causal pairs
    cfg = MobaConfig(block_size=2, top_k=2)
    attended = sum((p % 2 + 1) + (2 if p >= 2 else 0) for p in range(8))
    assert cfg.theoretical_sparsity(8) == pytest.approx(1 - attended / 36)
    assert MobaConfig(block_size=512, top_k=100).theoretical_sparsity(4096) == 0.0
    assert 0.9 < MobaConfig(block_size=4096, top_k=12).theoretical_sparsity(1 << 20) < 0.92


def test_training_free_preset_is_the_swept_setting():
    preset = MobaConfig.from_file(CONFIG_DIR / "training_free.toml")
    assert preset == MobaConfig(
        block_size=64, top_k=12, full_attn_layers=3, pooling="bound", sink_blocks=1, local_blocks=1
    )
    from moba_hf.eval.sweep import DEFAULT_GRID

    assert preset in {cfg for _, cfg in DEFAULT_GRID}
    assert MobaConfig.from_file(CONFIG_DIR / "moba_demo.toml") == preset  # the demo runs the preset
