"""The strict config file reader (`moba_hf.config_files`): keys given twice, text that is not UTF-8, nesting too
deep; each refusal names the file."""

import pytest

from moba_hf import MobaConfig


# --- duplicate keys ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name,text,match",
    [
        ("dup.json", '{"block_size": 64, "block_size": 128}',
         r"dup.json: key 'block_size' appears twice in one JSON object \(64, then 128\)"),
        ("dup.json", '{"moba": {"top_k": 2, "dca": {"chunk_size": 8, "chunk_size": 16}}}', "key 'chunk_size' appears"),
        ("dup.yaml", "block_size: 64\ntop_k: 2\nblock_size: 128\n",
         r"dup.yaml: key 'block_size' appears twice in one YAML mapping \(lines 1 and 3\)"),
        ("dup.yml", "moba:\n  top_k: 2\n  top_k: 3\n", r"dup.yml: key 'top_k' appears twice .* \(lines 2 and 3\)"),
        ("dup.toml", "block_size = 64\nblock_size = 128\n", "dup.toml: invalid TOML"),
    ],
)  # fmt: skip
def test_duplicate_keys_are_refused(tmp_path, name, text, match):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        MobaConfig.from_file(path)


def test_yaml_merge_keys_may_be_overridden(tmp_path):
    path = tmp_path / "merge.yaml"
    path.write_text("base: &base {block_size: 64, top_k: 2}\nmoba:\n  <<: *base\n  top_k: 4\n")
    from moba_hf.config_files import load_mapping

    assert load_mapping(path)["moba"] == {"block_size": 64, "top_k": 4}


# --- files that are not text, or too deep --------------------------------------------------------------------
@pytest.mark.parametrize(
    "name,content,match",
    [
        ("utf16.toml", "block_size = 64\n".encode("utf-16"), "utf16.toml is UTF-16 text .*: save it as UTF-8"),
        ("utf16.json", '{"block_size": 64}'.encode("utf-16-le"), "utf16.json holds NUL bytes .* UTF-16 text"),
        ("binary.yaml", b"\x89PNG\r\n\x1a\n\x00\x00", r"binary.yaml is not UTF-8 text \(byte 0x89 at offset 0\)"),
        ("latin1.toml", 'name = "caf\xe9"\n'.encode("latin-1"),
         r"latin1.toml is not UTF-8 text \(byte 0xe9 at offset 11\)"),
        ("deep.json", b"[" * 100_000 + b"]" * 100_000, "deep.json: nested too deeply to parse as JSON"),
        ("deep.yaml", b"[" * 100_000 + b"]" * 100_000, "deep.yaml: nested too deeply to parse as YAML"),
        ("deep.toml", b"a = " + b"[" * 100_000 + b"]" * 100_000, "deep.toml: nested too deeply to parse as TOML"),
    ],
)  # fmt: skip
def test_unreadable_files_name_the_file(tmp_path, name, content, match):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ValueError, match=match):
        MobaConfig.from_file(path)


def test_utf8_byte_order_mark_is_read(tmp_path):
    path = tmp_path / "bom.json"
    path.write_bytes('{"block_size": 64}'.encode("utf-8-sig"))
    assert MobaConfig.from_file(path) == MobaConfig(block_size=64)
