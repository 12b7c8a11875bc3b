"""Attention settings to compare, and switching one loaded model between them.

A setting is written on the command line as

    sdpa | eager | <any transformers attn_implementation>     dense attention
    moba                                                       the checkpoint's moba_config (or the defaults)
    moba:paper-8k                                              a named preset (`moba-hf presets`)
    moba:my_moba.toml                                          a MobaConfig file (.toml / .json / .yaml)
    moba:block_size=64,top_k=16,full_attn_layers=3             inline MobaConfig fields
    b64-k12-f3                                                 a setting of the sweep's grid, by name
    NAME=<any of the above>                                    the same, reported under NAME

or listed in a TOML file (`load_settings_file`):

    [[setting]]
    name = "moba-64x16"                  # optional
    attn = "moba"                        # optional when `moba` is given
    moba = { block_size = 64, top_k = 16 }   # or a preset / a path: moba = "paper-8k"
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import difflib
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ..config import MobaConfig, load_mapping
from ..integration import apply, revert

MOBA = "moba"


# grid names: a field's first word, unless misleading
_SHORT = {"dense_tail": "tail", "full_attn_layer_ids": "dense", "top_p": "p", "min_top_k": "min"}


def _short_value(value: Any) -> str:
    return "+".join(map(str, value)) if isinstance(value, tuple) else str(value)


_TRAINING_FREE_GATE = {"pooling": "bound", "sink_blocks": 1, "local_blocks": 1}


def _sweep_grid() -> dict[str, MobaConfig]:
    """The training-free sweep's named MoBA settings; budgets around 70-80% sparsity at 8K, plus the paper's."""
    grid = {}
    for bs, k, full, extra in [
        (512, 3, 0, {}),
        (512, 3, 3, {}),
        (512, 3, 0, {"pooling": "bound"}),
        (256, 4, 3, {}),
        (128, 6, 3, {}),
        (128, 8, 3, {}),
        (64, 12, 3, {}),
        (64, 16, 3, {}),
        (32, 24, 3, {}),
        (32, 32, 3, {}),
        (64, 12, 0, {}),
        (64, 12, 3, {"sink_blocks": 1}),
        (64, 12, 3, {"local_blocks": 1}),
        (64, 12, 3, {"sink_blocks": 1, "local_blocks": 1}),
        (64, 12, 3, {"pooling": "max"}),
        (64, 12, 3, {"pooling": "mean+max"}),
        (64, 12, 3, {"pooling": "mean+max", "sink_blocks": 1, "local_blocks": 1}),
        (64, 12, 3, {"pooling": "bound"}),
        (64, 12, 3, {"pooling": "bound", "sink_blocks": 1, "local_blocks": 1}),
        (128, 6, 3, {"sink_blocks": 1, "local_blocks": 1}),
        (32, 24, 3, {"pooling": "mean+max", "sink_blocks": 1, "local_blocks": 1}),
        (32, 24, 0, {"sink_blocks": 1, "local_blocks": 1}),
        # the question densely: the training-free gate with a dense tail, at the preset's budget and at >= 70%
        (64, 12, 3, {**_TRAINING_FREE_GATE, "dense_tail": 64}),
        (64, 6, 2, {**_TRAINING_FREE_GATE, "dense_tail": 64}),
        (64, 6, 0, {**_TRAINING_FREE_GATE, "dense_tail": 64}),
        (64, 7, 0, {**_TRAINING_FREE_GATE, "dense_tail": 64}),
        (64, 4, 0, {**_TRAINING_FREE_GATE, "dense_tail": 128}),
        # the first two layers dense: what kept the prose needles at 8K (more blocks or a longer dense tail did not)
        (64, 5, 0, {"full_attn_layer_ids": (0, 1), **_TRAINING_FREE_GATE, "dense_tail": 64}),
        # decode in the choice: that shape with dense decode steps, and with an adaptive budget (top_p) instead
        (64, 5, 0, {"full_attn_layer_ids": (0, 1), **_TRAINING_FREE_GATE, "dense_tail": 64, "decode": "full"}),
        (
            64,
            12,
            0,
            {"full_attn_layer_ids": (0, 1), **_TRAINING_FREE_GATE, "dense_tail": 64, "top_p": 0.8, "min_top_k": 3},
        ),
    ]:
        name = f"b{bs}-k{k}-f{full}" + "".join(
            f"-{_SHORT.get(key, key.split('_')[0])}{_short_value(v)}" for key, v in extra.items()
        )
        grid[name] = MobaConfig(block_size=bs, top_k=k, full_attn_layers=full, **extra)
    return grid


SWEEP_GRID: dict[str, MobaConfig] = _sweep_grid()


@dataclasses.dataclass(frozen=True)
class Setting:
    """One attention setting: `attn` is a transformers attn_implementation; `moba` its MobaConfig when attn is
    "moba" (None there means the checkpoint's own moba_config or the defaults)."""

    name: str
    attn: str = "sdpa"
    moba: MobaConfig | None = None

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"setting name must be a non-empty string, got {self.name!r}")
        if self.moba is not None and self.attn != MOBA:
            raise ValueError(f"setting {self.name!r}: a MobaConfig needs attn='moba', got attn={self.attn!r}")

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "attn": self.attn, "moba": self.moba.to_dict() if self.moba else None}


