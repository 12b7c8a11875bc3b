"""`MobaConfig`: the one validated, frozen description of how a model attends.

It is stored in ``model.config.moba_config`` as a plain dict, so ``save_pretrained`` writes it to
``config.json`` and ``from_pretrained(..., attn_implementation="moba")`` reads it back.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

# no torch here: reading a config (and `moba-hf presets`) must not load the kernels
from . import logs
from .dca.config import DcaConfig, check_block_multiple
from .options import (
    BUILTIN_BACKENDS,
    POOLINGS,
    check_budget_options,
    check_count,
    check_top_p,
    file_bool,
    file_int,
    kv_cache_dtype,
    plain_number,
)

if TYPE_CHECKING:
    from .kernels.plan import BlockPlan


DECODE_MODES = ("moba", "full")
# the fields that take a number (numpy scalars among them are stored as the Python number they equal)
_NUMBER_FIELDS = (
    "block_size", "top_k", "full_attn_layers", "decode_top_k", "sink_blocks", "local_blocks", "top_p", "min_top_k",
    "dense_tail",
)  # fmt: skip


def _check_choice(name: str, value: Any, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")


def _check_backend(value: Any) -> None:
    """A built-in name needs no kernels; any other is checked against the live registry (`register_backend`)."""
    if isinstance(value, str) and value in BUILTIN_BACKENDS:
        return
    from .kernels import BACKENDS

    _check_choice("backend", value, BACKENDS)


@dataclasses.dataclass(frozen=True)
class MobaConfig:
    """How MoBA attends.

    block_size:          keys per block (the last block of a sequence may be shorter).
    top_k:               blocks each query attends, counting its own (current) block; 1 = own block only.
    full_attn_layers:    the last N decoder layers keep full attention (0 = none).
    full_attn_layer_ids: explicit layer indices that keep full attention (alternative to N; negative
                         indices count from the end).
    decode:              what single-token decode steps do: "moba" (sparse) or "full" (dense over the cache).
    decode_top_k:        with decode = "moba" (refused with "full"), the blocks a single-token step attends, counting
                         its own; None: top_k.
                         A decode step reads only its blocks, so a larger budget there costs little next to a
                         prefill's; an answer's later tokens, which no dense tail covers, may need it.
    backend:             kernel backend, see `moba_hf.kernels.BACKENDS`; "auto" picks the fastest available.
    pooling:             how a block's keys are pooled for the gate: "mean" (the paper), "max", or
                         "mean+max" (sum of both scores), or "bound" (Quest's per-channel upper bound of q.k
                         over the block's keys, from each channel's max and min).
    sink_blocks:         always attend the first n blocks, on top of the top_k selection.
    local_blocks:        always attend the n blocks before the current one, on top of the top_k selection.
    top_p:               None: a fixed budget, every query takes its top_k - 1 best earlier blocks. A number
                         in (0, 1]: an adaptive budget, each query takes the fewest best-scoring blocks that,
                         with its sink and local blocks, cover this share of the gate's softmax (score /
                         sqrt(head_dim) over the earlier blocks it may attend), at most top_k counting its own
                         (1.0: the whole mass, i.e. the fixed budget). Measure its sparsity (track_sparsity).
    min_top_k:           with top_p, the fewest blocks each query attends, counting its own (1..top_k; refused
                         without top_p, where it would change nothing).
    dense_tail:          the last n queries of every call that brings more than one new token (a prompt, or a
                         chunk of one) attend every earlier key, densely; the rest of the call stays sparse. The
                         end of a prompt usually holds the question, which needs to see the whole context.
                         Single-token decode steps follow `decode`.
    sparse:              False: every layer attends densely (e.g. DCA alone, without MoBA).
    dca:                 Dual Chunk Attention (`moba_hf.DcaConfig`; True = its defaults; False = off). None: on
                         only if the checkpoint carries Qwen's dual_chunk_attention_config.
    """

    block_size: int = 512
    top_k: int = 3
    full_attn_layers: int = 0
    full_attn_layer_ids: tuple[int, ...] | None = None
    decode: str = "moba"
    decode_top_k: int | None = None
    backend: str = "auto"
    pooling: str = "mean"
    sink_blocks: int = 0
    local_blocks: int = 0
    top_p: float | None = None
    min_top_k: int = 1
    dense_tail: int = 0
    sparse: bool = True
    dca: DcaConfig | bool | None = None

    def __post_init__(self) -> None:
        for name in _NUMBER_FIELDS:  # numpy scalars as Python numbers: the config goes to JSON (config.json)
            object.__setattr__(self, name, plain_number(getattr(self, name)))
        check_count("block_size", self.block_size, 1)
        check_count("top_k", self.top_k, 1)
        check_count("full_attn_layers", self.full_attn_layers, 0)
        check_count("sink_blocks", self.sink_blocks, 0)
        check_count("local_blocks", self.local_blocks, 0)
        check_count("dense_tail", self.dense_tail, 0)
        check_top_p(self.top_p)
        check_count("min_top_k", self.min_top_k, 1)
        check_budget_options(self.top_p, self.min_top_k)
        if self.decode_top_k is not None:
            check_count("decode_top_k", self.decode_top_k, 1)
            if self.decode != "moba":
                raise ValueError(
                    f"decode_top_k is the budget of sparse decode steps: it needs decode='moba', got "
                    f"decode_top_k={self.decode_top_k} with decode={self.decode!r}"
                )
        budget = min(self.top_k, self.decode_top_k or self.top_k)
        if self.min_top_k > budget:
            which = "top_k" if budget == self.top_k else "decode_top_k"
            raise ValueError(f"min_top_k must be between 1 and {which} ({budget}), got {self.min_top_k}")
        _check_choice("decode", self.decode, DECODE_MODES)
        _check_backend(self.backend)
        _check_choice("pooling", self.pooling, POOLINGS)
        if not isinstance(self.sparse, bool):
            raise ValueError(f"sparse must be true or false, got {self.sparse!r}")
        if isinstance(self.dca, Mapping):
            object.__setattr__(self, "dca", DcaConfig.from_dict(self.dca))
        if self.dca is not None and not isinstance(self.dca, (bool, DcaConfig)):
            raise ValueError(f"dca must be a DcaConfig, a mapping, true, false or None, got {self.dca!r}")
        dca = self.dca if isinstance(self.dca, DcaConfig) else None
        if self.sparse and dca is not None and dca.chunk_size is not None:
            limit = dca.pretraining_length or dca.chunk_size + self.block_size + 1
            check_block_multiple(dca.chunk_size, self.block_size, limit)
        if self.full_attn_layer_ids is not None:
            ids = self.full_attn_layer_ids
            if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
                raise ValueError(f"full_attn_layer_ids must be a list of integers, got {ids!r}")
            ids = [plain_number(i) for i in ids]
            for i in ids:
                if isinstance(i, bool) or not isinstance(i, int):
                    raise ValueError(f"full_attn_layer_ids must be a list of integers, got {ids!r}")
            if self.full_attn_layers:
                raise ValueError(
                    "give either full_attn_layers (last N layers) or full_attn_layer_ids (explicit list), "
                    f"not both: got full_attn_layers={self.full_attn_layers}, full_attn_layer_ids={list(ids)}"
                )
            object.__setattr__(self, "full_attn_layer_ids", tuple(ids))

    def plan(self, num_queries: int) -> BlockPlan:
        """The kernels' `BlockPlan` of a call with `num_queries` new queries: a decode step's (one query: the
        `decode_top_k` budget, no dense tail) or a prompt's (`top_k`, `dense_tail`). Built once per config."""
        prompt, step = self._plans
        return step if num_queries == 1 else prompt

    @functools.cached_property  # read by every call; the fields it copies are frozen
    def _plans(self) -> tuple[BlockPlan, BlockPlan]:
        from .kernels.plan import BlockPlan

        gate = (self.pooling, self.sink_blocks, self.local_blocks, self.top_p, self.min_top_k)
        prompt = BlockPlan.build(self.block_size, self.top_k, *gate, dense_tail=self.dense_tail)
        step = dataclasses.replace(prompt, top_k=self.decode_top_k or self.top_k, dense_tail=0)
        return prompt, step

    def tail_queries(self, num_queries: int) -> int:
        """How many of a call's `num_queries` new queries attend densely (`dense_tail`; none in a decode step)."""
        return min(self.plan(num_queries).dense_tail, num_queries)

    # --- which layers are dense -------------------------------------------------------------------
    def full_layer_set(self, num_layers: int) -> frozenset[int]:
        """Indices of the decoder layers that use full attention in a model of `num_layers` layers."""
        if self.full_attn_layer_ids is not None:
            resolved = set()
            for i in self.full_attn_layer_ids:
                if not -num_layers <= i < num_layers:
                    raise ValueError(
                        f"full_attn_layer_ids contains {i}, outside the model's layers "
                        f"[{-num_layers}, {num_layers - 1}]"
                    )
                resolved.add(i % num_layers)
            return frozenset(resolved)
        if self.full_attn_layers > num_layers:
            raise ValueError(
                f"full_attn_layers={self.full_attn_layers} exceeds the model's {num_layers} layers "
                f"(valid range 0..{num_layers})"
            )
        return frozenset(range(num_layers - self.full_attn_layers, num_layers))

    # --- cost -------------------------------------------------------------------------------------
    def theoretical_sparsity(self, seq_len: int) -> float:
        """Fraction of causal query-key pairs a prefill of `seq_len` tokens skips.

        Exact for the block layout (`BlockPlan.attended_pairs`, the count sparsity tracking uses): each query
        attends its own block causally, its sink and local blocks and top_k - 1 other earlier blocks, and the
        last `dense_tail` queries attend every earlier key.
        Full-attention layers are not counted here. With `top_p` this is the fewest pairs skipped (every query
        at its top_k); the adaptive budget's own figure is measured (`moba_hf.track_sparsity`).
        """
        check_count("seq_len", seq_len, 1)
        if not self.sparse:
            return 0.0
        causal_pairs = seq_len * (seq_len + 1) // 2
        return 1.0 - self.plan(seq_len).attended_pairs(seq_len, seq_len) / causal_pairs

    # --- (de)serialisation ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if out["full_attn_layer_ids"] is not None:
            out["full_attn_layer_ids"] = list(out["full_attn_layer_ids"])
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MobaConfig:
        """From our keys (top level or under `moba`), the seed-style server keys or the reference MoBA's
        `moba_chunk_size` / `moba_topk`. Every key is used or refused, and so are two keys for one setting;
        serving options are refused here (`read_config` returns them). As server files write them, integers
        may be digit strings ("2") and switches the strings "true" / "false"; an `about` table (`summary`,
        `measured`, as the presets have) is a description, not a setting."""
        if isinstance(data, MobaConfig):
            return data
        settings = read_config(data)
        if settings.serving:
            raise ValueError(
                f"{_listed(settings.serving)}: serving options, not MoBA settings; the vLLM plugin takes them from "
                "a server file (MOBA_HF_CONFIG), which MobaConfig.from_file reads too, or remove them"
            )
        return settings.moba

    @classmethod
    def from_file(cls, path: str | Path) -> MobaConfig:
        """Load from a .toml, .json or .yaml/.yml file (settings at top level or under a `moba` table). A server
        file's serving options (`kv_cache_dtype`, `max_context_tokens`) are the server's: they are checked, left
        out of the MobaConfig and logged once per file (`read_config_file` returns them)."""
        settings = read_config_file(path)
        if settings.serving:
            where, options = Path(path).resolve(), _listed(settings.serving)
            logs.once(  # from_file may run for every model loaded: once per file and options
                logging.WARNING,
                "moba_hf: %s also holds %s: serving options for the vLLM plugin (MOBA_HF_CONFIG=%s), which a "
                "MobaConfig does not carry; MobaConfig.from_file returns the MoBA settings only (read_config_file "
                "returns both)",
                where,
                options,
                where,
            )
        return settings.moba

    @classmethod
    def preset(cls, name: str) -> MobaConfig:
        """A named preset shipped with the package (`moba-hf presets` lists them), e.g. "training-free". Names
        only: a file is `from_file(path)`, and `from_spec` takes either."""
        from . import presets

        return cls.from_file(presets.path(name))

    @classmethod
    def from_spec(cls, spec: MobaConfig | Mapping[str, Any] | str | Path | None) -> MobaConfig:
        """A MobaConfig, a mapping, a preset name or a config file path (the one entry that takes either: what
        `from_pretrained(..., moba_config=...)`, `moba:...` settings and MOBA_HF_CONFIG go through); None gives
        the defaults."""
        if spec is None:
            return cls()
        if isinstance(spec, MobaConfig):
            return spec
        if isinstance(spec, Mapping):
            return cls.from_dict(spec)
        if isinstance(spec, (str, Path)):
            from . import presets

            if isinstance(spec, str) and spec in presets.names():
                return cls.preset(spec)
            if Path(spec).is_file():
                return cls.from_file(spec)
            raise ValueError(
                f"MoBA config {str(spec)!r} is neither a preset ({', '.join(presets.names())}) nor an existing "
                ".toml / .json / .yaml file"
            )
        raise ValueError(
            f"a MoBA config must be a MobaConfig, a mapping, a preset name or a file path, got {type(spec).__name__}"
        )

    def replace(self, **changes: Any) -> MobaConfig:
        return dataclasses.replace(self, **changes)

    def __str__(self) -> str:
        parts = [f"block_size={self.block_size}", f"top_k={self.top_k}"]
        default = MobaConfig()
        for f in dataclasses.fields(self):
            if f.name not in ("block_size", "top_k") and getattr(self, f.name) != getattr(default, f.name):
                parts.append(f"{f.name}={getattr(self, f.name)}")
        return f"MobaConfig({', '.join(parts)})"


