import dataclasses
import json
import subprocess
import sys
from pathlib import Path

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
    from moba_hf.presets.cli import about

    assert {"training-free", "paper-8k", "paper-1m", "dca-dense", "dca-moba", "serving-long-doc"} <= set(
        presets.names()
    )
    assert MobaConfig.preset("paper-8k") == MobaConfig(block_size=512, top_k=3)
    assert MobaConfig.preset("paper-1m") == MobaConfig(block_size=4096, top_k=12, full_attn_layers=3)
    assert MobaConfig.preset("serving-long-doc") == MobaConfig(
        block_size=4096, top_k=4, full_attn_layers=2, decode="full"
    )
    for name in presets.names():
        info = about(name)
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
        dense_tail=64, decode="full",
    )  # fmt: skip
    from moba_hf.eval.sweep import DEFAULT_GRID

    assert preset in {cfg for _, cfg in DEFAULT_GRID}


# --- [about]: a description, the presets' keys only ------------------------------------------------------------
def test_about_table_takes_the_presets_keys_only(tmp_path):
    from moba_hf.config import read_config_file

    path = tmp_path / "mine.toml"
    path.write_text('[about]\nsummary = "blocks of 64"\nmeasured = "not yet"\n\n[moba]\nblock_size = 64\n')
    assert read_config_file(path).about == {"summary": "blocks of 64", "measured": "not yet"}
    assert MobaConfig.from_file(path) == MobaConfig(block_size=64)
    path.write_text("[about]\nsummary = 'mine'\nblock_size = 64\n\n[moba]\ntop_k = 2\n")
    message = r"mine.toml: \[about\] takes only summary and measured .*\['about.block_size'\]: settings go in"
    with pytest.raises(ValueError, match=message):
        MobaConfig.from_file(path)
    path.write_text("about = 3\nblock_size = 64\n")
    with pytest.raises(ValueError, match=r"mine.toml: about must be a table \(\[about\] with summary and measured\)"):
        MobaConfig.from_file(path)
    path.write_text("[about]\nsummary = 3\n[moba]\nblock_size = 64\n")
    with pytest.raises(ValueError, match="mine.toml: about.summary must be text, got 3"):
        MobaConfig.from_file(path)


# --- preset names, file paths ---------------------------------------------------------------------------------
def test_preset_takes_names_only(tmp_path):
    from moba_hf import presets

    path = tmp_path / "mine.toml"
    path.write_text("block_size = 32\n")
    for spec in (str(path), path, str(presets.DIRECTORY / "paper-8k.toml"), "../presets/paper-8k", "paper-8k.toml"):
        with pytest.raises(ValueError, match=r"is a file path, not a preset name .* MobaConfig.from_file\(path\)"):
            MobaConfig.preset(spec)
    # the functions that take a name or a file keep taking both
    assert MobaConfig.from_spec(str(path)) == MobaConfig.from_file(path) == MobaConfig(block_size=32)
    from moba_hf.eval.settings import parse_setting

    assert parse_setting(f"moba:{path}").moba == MobaConfig(block_size=32)
    assert parse_setting("moba:paper-8k").moba == MobaConfig.preset("paper-8k")


# --- reading configs needs no torch ---------------------------------------------------------------------------
def _fresh(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.parametrize("argv", [["presets"], ["presets", "--help"], ["presets", "training-free"]])
def test_presets_command_is_fast_and_loads_no_torch(argv):
    code = f"""
import resource, sys
from moba_hf.cli import main
try:
    rc = main({argv!r})
except SystemExit as done:  # --help
    rc = done.code
usage = resource.getrusage(resource.RUSAGE_SELF)
heavy = sorted(m for m in ("torch", "transformers", "numpy", "yaml") if m in sys.modules)
print("RESULT", rc, usage.ru_utime + usage.ru_stime, heavy)
"""
    done = _fresh(code)
    assert done.returncode == 0, done.stderr
    rc, cpu_s, heavy = done.stdout.rsplit("RESULT", 1)[1].split(maxsplit=2)
    assert rc == "0" and heavy.strip() == "[]" and "usage" not in done.stderr, done.stdout + done.stderr
    assert float(cpu_s) < 2.0  # CPU time of the whole interpreter, start-up included: independent of other load


def test_config_and_presets_import_without_torch():
    done = _fresh(
        "import sys; import moba_hf.config, moba_hf.presets, moba_hf.dca; from moba_hf import MobaConfig\n"
        "cfg = MobaConfig.preset('dca-moba'); MobaConfig(backend='flash', pooling='bound'); str(cfg)\n"
        "print('torch' in sys.modules)"
    )
    assert done.returncode == 0 and done.stdout.split() == ["False"], done.stdout + done.stderr


def test_torch_free_names_agree_with_the_kernels():
    import ast

    from moba_hf import kernels, options
    from moba_hf.kernels import selection

    tree = ast.parse(Path(options.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert imported <= {"__future__", "numbers", "re", "typing"}  # the bottom layer: kernels import it

    assert selection.POOLINGS is options.POOLINGS
    assert tuple(kernels.BACKENDS)[: len(options.BUILTIN_BACKENDS)] == options.BUILTIN_BACKENDS
    assert MobaConfig(pooling="mean+max").plan(2).gate == selection.GateOptions("mean+max")
    with pytest.raises(ValueError, match="backend must be one of 'auto', 'reference'"):
        MobaConfig(backend="cudnn")


def test_a_registered_backend_is_a_valid_name():
    from moba_hf import kernels

    kernels.register_backend(kernels.Backend("config-test", "moba_hf.kernels.reference:moba_attention_reference"))
    try:
        assert MobaConfig(backend="config-test").backend == "config-test"
    finally:
        kernels._REGISTRY.pop("config-test")


def test_readme_field_table_lists_every_field():
    import re

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = readme.split("| field | default | meaning |", 1)[1].split("\n\n")[0]
    assert set(re.findall(r"^\| `(\w+)` \|", table, re.M)) == {f.name for f in dataclasses.fields(MobaConfig)}


def test_the_shipped_sweep_settings_files_load():
    from moba_hf.eval.settings import load_settings_file

    configs = Path(__file__).resolve().parents[1] / "configs"
    settings = load_settings_file(configs / "sweep_decode_levers.toml")
    assert [s.name for s in settings][-1] == "dense-decode" and settings[-1].moba == MobaConfig.preset("training-free")
    assert {s.moba.decode for s in settings[:-1]} == {"moba"}
    k5, k3 = load_settings_file(configs / "sweep_tail_probe.toml")
    assert k5.moba == MobaConfig.preset("training-free") and k3.moba == dataclasses.replace(k5.moba, top_k=3)
