"""`moba_hf.window`: the positions a model config declares, read from transformers configs and config.json
mappings alike, and what a run past them gets (None, a warning, or PastWindow)."""

import subprocess
import sys

import pytest
from transformers import AutoConfig, GPT2Config

from moba_hf.window import PastWindow, check_positions, model_window

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192,
                  "low_freq_factor": 1.0, "high_freq_factor": 4.0, "rope_theta": 500000.0}  # fmt: skip


@pytest.mark.parametrize(
    "config, expected",
    [
        (AutoConfig.for_model("llama", max_position_embeddings=2048), (2048, "rope", 2048)),
        (AutoConfig.for_model("qwen2"), (32768, "rope", 32768)),
        (AutoConfig.for_model("gptj"), (2048, "rope", 2048)),  # rotary_dim, n_positions
        (
            AutoConfig.for_model("llama", max_position_embeddings=131072, rope_parameters=LLAMA3_SCALING),
            (131072, "rope", 8192),
        ),
        (GPT2Config(n_positions=64), (64, "learned", 64)),
        (AutoConfig.for_model("opt"), (2048, "learned", 2048)),
        ({"n_positions": 64}, (64, "learned", 64)),
        ({"max_position_embeddings": 4096, "rope_theta": 1e4}, (4096, "rope", 4096)),
        ({"model_type": "bloom", "max_position_embeddings": 2048}, (2048, "alibi", 2048)),
        ({"alibi": True, "max_position_embeddings": 2048, "rope_theta": 1e4}, (2048, "alibi", 2048)),  # Falcon
    ],
)
def test_model_window_reads_each_kind_of_position(config, expected):
    window = model_window(config)
    assert (window.positions, window.kind, window.trained) == expected


def test_configs_without_a_window_key_give_none():
    assert model_window(AutoConfig.for_model("bloom")) is None
    assert model_window({"context_length": 4096}) is None
    assert model_window({"max_position_embeddings": True}) is None  # not a count
    assert check_positions({}, 10**6, "x") is None


def test_check_positions_fits_warns_or_refuses():
    llama = AutoConfig.for_model("llama", max_position_embeddings=2048)
    assert check_positions(llama, 2048, "x") is None
    warning = check_positions(llama, 100_008, "--lengths 100000")
    assert warning.startswith(
        "--lengths 100000 uses 100008 positions, past the model's trained window of 2048 positions "
        "(max_position_embeddings); RoPE positions past 2048 were never trained"
    )
    assert "moba:dca-dense" in warning and "RoPE scaling" in warning
    scaled = AutoConfig.for_model("llama", max_position_embeddings=131072, rope_parameters=LLAMA3_SCALING)
    assert check_positions(scaled, 131072, "x") is None  # the scaled window is what the model declares
    assert "(max_position_embeddings; llama3 RoPE scaling of 8192 trained positions)" in check_positions(
        scaled, 200_000, "x"
    )
    assert "ALiBi" in check_positions({"model_type": "bloom", "max_position_embeddings": 2048}, 4096, "x")
    assert check_positions({"n_positions": 64}, 64, "x") is None
    with pytest.raises(PastWindow, match="^x needs 65 positions, but this model has a learned table of 64 positions"):
        check_positions({"n_positions": 64}, 65, "x")
    assert issubclass(PastWindow, ValueError)


def test_window_imports_nothing_heavy():
    code = (
        "import sys, moba_hf.window; print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers'}))"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"