# --- `moba_config` in a model's config ---------------------------------------------------------------------------
def _get_settings(model_config: Any) -> Any:
    return vars(model_config).get("moba_config")


def _set_settings(model_config: Any, value: Any) -> None:
    try:
        value = None if value is None else MobaConfig.from_spec(value).to_dict()
    except ValueError:
        # kept as given: transformers' and vLLM's config loaders set it before moba_hf's checks run, and those
        # refuse it naming where it came from (the first forward, `apply`, the vLLM plugin's setup error)
        pass
    vars(model_config)["moba_config"] = value


def _del_settings(model_config: Any) -> None:
    try:
        del vars(model_config)["moba_config"]
    except KeyError:
        raise AttributeError("moba_config") from None


MODEL_CONFIG_FIELD = property(
    _get_settings,
    _set_settings,
    _del_settings,
    doc="""The MoBA settings a transformers model config carries: a plain dict of every MobaConfig field, or None.
    A MobaConfig, a mapping, a preset name or a file set here is resolved at once and stored as its values, so
    `print(config)` and `save_pretrained` write the settings themselves: a saved checkpoint keeps its attention
    when a preset changes later. `MobaConfig.from_dict(config.moba_config)` gives the MobaConfig. A value that
    does not resolve is kept as given, for the checks of whoever runs the model to refuse by name.""",
)


