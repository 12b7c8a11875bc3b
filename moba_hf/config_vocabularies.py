"""The other vocabularies a MoBA config may be written in, translated to MobaConfig's fields.

Server attention files (flat JSON / TOML, or the nested `[attention]` table with `[attention.fallback]` and
`[attention.kv_cache]`) and the reference MoBA code (`moba_chunk_size`, `moba_topk`) name the same settings
differently: `translate` reads any of them, and our own keys, into MobaConfig keywords, the serving options (the
server's: KV cache dtype, context length) and the `[about]` description. Every key is used or refused by name,
and so are two keys for one setting. Standard library only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from .options import file_bool, file_int, kv_cache_dtype, short

# Server attention files and the reference MoBA code name the same settings differently.
ALIASES = {
    "top_k_blocks": "top_k",
    "moba_topk": "top_k",
    "moba_chunk_size": "block_size",
    "score_pooling": "pooling",
}
# MoBA always attends the current block, causally: these may only say so.
ALWAYS_TRUE = {
    "force_current_block": "MoBA always attends the query's own block",
    "causal_mask": "MoBA attention is causal (a query never sees a later key)",
}
SERVING_KEYS = ("kv_cache_dtype", "max_context_tokens")
SERVER_KEYS = ("attention_type", "enable_full_attention_fallback", "fallback_layers", "flash_attn_version")
_NESTED = {  # the nested [attention] table: key path -> its flat key (other keys: as flat ones)
    ("type",): "attention_type",
    ("fallback", "enable"): "enable_full_attention_fallback",
    ("fallback", "enabled"): "enable_full_attention_fallback",
    ("fallback", "layers"): "fallback_layers",
    ("kv_cache", "dtype"): "kv_cache_dtype",
    ("kv_cache", "max_context_tokens"): "max_context_tokens",
}
_SUBTABLES = ("fallback", "kv_cache")
# a description beside the settings, as each preset has: read (and checked), never a setting
ABOUT_KEYS = ("summary", "measured")


@dataclasses.dataclass(frozen=True)
class Translation:
    """A config mapping in MobaConfig's terms."""

    fields: dict[str, Any]  # MobaConfig keyword -> value
    given: dict[str, tuple[str, Any]]  # MobaConfig keyword -> (key as written, value as written)
    serving: dict[str, Any]  # serving option -> value (KV cache dtype in vLLM's name)
    about: dict[str, str]  # the [about] description


def _show(value: Any) -> str:
    """A value as the config file writes it (true / false, not Python's True / False)."""
    return str(value).lower() if isinstance(value, bool) else short(value)


def _clash(first: tuple[str, Any], second: tuple[str, Any], target: str) -> None:
    (a, va), (b, vb) = first, second
    if type(va) is type(vb) and va == vb:
        raise ValueError(f"{a} and {b} both set {target} (to {_show(va)}); keep one")
    raise ValueError(f"{a} = {_show(va)} contradicts {b} = {_show(vb)} (both set {target}); keep one")


def _read_about(value: Any) -> dict[str, str]:
    keys = " and ".join(ABOUT_KEYS)
    if not isinstance(value, Mapping):
        raise ValueError(f"about must be a table ([about] with {keys}), got {short(value)}")
    extra = sorted(set(value) - set(ABOUT_KEYS))
    if extra:
        raise ValueError(
            f"[about] takes only {keys} (text describing the settings, as the presets have), got "
            f"{['about.' + str(k) for k in extra]}: settings go in the [moba] table"
        )
    for key, text in value.items():
        if not isinstance(text, str):
            raise ValueError(f"about.{key} must be text, got {short(text)}")
    return dict(value)


def _attention_entries(table: Any) -> tuple[dict[str, tuple[str, Any]], list[str]]:
    """The nested [attention] table as flat server keys -> (key as written, value), and its unknown keys."""
    if not isinstance(table, Mapping):
        raise ValueError(f"the [attention] table must be a table of settings, got {short(table)}")
    entries: dict[str, tuple[str, Any]] = {}
    unknown: list[str] = []

    def add(here: tuple[str, ...], value: Any) -> None:
        written = ".".join(("attention", *here))
        flat = _NESTED.get(here, here[0] if len(here) == 1 else None)
        if flat is None:
            unknown.append(written)
        elif flat in entries:
            _clash(entries[flat], (written, value), flat)
        else:
            entries[flat] = (written, value)

    for key, value in table.items():
        if key in _SUBTABLES:
            if not isinstance(value, Mapping):
                raise ValueError(f"attention.{key} must be a table ([attention.{key}]), got {short(value)}")
            for sub, inner in value.items():
                add((key, sub), inner)
        else:
            add((key,), value)
    return entries, unknown


def _no_settings(schema: type, table: str | None, about: Mapping[str, str], entries: Mapping[str, Any]) -> str:
    """The refusal of a config that names no MoBA setting (it would run the defaults without a word)."""
    where = f"the [{table}] table" if table is not None else "the config"
    if entries:
        what = f"{where} holds only serving options ({', '.join(sorted(entries))})"
    elif table is not None:
        what = f"{where} is empty"
    else:
        what = f"{where} holds only an [about] description" if about else f"{where} holds no settings"
    return (
        f"{what}: no MoBA setting, so the defaults ({schema()}) would run without a word; give the settings "
        "(block_size, top_k, ...; `moba-hf presets NAME` prints a complete file), e.g. block_size = 512 and "
        "top_k = 3 for the defaults"
    )


