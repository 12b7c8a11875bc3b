"""The positions a model config declares, and what a run past them gets (read from the config alone).

    window = model_window(model.config)          # or a config.json dict
    note = check_positions(model.config, 100_008, "--lengths 100000")   # None, a warning, or PastWindow

Three kinds of positions, told apart by the config's keys:

    rope     rotary positions (rope_parameters / rope_scaling / rope_theta / rotary_dim ...): any length runs,
             but positions past `max_position_embeddings` were never trained: a warning that points to DCA
             (which keeps every distance inside the window) or RoPE scaling
    alibi    linear biases (`alibi = true`, bloom, MPT's attn_config): no table; a warning past the window
    learned  a table of `positions` rows and no RoPE (GPT-2's n_positions, OPT): nothing past it exists, and
             neither DCA nor RoPE scaling applies, so a longer run is refused (PastWindow, a ValueError)

A config with no window key at all (recurrent models, RWKV's context_length) gives None: nothing to check.
No transformers import: eval, train and the command line call it before a model loads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

ROPE_KEYS = ("rope_parameters", "rope_scaling", "rope_theta", "rotary_dim", "rotary_pct", "rotary_emb_base")
WINDOW_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "max_sequence_length", "n_ctx")
ALIBI_MODEL_TYPES = ("bloom",)  # ALiBi without a config flag

DCA_HINT = (
    "read past it with DCA (a `moba:dca-dense` or `moba:dca-moba` setting, or a [moba.dca] table in a MoBA config, "
    "which keeps every query-key distance inside the window) or with RoPE scaling (rope_scaling in the model's "
    "config.json)"
)


class PastWindow(ValueError):
    """A run needs positions the model does not have (past a learned position table)."""


def _get(config: Any, key: str) -> Any:
    return config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)


@dataclasses.dataclass(frozen=True)
class Window:
    """positions: how many positions the config declares (under `key`); kind: rope / alibi / learned (see the
    module docstring); trained: the positions before RoPE scaling stretched them (original_max_position_embeddings),
    else `positions`; rope_type: the RoPE scaling type ("default" without one), None without RoPE."""

    positions: int
    key: str
    kind: str
    trained: int
    rope_type: str | None = None

    def describe(self) -> str:
        """'2048 positions (max_position_embeddings)', with the RoPE scaling that stretched them when there is one."""
        text = f"{self.positions} positions ({self.key}"
        if self.trained != self.positions:
            text += f"; {self.rope_type} RoPE scaling of {self.trained} trained positions"
        return text + ")"


def _rope_params(config: Any) -> dict[str, Any]:
    params = _get(config, "rope_parameters") or _get(config, "rope_scaling") or {}
    if not isinstance(params, Mapping):
        return {}
    nested = [v for v in params.values() if isinstance(v, Mapping)]
    return dict(nested[-1]) if nested and len(nested) == len(params) else dict(params)  # per layer type (Gemma 3)


def _alibi(config: Any) -> bool:
    attn = _get(config, "attn_config")
    return bool(
        _get(config, "alibi")
        or _get(config, "model_type") in ALIBI_MODEL_TYPES
        or (isinstance(attn, Mapping) and attn.get("alibi"))
        or getattr(attn, "alibi", False)
    )


def model_window(config: Any) -> Window | None:
    """The window a model config (a transformers config or a config.json mapping) declares, or None."""
    found = [(key, _get(config, key)) for key in WINDOW_KEYS]
    found = [(k, v) for k, v in found if isinstance(v, int) and not isinstance(v, bool) and v > 0]
    if not found:
        return None
    key, positions = found[0]
    if _alibi(config):
        return Window(positions, key, "alibi", positions)
    if any(_get(config, k) is not None for k in ROPE_KEYS):
        params = _rope_params(config)
        rope_type = params.get("rope_type", params.get("type")) or "default"
        original = params.get("original_max_position_embeddings") or _get(config, "original_max_position_embeddings")
        trained = original if isinstance(original, int) and 0 < original < positions else positions
        return Window(positions, key, "rope", trained, rope_type)
    return Window(positions, key, "learned", positions)


def check_positions(config: Any, positions: int, what: str) -> str | None:
    """Whether a run that uses `positions` positions fits the model's window.

    Returns None when it fits (or the config declares no window), a warning text naming `what` (the
    parameter, e.g. "--lengths 100000"), the positions and the window when they are past a RoPE or ALiBi
    window; raises PastWindow (a ValueError) past a learned position table, where no position past it exists.
    """
    window = model_window(config)
    if window is None or positions <= window.positions:
        return None
    if window.kind == "learned":
        raise PastWindow(
            f"{what} needs {positions} positions, but this model has a learned table of {window.describe()} and "
            f"no RoPE, so no position past {window.positions} exists (DCA and RoPE scaling need rotary "
            f"positions): the longest run is {window.positions} positions"
        )
    if window.kind == "alibi":
        return (
            f"{what} uses {positions} positions, past the model's trained window of {window.describe()}; its ALiBi "
            "biases run at any length, but the model never attended that far"
        )
    return (
        f"{what} uses {positions} positions, past the model's trained window of {window.describe()}; RoPE "
        f"positions past {window.positions} were never trained, so results there measure extrapolation: " + DCA_HINT
    )
