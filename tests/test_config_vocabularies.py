"""The other vocabularies a MoBA config is read in (`moba_hf.config_vocabularies`): server attention files, flat
and nested, as people write and paste them, and the reference MoBA code's names."""

import json
import logging

import pytest

from moba_hf import MobaConfig

SERVER_JSON = {
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
SERVER_TOML = """
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


def test_server_attention_files_load(tmp_path, caplog):
    from moba_hf.config import read_config_file

    (tmp_path / "server.json").write_text(json.dumps(SERVER_JSON))
    (tmp_path / "server.toml").write_text(SERVER_TOML)
    json_settings = read_config_file(tmp_path / "server.json")
    assert json_settings.moba == MobaConfig(block_size=4096, top_k=4, full_attn_layers=2, backend="flash")
    assert json_settings.serving == {"kv_cache_dtype": "bfloat16", "max_context_tokens": 131072}
    toml_settings = read_config_file(tmp_path / "server.toml")
    assert toml_settings.moba == MobaConfig(block_size=4096, top_k=4, full_attn_layers=2)
    assert toml_settings.serving == json_settings.serving
    # a MobaConfig has no place for serving options: from_file returns the MoBA settings of the server file and
    # says once per file that the serving options are the server's; a mapping with them is refused by name
    with caplog.at_level(logging.WARNING, logger="moba_hf"):
        for _ in range(2):
            assert MobaConfig.from_file(tmp_path / "server.json") == json_settings.moba
        assert MobaConfig.from_file(tmp_path / "server.toml") == toml_settings.moba
    told = [r.getMessage() for r in caplog.records if "serving options" in r.getMessage()]
    assert len(told) == 2 and "server.json also holds kv_cache_dtype='bfloat16', max_context_tokens=131072" in told[0]
    assert "MOBA_HF_CONFIG=" in told[0] and "server.toml" in told[1]
    with pytest.raises(ValueError, match="kv_cache_dtype='bfloat16', max_context_tokens=131072: serving options"):
        MobaConfig.from_dict(SERVER_JSON)
    # the reference MoBA code's names
    assert MobaConfig.from_dict({"moba_chunk_size": 256, "moba_topk": 2}) == MobaConfig(block_size=256, top_k=2)


@pytest.mark.parametrize(
    "data,match",
    [
        ({"force_current_block": False}, "force_current_block = false is not possible: MoBA always attends"),
        ({"causal_mask": "false"}, "causal_mask = 'false' is not possible: MoBA attention is causal"),
        ({"causal_mask": "yes"}, r"causal_mask must be true or false \(or the string"),
        ({"attention_type": "linear"}, "attention_type must be 'moba' or 'full'"),
        ({"enable_full_attention_fallback": False, "fallback_layers": 2}, "contradicts enable_full_attention"),
        ({"enable_full_attention_fallback": True}, "needs fallback_layers"),
        ({"flash_attn_version": 3}, "flash_attn_version must be 2"),
        ({"block_size": 64, "moba_chunk_size": 64}, "block_size and moba_chunk_size both set block_size \\(to 64\\)"),
        ({"block_size": 64, "moba_chunk_size": 32}, "block_size = 64 contradicts moba_chunk_size = 32"),
        ({"fallback_layers": 2, "full_attn_layers": 3}, "fallback_layers = 2 contradicts full_attn_layers = 3"),
        ({"moba": 5}, "moba must be a table of settings, got int 5"),
        ({"block_size": 64, "moba": {"top_k": 2}}, r"keys \['block_size'\] sit beside the \[moba\] table"),
        ({"attention": {"type": "moba", "window": 3}}, r"unknown MoBA config keys \['attention.window'\]"),
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


# --- the server vocabulary as people write it -----------------------------------------------------------------
# The deployment guide's JSON as users paste it: the flash-attn version and the KV cache dtype in quotes
PASTED_SERVER_JSON = (
    '{"attention_type": "moba", "block_size": 2048, "top_k_blocks": 3, "force_current_block": true, '
    '"causal_mask": true, "enable_full_attention_fallback": true, "fallback_layers": 2, "score_pooling": "mean", '
    '"flash_attn_version": "2", "kv_cache_dtype": "fp16", "max_context_tokens": 131072}'
)
PASTED_SERVER_TOML = """
[attention]
type = "moba"
block_size = "2048"
top_k_blocks = 3
force_current_block = "true"
causal_mask = true

[attention.fallback]
enabled = true
layers = "2"

[attention.kv_cache]
dtype = "fp16"
max_context_tokens = "131072"
"""


def test_pasted_server_files_load(tmp_path):
    from moba_hf.config import read_config_file

    (tmp_path / "server.json").write_text(PASTED_SERVER_JSON)
    (tmp_path / "server.toml").write_text(PASTED_SERVER_TOML)
    serving = {"kv_cache_dtype": "float16", "max_context_tokens": 131072}  # vLLM's name for the dtype
    settings = read_config_file(tmp_path / "server.json")
    assert settings.moba == MobaConfig(block_size=2048, top_k=3, full_attn_layers=2, backend="flash")
    assert settings.serving == serving
    settings = read_config_file(tmp_path / "server.toml")
    assert settings.moba == MobaConfig(block_size=2048, top_k=3, full_attn_layers=2)
    assert settings.serving == serving


@pytest.mark.parametrize(
    "data,expected",
    [
        ({"block_size": "4096", "top_k": " 4 "}, MobaConfig(block_size=4096, top_k=4)),
        ({"moba_chunk_size": "256", "moba_topk": "2"}, MobaConfig(block_size=256, top_k=2)),
        ({"enable_full_attention_fallback": "TRUE", "fallback_layers": "3"}, MobaConfig(full_attn_layers=3)),
        ({"fallback_layers": ["0", "-1"]}, MobaConfig(full_attn_layer_ids=(0, -1))),
        ({"flash_attn_version": "2"}, MobaConfig(backend="flash")),
        ({"sparse": "false", "dca": "true"}, MobaConfig(sparse=False, dca=True)),
        ({"dca": {"pretraining_length": "4096", "temperature": "true"}},
         MobaConfig(dca={"pretraining_length": 4096, "temperature": True})),
        ({"attention": {"type": "full", "fallback": {"enable": "false", "layers": "0"}}}, MobaConfig(sparse=False)),
    ],
)  # fmt: skip
def test_numbers_and_switches_in_quotes_are_read(data, expected):
    assert MobaConfig.from_dict(data) == expected


@pytest.mark.parametrize(
    "data,match",
    [
        ({"top_k_blocks": "4K"},
         r"top_k_blocks must be an integer \(a number, or digits in quotes like \"2\"\), got '4K'"),
        ({"block_size": "64.0"}, "block_size must be an integer .* got '64.0'"),
        ({"block_size": 64.0}, "block_size must be an integer .* got 64.0"),
        ({"fallback_layers": "two"}, "fallback_layers must be an integer >= 0 .* got 'two'"),
        ({"max_context_tokens": "0"}, "max_context_tokens must be an integer >= 1 .* got '0'"),
        ({"top_k_blocks": 0}, r"top_k must be an integer >= 1, got 0 \(set by top_k_blocks\)"),
        ({"sparse": "no"}, "sparse must be true or false"),
        ({"sparse": 1}, "sparse must be true or false"),
        ({"dca": {"temperature": "on"}}, "temperature must be true or false"),
        ({"flash_attn_version": "3"},
         r"flash_attn_version must be 2 \(the flash backend runs flash-attn 2; the number 2 or \"2\"\), got '3'"),
        ({"flash_attn_version": True}, "flash_attn_version must be 2 .* got True"),
    ],
)  # fmt: skip
def test_values_that_are_not_numbers_are_refused_by_key(data, match):
    with pytest.raises(ValueError, match=match):
        MobaConfig.from_dict(data)


@pytest.mark.parametrize(
    "spelling,name",
    [("fp16", "float16"), ("float16", "float16"), ("half", "float16"), ("FP16", "float16"), ("bf16", "bfloat16"),
     ("bfloat16", "bfloat16"), ("fp32", "float32"), ("float", "float32"), ("auto", "auto")],
)  # fmt: skip
def test_kv_cache_dtype_spellings_are_one_dtype(spelling, name):
    from moba_hf.config import read_config

    assert read_config({"block_size": 64, "kv_cache_dtype": spelling}).serving == {"kv_cache_dtype": name}


def test_kv_cache_dtype_refusal_lists_the_spellings(tmp_path):
    from moba_hf.config import read_config_file

    path = tmp_path / "server.toml"
    path.write_text('[attention.kv_cache]\ndtype = "fp8"\n')
    message = (
        r"server.toml: attention.kv_cache.dtype must be a KV cache dtype the MoBA kernels read \(auto; "
        r"float16 / fp16 / half; bfloat16 / bf16; float32 / fp32 / float\), got 'fp8' \(quantized caches"
    )
    with pytest.raises(ValueError, match=message):
        read_config_file(path)


def test_nested_keys_are_named_by_their_path_and_the_valid_ones_listed():
    with pytest.raises(ValueError, match=r"\['attention.fallback.enabeld'\]; valid keys: .*enable \(or enabled\)"):
        MobaConfig.from_dict({"attention": {"fallback": {"enabeld": True, "layers": 2}}})
    with pytest.raises(ValueError, match=r"attention.fallback must be a table \(\[attention.fallback\]\), got 2"):
        MobaConfig.from_dict({"attention": {"fallback": 2}})


# --- two keys for one setting, and duplicate keys --------------------------------------------------------------
@pytest.mark.parametrize(
    "text,match",
    [
        ('[attention]\nattention_type = "moba"\ntype = "full"\n',
         "attention.attention_type = 'moba' contradicts attention.type = 'full' \\(both set attention_type\\)"),
        ("[attention]\nenable_full_attention_fallback = false\n[attention.fallback]\nenable = true\nlayers = 2\n",
         "attention.enable_full_attention_fallback = false contradicts attention.fallback.enable = true"),
        ("[attention]\nfallback_layers = 0\n[attention.fallback]\nenable = true\nlayers = 3\n",
         "attention.fallback_layers = 0 contradicts attention.fallback.layers = 3 \\(both set fallback_layers\\)"),
        ("[attention.fallback]\nenable = true\nenabled = true\nlayers = 1\n",
         "attention.fallback.enable and attention.fallback.enabled both set enable_full_attention_fallback"),
        ("[attention]\nsparse = true\ntype = 'full'\n", "attention.sparse = true contradicts attention.type = 'full'"),
    ],
)  # fmt: skip
def test_nested_server_file_contradictions_are_refused(tmp_path, text, match):
    path = tmp_path / "server.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=f"server.toml: {match}"):
        MobaConfig.from_file(path)