SettingLike = Setting | str | tuple[str, MobaConfig | None]


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets: `a=1,b=[1,2]` -> ['a=1', 'b=[1,2]']."""
    parts, depth, current = [], 0, []
    for char in text:
        if char in "[(":
            depth += 1
        elif char in "])":
            depth -= 1
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    parts.append("".join(current))
    return [p.strip() for p in parts if p.strip()]


def _literal(value: str) -> Any:
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return value  # bare words such as pooling=max


def parse_inline(text: str) -> MobaConfig:
    """`block_size=64,top_k=16` -> MobaConfig(block_size=64, top_k=16)."""
    fields: dict[str, Any] = {}
    for part in _split_top_level(text):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"inline MoBA settings must be key=value pairs joined by commas, got {part!r} in {text!r}")
        fields[key.strip()] = _literal(value.strip())
    return MobaConfig.from_dict(fields)


def _auto_name(attn: str, moba: MobaConfig | None, source: str, inline: bool = False) -> str:
    """The reported name: `attn` for dense, a file's stem or a preset's name, `moba(k=v,...)` for inline fields
    (whole: a value such as top_p=0.5 holds a dot that is not a file suffix)."""
    if moba is None:
        return attn
    if inline:
        return f"moba({source})"
    return Path(source).stem if source else "moba"


def attn_names() -> list[str]:
    """The attn_implementation names transformers accepts here ("moba" included); a hub kernel ("org/name")
    and a `paged|` prefix are accepted besides."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from ..integration import register

    register()
    return sorted({"eager", *ALL_ATTENTION_FUNCTIONS.valid_keys()})


def suggestion(word: str, choices: Iterable[str]) -> str:
    """ "; did you mean 'x'?" for the closest of `choices` (difflib), or "" when none is close."""
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def check_attn(attn: str) -> None:
    """Refuse an attention name transformers would refuse once the model is loaded (ValueError naming the
    accepted names, with the closest one)."""
    known = attn_names()
    if attn in known or "/" in attn or attn.removeprefix("paged|") in known:
        return
    raise ValueError(
        f"unknown attention {attn!r}{suggestion(attn, [*known, *SWEEP_GRID])} (accepted: {', '.join(known)}, "
        "moba:PRESET, moba:FILE, moba:key=value,..., a sweep grid name, or a hub kernel org/name)"
    )


def _from_spec(spec: str) -> MobaConfig:
    """MobaConfig.from_spec, its refusal of a mistyped preset name ending with the closest preset."""
    from .. import presets

    try:
        return MobaConfig.from_spec(spec)
    except ValueError as error:
        if Path(spec).suffix or any(sep in spec for sep in "/\\") or "did you mean" in str(error):
            raise
        raise ValueError(f"{error}{suggestion(spec, presets.names())}") from None