def _valid_keys(schema: type) -> str:
    fields = sorted(f.name for f in dataclasses.fields(schema))
    others = sorted((*ALIASES, *ALWAYS_TRUE, *SERVING_KEYS, *SERVER_KEYS))
    return (
        f"{schema.__name__}'s {fields}; the server attention files' {others}, or nested: [attention] type and the "
        "keys above, "
        "[attention.fallback] enable (or enabled) and layers, [attention.kv_cache] dtype and max_context_tokens"
    )


def _integer(written: str, value: Any, low: int | None = None) -> int:
    number = file_int(value)
    if isinstance(number, bool) or not isinstance(number, int) or (low is not None and number < low):
        bound = f" >= {low}" if low is not None else ""
        raise ValueError(
            f'{written} must be an integer{bound} (a number, or digits in quotes like "2"), got {short(value)}'
        )
    return number


def _field_value(field: dataclasses.Field, written: str, value: Any) -> Any:
    """A file's value for a MobaConfig field: integers may come as digit strings, booleans as "true" / "false"."""
    if field.type == "int" or (field.type == "int | None" and value is not None):
        return _integer(written, value)
    if field.type == "bool" or (field.name == "dca" and isinstance(value, str)):
        return file_bool(written, value)
    if field.name == "full_attn_layer_ids" and isinstance(value, (list, tuple)):
        return [file_int(i) for i in value]
    return value


def translate(data: Mapping[str, Any], schema: type) -> Translation:
    """Map any supported vocabulary to the keywords of `schema` (MobaConfig, which calls this: it is passed in,
    as this module sits below it) plus serving options and the description; refuse every key without a use, and
    two keys that set the same thing. The keywords are not yet checked together: `schema(**fields)` does that."""
    if not isinstance(data, Mapping):
        raise ValueError(f"a MoBA config must be a table of settings, got {type(data).__name__} {short(data)}")
    data = dict(data)
    given_anything = bool(data)  # {}: no changes, the defaults; a table without settings is refused below
    about = _read_about(data.pop("about")) if "about" in data else {}
    entries = {key: (key, value) for key, value in data.items()}
    unknown: list[str] = []
    used_table = None
    for table in ("moba", "attention"):
        if table in data:
            used_table = table
            rest = sorted(set(data) - {table})
            if rest:
                raise ValueError(
                    f"keys {rest} sit beside the [{table}] table and would be ignored: move them into [{table}] "
                    "or remove them"
                )
            inner = data[table]
            if table == "moba":
                if not isinstance(inner, Mapping):
                    raise ValueError(f"moba must be a table of settings, got {type(inner).__name__} {short(inner)}")
                entries = {key: (key, value) for key, value in inner.items()}
            else:
                entries, unknown = _attention_entries(inner)
    known = {f.name: f for f in dataclasses.fields(schema)}
    fields: dict[str, Any] = {}
    given: dict[str, tuple[str, Any]] = {}  # MobaConfig field -> (key as written, value as written)
    serving: dict[str, Any] = {}
    switch = entries.get("enable_full_attention_fallback")
    fallback_enabled = None if switch is None else file_bool(switch[0], switch[1])
    for flat, (written, raw) in entries.items():
        value = raw
        if flat in known:
            target = flat
        elif flat in ALIASES:
            target = ALIASES[flat]
        elif flat in ALWAYS_TRUE:
            if file_bool(written, value) is not True:
                raise ValueError(
                    f"{written} = {_show(value)} is not possible: {ALWAYS_TRUE[flat]}; it may only be true"
                )
            continue
        elif flat == "kv_cache_dtype":
            serving[flat] = kv_cache_dtype(value, written)
            continue
        elif flat == "max_context_tokens":
            serving[flat] = _integer(written, value, 1)
            continue
        elif flat == "attention_type":
            if value not in ("moba", "full"):
                raise ValueError(f"{written} must be 'moba' or 'full', got {short(value)}")
            target, value = "sparse", value == "moba"
        elif flat == "enable_full_attention_fallback":
            continue  # read with fallback_layers
        elif flat == "fallback_layers":
            if isinstance(value, (list, tuple)):
                target, value = "full_attn_layer_ids", [file_int(i) for i in value]
            else:
                target, value = "full_attn_layers", _integer(written, value, 0)
            if fallback_enabled is False and value:
                raise ValueError(
                    f"{written} = {_show(raw)} contradicts {switch[0]} = false: set it true, or {written} = 0"
                )
        elif flat == "flash_attn_version":
            if isinstance(value, bool) or file_int(value) != 2:
                raise ValueError(
                    f'{written} must be 2 (the flash backend runs flash-attn 2; the number 2 or "2"), '
                    f"got {short(value)}"
                )
            target, value = "backend", "flash"
        else:
            unknown.append(written)
            continue
        if target in given:
            _clash(given[target], (written, raw), target)
        fields[target] = _field_value(known[target], written, value)
        given[target] = (written, raw)
    if unknown:
        raise ValueError(f"unknown MoBA config keys {sorted(unknown)}; valid keys: {_valid_keys(schema)}")
    if given_anything and set(entries) <= set(SERVING_KEYS):
        raise ValueError(_no_settings(schema, used_table, about, entries))
    if fallback_enabled and "full_attn_layers" not in fields and "full_attn_layer_ids" not in fields:
        raise ValueError(f"{switch[0]} = true needs fallback_layers (how many last layers are dense)")
    if isinstance(fields.get("pooling"), str) and fields["pooling"] == "avg":
        fields["pooling"] = "mean"
    return Translation(fields, given, serving, about)
