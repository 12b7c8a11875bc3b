"""Long-context evaluation: passkey, needle-in-a-haystack, perplexity, lm-eval tasks.

One loaded model, several attention settings switched with `moba_hf.apply` / `moba_hf.revert`:

    from moba_hf.eval import passkey_eval
    result = passkey_eval(model, tokenizer, ["sdpa", "moba:block_size=64,top_k=16"], lengths=[2048], trials=5,
                          out_dir="runs/passkey")
    print(result.summary)          # Markdown table; results.json, summary.md and a heatmap PNG are in out_dir
"""

from .niah import niah_eval, score_answer
from .passkey import build_prompt, first_integer, passkey_eval, run_trial
from .ppl import ppl_eval
from .runner import EvalResult
from .settings import Setting, load_settings_file, parse_setting, resolve_settings, use_setting
from .texts import load_texts

__all__ = [
    "EvalResult",
    "Setting",
    "build_prompt",
    "first_integer",
    "load_settings_file",
    "load_texts",
    "niah_eval",
    "parse_setting",
    "passkey_eval",
    "ppl_eval",
    "resolve_settings",
    "run_trial",
    "score_answer",
    "use_setting",
]