def parse_setting(spec: SettingLike) -> Setting:
    """A Setting from a command-line string, a (name, MobaConfig | None) pair (None = sdpa), or a Setting."""
    if isinstance(spec, Setting):
        return spec
    if isinstance(spec, tuple):
        if len(spec) != 2:
            raise ValueError(f"a setting pair must be (name, MobaConfig | None), got {spec!r}")
        name, moba = spec
        if moba is None:
            return Setting(name, "sdpa", None)
        return Setting(name, MOBA, MobaConfig.from_dict(moba) if not isinstance(moba, MobaConfig) else moba)
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"setting must be e.g. 'sdpa', 'moba:paper-8k' or 'moba:top_k=4', got {spec!r}")
    spec = spec.strip()
    name = None
    match = re.match(r"^([\w.\-+]+)=(.+)$", spec)
    if match:
        name, spec = match.group(1), match.group(2)
    attn, sep, rest = spec.partition(":")
    if not sep:
        if attn in SWEEP_GRID:
            return Setting(name or attn, MOBA, SWEEP_GRID[attn])
        check_attn(attn)
        return Setting(name or attn, attn, None)
    if attn != MOBA:
        raise ValueError(f"only 'moba' takes options after ':'; got setting {spec!r}{suggestion(attn, [MOBA])}")
    # key=value pairs inline; otherwise a preset name or a config file
    inline = "=" in rest and not Path(rest).is_file()
    moba = parse_inline(rest) if inline else _from_spec(rest)
    return Setting(name or _auto_name(attn, moba, rest, inline), MOBA, moba)


def load_settings_file(path: str | Path) -> list[Setting]:
    """Settings listed as [[setting]] tables in a TOML / JSON / YAML file (see the module docstring)."""
    data = load_mapping(path)
    rows = data.get("setting", data.get("settings"))
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"settings file {path} must list settings as [[setting]] tables, got keys {sorted(data)}")
    settings = []
    for i, row in enumerate(rows):
        if isinstance(row, str):
            settings.append(parse_setting(row))
            continue
        unknown = sorted(set(row) - {"name", "attn", "moba"})
        if unknown:
            raise ValueError(f"settings file {path}, setting #{i}: unknown keys {unknown}; valid: attn, moba, name")
        moba_raw = row.get("moba")
        attn = row.get("attn", MOBA if moba_raw is not None else "sdpa")
        source = ""
        if isinstance(moba_raw, str):
            source = moba_raw
            beside = Path(path).parent / moba_raw  # a file relative to the settings file
            relative = not Path(moba_raw).is_absolute() and not Path(moba_raw).is_file() and beside.is_file()
            moba = MobaConfig.from_spec(beside) if relative else _from_spec(moba_raw)
        elif moba_raw is not None:
            moba = MobaConfig.from_dict(moba_raw)
            source = ",".join(f"{k}={v}" for k, v in moba_raw.items())
        else:
            moba = None
        if attn != MOBA:
            check_attn(attn)
        inline = moba_raw is not None and not isinstance(moba_raw, str)
        settings.append(Setting(row.get("name") or _auto_name(attn, moba, source, inline), attn, moba))
    return settings


def resolve_settings(specs: Iterable[SettingLike] | None) -> list[Setting]:
    """Parse a list of settings (default: sdpa only) and check that their names are unique."""
    settings = [parse_setting(s) for s in (specs if specs is not None else ["sdpa"])]
    if not settings:
        raise ValueError("settings must list at least one attention setting, got an empty list")
    names = [s.name for s in settings]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"setting names must be unique, got {duplicates} more than once (name them NAME=spec)")
    return settings


def setting_args(values: Sequence[str] | None, files: Sequence[str] | None = None) -> list[Setting]:
    """Command-line helper: --attn values plus settings files; a --attn value ending in .toml is a file."""
    specs: list[SettingLike] = []
    for value in values or []:
        if value.endswith((".toml", ".json", ".yaml", ".yml")) and ":" not in value and "=" not in value:
            specs.extend(load_settings_file(value))
        else:
            specs.append(value)
    for path in files or []:
        specs.extend(load_settings_file(path))
    return resolve_settings(specs or None)


@contextlib.contextmanager
def use_setting(model: Any, setting: Setting) -> Iterator[Any]:
    """Switch `model` to `setting` for the block and back afterwards (no reload)."""
    if setting.attn == MOBA:
        apply(model, setting.moba)
        try:
            yield model
        finally:
            revert(model)
        return
    previous = model.config._attn_implementation
    model.set_attn_implementation(setting.attn)
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)
