"""`MobaConfig`: the one validated, frozen description of how a model attends.

It is stored in ``model.config.moba_config`` as a plain dict, so ``save_pretrained`` writes it to
``config.json`` and ``from_pretrained(..., attn_implementation="moba")`` reads it back. A config file is read by
`config_files` (TOML / JSON / YAML into a dict) and its keys by `config_vocabularies` (ours, a server attention
file's, the reference MoBA code's); `read_config` / `read_config_file` here build the MobaConfig from them.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

# no torch here: reading a config (and `moba-hf presets`) must not load the kernels
from . import config_vocabularies, logs
from .config_files import load_mapping
from .dca.config import DcaConfig, check_block_multiple
from .options import (
    BUILTIN_BACKENDS,
    POOLINGS,
    check_budget_options,
    check_count,
    check_top_p,
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
        """From our keys (top level or under `moba`), a server attention file's keys or the reference MoBA's
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
def _refused(*args: Any, **kwargs: Any) -> None:
    raise TypeError(
        "moba_config is read-only: assign new settings instead, e.g. model.config.moba_config = "
        "{**model.config.moba_config, 'top_k': 4}, or call moba_hf.apply(model, MobaConfig(...))"
    )


class MobaSettings(dict):
    """The settings a model config stores (`MODEL_CONFIG_FIELD`): a plain dict of every MobaConfig field for JSON,
    `print` and `==`, that refuses edits in place. A host resolves the settings once and keeps its answer until a
    new value is assigned (`model.config.moba_config = ...` or `moba_hf.apply`), so an edit in place would
    otherwise go unseen."""

    def __init__(self, settings: Mapping[str, Any]) -> None:
        super().__init__({k: _read_only(v) for k, v in settings.items()})

    __setitem__ = __delitem__ = __ior__ = update = setdefault = pop = popitem = clear = _refused

    def __reduce__(self) -> tuple[Any, ...]:  # pickle rebuilds it whole (never item by item)
        return MobaSettings, (dict(self),)

    def __deepcopy__(self, memo: dict[int, Any]) -> dict[str, Any]:
        # plain: transformers edits its copies (`to_dict`); a copied model config stores it anew on first use
        return {k: copy.deepcopy(v, memo) for k, v in self.items()}


class _ReadOnlyList(list):
    """A list inside `MobaSettings` (`full_attn_layer_ids`): equal to the plain list, refusing edits."""

    def __init__(self, items: Sequence[Any]) -> None:
        super().__init__(_read_only(v) for v in items)

    __setitem__ = __delitem__ = __iadd__ = __imul__ = _refused
    append = extend = insert = pop = remove = clear = sort = reverse = _refused

    def __reduce__(self) -> tuple[Any, ...]:
        return _ReadOnlyList, (list(self),)

    def __deepcopy__(self, memo: dict[int, Any]) -> list[Any]:
        return [copy.deepcopy(v, memo) for v in self]


def _read_only(value: Any) -> Any:
    if isinstance(value, Mapping):
        return MobaSettings(value)
    if isinstance(value, list):
        return _ReadOnlyList(value)
    return value


def _get_settings(model_config: Any) -> Any:
    return vars(model_config).get("moba_config")


def _set_settings(model_config: Any, value: Any) -> None:
    try:
        value = None if value is None else MobaSettings(MobaConfig.from_spec(value).to_dict())
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
    doc="""The MoBA settings a transformers model config carries: a read-only dict of every MobaConfig field
    (`MobaSettings`), or None. A MobaConfig, a mapping, a preset name or a file set here is resolved at once and
    stored as its values, so
    `print(config)` and `save_pretrained` write the settings themselves: a saved checkpoint keeps its attention
    when a preset changes later. `MobaConfig.from_dict(config.moba_config)` gives the MobaConfig. A value that
    does not resolve is kept as given, for the checks of whoever runs the model to refuse by name.""",
)


def _listed(options: Mapping[str, Any]) -> str:
    return ", ".join(f"{key}={value!r}" for key, value in options.items())


# --- reading a config: files (config_files), other vocabularies (config_vocabularies) -------------------
@dataclasses.dataclass(frozen=True)
class ConfigSettings:
    """What a config file or mapping holds: the MobaConfig, any serving options (the server's side, KV cache dtype
    in vLLM's name) and the `[about]` description."""

    moba: MobaConfig
    serving: dict[str, Any]
    about: dict[str, str] = dataclasses.field(default_factory=dict)


def read_config(data: Mapping[str, Any]) -> ConfigSettings:
    """A mapping in any supported vocabulary (ours, a server attention file's, the reference MoBA code's) as a
    MobaConfig plus serving options; every key without a use is refused, and so are two keys that set one thing."""
    found = config_vocabularies.translate(data, MobaConfig)
    try:
        moba = MobaConfig(**found.fields)
    except ValueError as err:  # MobaConfig names its field: say which key of the file set it
        for target, (written, _) in found.given.items():
            if written != target and str(err).startswith(f"{target} "):
                raise ValueError(f"{err} (set by {written})") from None
        raise
    return ConfigSettings(moba, found.serving, found.about)


def read_config_file(path: str | Path) -> ConfigSettings:
    """`read_config` of a file (`load_mapping`: TOML / JSON / YAML); the server plugins read their files this way."""
    data = load_mapping(path)
    try:
        return read_config(data)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