def _listed(options: Mapping[str, Any]) -> str:
    return ", ".join(f"{key}={value!r}" for key, value in options.items())


class _Unreadable(ValueError):
    """A file refused while it is parsed (a key given twice, invalid YAML); `load_mapping` adds the file's name."""


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


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
                f"key {key!r} appears twice in one JSON object ({_short(out[key])}, then {_short(value)}); keep one"
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


# --- other vocabularies ---------------------------------------------------------------------------
# Seed-style server configs and the reference MoBA code name the same settings differently.
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
SEED_KEYS = ("attention_type", "enable_full_attention_fallback", "fallback_layers", "flash_attn_version")
_NESTED = {  # the nested seed TOML's [attention] table: key path -> flat seed key (other keys: as flat ones)
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
class ConfigSettings:
    """What a config file or mapping holds: the MobaConfig, any serving options (vLLM's side, KV cache dtype
    in vLLM's name) and the `[about]` description."""

    moba: MobaConfig
    serving: dict[str, Any]
    about: dict[str, str] = dataclasses.field(default_factory=dict)


def read_config_file(path: str | Path) -> ConfigSettings:
    """`read_config` of a file (the vLLM plugin reads server configs this way)."""
    data = load_mapping(path)
    try:
        return read_config(data)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None


def _show(value: Any) -> str:
    """A value as the config file writes it (true / false, not Python's True / False)."""
    return str(value).lower() if isinstance(value, bool) else _short(value)


def _clash(first: tuple[str, Any], second: tuple[str, Any], target: str) -> None:
    (a, va), (b, vb) = first, second
    if type(va) is type(vb) and va == vb:
        raise ValueError(f"{a} and {b} both set {target} (to {_show(va)}); keep one")
    raise ValueError(f"{a} = {_show(va)} contradicts {b} = {_show(vb)} (both set {target}); keep one")


def _read_about(value: Any) -> dict[str, str]:
    keys = " and ".join(ABOUT_KEYS)
    if not isinstance(value, Mapping):
        raise ValueError(f"about must be a table ([about] with {keys}), got {_short(value)}")
    extra = sorted(set(value) - set(ABOUT_KEYS))
    if extra:
        raise ValueError(
            f"[about] takes only {keys} (text describing the settings, as the presets have), got "
            f"{['about.' + str(k) for k in extra]}: settings go in the [moba] table"
        )
    for key, text in value.items():
        if not isinstance(text, str):
            raise ValueError(f"about.{key} must be text, got {_short(text)}")
    return dict(value)


def _attention_entries(table: Any) -> tuple[dict[str, tuple[str, Any]], list[str]]:
    """The nested seed [attention] table as flat seed keys -> (key as written, value), and its unknown keys."""
    if not isinstance(table, Mapping):
        raise ValueError(f"the [attention] table must be a table of settings, got {_short(table)}")
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
                raise ValueError(f"attention.{key} must be a table ([attention.{key}]), got {_short(value)}")
            for sub, inner in value.items():
                add((key, sub), inner)
        else:
            add((key,), value)
    return entries, unknown


def _no_settings(table: str | None, about: Mapping[str, str], entries: Mapping[str, Any]) -> str:
    """The refusal of a config that names no MoBA setting (it would run the defaults without a word)."""
    where = f"the [{table}] table" if table is not None else "the config"
    if entries:
        what = f"{where} holds only serving options ({', '.join(sorted(entries))})"
    elif table is not None:
        what = f"{where} is empty"
    else:
        what = f"{where} holds only an [about] description" if about else f"{where} holds no settings"
    return (
        f"{what}: no MoBA setting, so the defaults ({MobaConfig()}) would run without a word; give the settings "
        "(block_size, top_k, ...; `moba-hf presets NAME` prints a complete file), e.g. block_size = 512 and "
        "top_k = 3 for the defaults"
    )


def _valid_keys() -> str:
    fields = sorted(f.name for f in dataclasses.fields(MobaConfig))
    seed = sorted((*ALIASES, *ALWAYS_TRUE, *SERVING_KEYS, *SEED_KEYS))
    return (
        f"MobaConfig's {fields}; the seed server format's {seed}, or nested: [attention] type and the keys above, "
        "[attention.fallback] enable (or enabled) and layers, [attention.kv_cache] dtype and max_context_tokens"
    )


def _integer(written: str, value: Any, low: int | None = None) -> int:
    number = file_int(value)
    if isinstance(number, bool) or not isinstance(number, int) or (low is not None and number < low):
        bound = f" >= {low}" if low is not None else ""
        raise ValueError(
            f'{written} must be an integer{bound} (a number, or digits in quotes like "2"), got {_short(value)}'
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


def read_config(data: Mapping[str, Any]) -> ConfigSettings:
    """Map any supported vocabulary to a MobaConfig plus serving options; refuse every key without a use, and
    two keys that set the same thing."""
    if not isinstance(data, Mapping):
        raise ValueError(f"a MoBA config must be a table of settings, got {type(data).__name__} {_short(data)}")
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
                    raise ValueError(f"moba must be a table of settings, got {type(inner).__name__} {_short(inner)}")
                entries = {key: (key, value) for key, value in inner.items()}
            else:
                entries, unknown = _attention_entries(inner)
    known = {f.name: f for f in dataclasses.fields(MobaConfig)}
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
                raise ValueError(f"{written} must be 'moba' or 'full', got {_short(value)}")
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
                    f"got {_short(value)}"
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
        raise ValueError(f"unknown MoBA config keys {sorted(unknown)}; valid keys: {_valid_keys()}")
    if given_anything and set(entries) <= set(SERVING_KEYS):
        raise ValueError(_no_settings(used_table, about, entries))
    if fallback_enabled and "full_attn_layers" not in fields and "full_attn_layer_ids" not in fields:
        raise ValueError(f"{switch[0]} = true needs fallback_layers (how many last layers are dense)")
    if isinstance(fields.get("pooling"), str) and fields["pooling"] == "avg":
        fields["pooling"] = "mean"
    try:
        moba = MobaConfig(**fields)
    except ValueError as err:  # MobaConfig names its field: say which key of the file set it
        for target, (written, _) in given.items():
            if written != target and str(err).startswith(f"{target} "):
                raise ValueError(f"{err} (set by {written})") from None
        raise
    return ConfigSettings(moba, serving, about)
