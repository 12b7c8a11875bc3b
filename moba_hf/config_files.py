"""The strict config file reader: a TOML / JSON / YAML file into a dict, refusing what would be read wrong
(text that is not UTF-8, a key given twice, an empty file) with the file's name. It knows nothing of what the
settings mean: `moba_hf.config` reads MoBA settings from the dict, `moba_hf.train.config` a training run's.
Standard library only (PyYAML when a YAML file is read)."""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

from .options import short


class _Unreadable(ValueError):
    """A file refused while it is parsed (a key given twice, invalid YAML); `load_mapping` adds the file's name."""


def _read_text(path: Path) -> str:
    """The file as UTF-8 text (a UTF-8 byte-order mark is allowed); anything else is refused by name."""
    raw = path.read_bytes()
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise ValueError(
            f"config file {path} is UTF-16 text (it starts with a UTF-16 byte-order mark): save it as UTF-8"
        )
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"config file {path} is not UTF-8 text (byte 0x{raw[err.start]:02x} at offset {err.start}): a config "
            "file is TOML, JSON or YAML saved as UTF-8"
        ) from None
    if "\0" in text:  # TOML, JSON and YAML all forbid it: a binary file, or UTF-16 without a byte-order mark
        raise ValueError(
            f"config file {path} holds NUL bytes (offset {raw.index(0)}): a binary file or UTF-16 text, not a "
            "TOML, JSON or YAML file saved as UTF-8"
        )
    return text


def _json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Unreadable(
                f"key {key!r} appears twice in one JSON object ({short(out[key])}, then {short(value)}); keep one"
            )
        out[key] = value
    return out


@functools.cache
def _yaml_loader() -> type:
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        """safe_load's loader, refusing a key given twice in one mapping (PyYAML keeps the last)."""

        def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: explicit keys may override merged ones
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    repeated = key in seen
                except TypeError:  # an unhashable key: the base class refuses it with its position
                    continue
                line = key_node.start_mark.line + 1
                if repeated:
                    raise _Unreadable(
                        f"key {key!r} appears twice in one YAML mapping (lines {seen[key]} and {line}); keep one"
                    )
                seen[key] = line
            return super().construct_mapping(node, deep)

    return UniqueKeyLoader


def _load_yaml(text: str) -> Any:
    import yaml

    try:
        return yaml.load(text, Loader=_yaml_loader())  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        raise _Unreadable(f"invalid YAML: {err}") from None


def load_mapping(path: str | Path) -> dict[str, Any]:
    """Read a TOML / JSON / YAML file into a dict. Errors name the file; refused: an empty file, text that is not
    UTF-8, a key given twice in one table (TOML refuses it itself), nesting too deep to parse."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    suffix = path.suffix.lower()
    if suffix not in (".toml", ".json", ".yaml", ".yml"):
        raise ValueError(f"config file {path} must end in .toml, .json, .yaml or .yml, got {suffix!r}")
    kind = {".toml": "TOML", ".json": "JSON"}.get(suffix, "YAML")
    try:
        text = _read_text(path)
    except OSError as err:  # a file that exists but cannot be read (permissions, a device error)
        raise ValueError(
            f"config file {path} cannot be read: {err.strerror or err}; make it readable to this process"
        ) from None
    try:
        if suffix == ".toml":
            data = tomllib.loads(text)
        elif suffix == ".json":
            data = json.loads(text, object_pairs_hook=_json_object) if text.strip() else None
        else:
            data = _load_yaml(text)
    except _Unreadable as err:
        raise ValueError(f"{path}: {err}") from None
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: invalid {kind}: {err}") from None
    except RecursionError:
        raise ValueError(f"{path}: nested too deeply to parse as {kind} (settings need at most three levels)") from None
    if not data:
        raise ValueError(f"config file {path} is empty: give settings (or remove the file to use the defaults)")
    if not isinstance(data, Mapping):
        raise ValueError(f"config file {path} must hold a table of settings, got {type(data).__name__}")
    return dict(data)
