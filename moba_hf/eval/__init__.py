"""Long-context evaluation: passkey, needle-in-a-haystack, perplexity, the training-free sweep, lm-eval tasks.

One loaded model, several attention settings switched with `moba_hf.apply` / `moba_hf.revert`:

    from moba_hf.eval import passkey_eval
    result = passkey_eval(model, tokenizer, ["sdpa", "moba:block_size=64,top_k=16"], lengths=[2048], trials=5,
                          out_dir="runs/passkey")
    print(result.summary)          # Markdown table; results.json, summary.md and a heatmap PNG are in out_dir

Names are imported on first use, so that `moba-hf --help` does not load the evaluation machinery.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "FAMILIES": "families",
    "EvalResult": "grid",
    "niah_eval": "niah",
    "passkey_eval": "passkey",
    "run_trial": "passkey",
    "ppl_eval": "ppl",
    "first_integer": "scoring",
    "score_niah": "scoring",
    "score_passkey": "scoring",
    "score_words": "scoring",
    "Setting": "settings",
    "load_settings_file": "settings",
    "parse_setting": "settings",
    "resolve_settings": "settings",
    "use_setting": "settings",
    "load_texts": "texts",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
