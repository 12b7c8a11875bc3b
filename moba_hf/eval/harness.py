"""lm-evaluation-harness integration: our tasks as YAML over local JSONL, and running lm-eval with "moba".

transformers only knows attn_implementation="moba" once `moba_hf` has been imported in the process that
loads the model, and lm-eval has no plugin hook that would import it. So:

    moba-hf lm-eval --model hf --model_args pretrained=PATH,attn_implementation=moba --tasks moba_passkey

runs lm-eval's own command line in-process after registering "moba" (and the "hf-moba" model below), with
our task folder added to --include_path. From Python, `import moba_hf` before `lm_eval.simple_evaluate`.

"hf-moba" is lm-eval's HFLM with a MoBA setting from the model args, e.g.
    --model hf-moba --model_args pretrained=PATH,moba=paper-8k
    --model hf-moba --model_args pretrained=PATH,moba_block_size=64,moba_top_k=16
`pretrained=smollm2` (or `tokenizer=smollm2`) names the embedded model: its local copy's directory is passed on,
so lm-eval and RULER's prompt builder (which reads the tokenizer from these args) find it offline.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..config import MobaConfig

TASKS_DIR = Path(__file__).resolve().parent / "lm_eval_tasks"
TASKS = ("moba_passkey", "moba_niah")
MODEL_NAME = "hf-moba"


def _moba_from_args(kwargs: dict[str, Any]) -> MobaConfig | None:
    """Pop `moba=<preset, file or k=v;k=v>` and `moba_<field>=value` from lm-eval model args."""
    from .settings import parse_inline

    spec = kwargs.pop("moba", None)
    fields = {k.removeprefix("moba_"): kwargs.pop(k) for k in list(kwargs) if k.startswith("moba_")}
    if spec is None and not fields:
        return None
    base = MobaConfig()
    if spec is not None:
        spec = str(spec)
        base = parse_inline(spec.replace(";", ",")) if "=" in spec else MobaConfig.from_spec(spec)
    return base.replace(**fields) if fields else base


def register_lm_eval() -> None:
    """Register "moba" with transformers and the "hf-moba" model with lm-eval (idempotent)."""
    from lm_eval.api.registry import get_model, register_model
    from lm_eval.models.huggingface import HFLM  # importing lm_eval.models registers lm-eval's own models

    from ..integration import apply, register

    register()
    try:
        get_model(MODEL_NAME)
        return
    except ValueError:
        pass

    class MobaHFLM(HFLM):
        """lm-eval's HFLM loading the model with attn_implementation="moba" and the given MoBA setting."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            moba = _moba_from_args(kwargs)
            kwargs.setdefault("attn_implementation", "moba")
            super().__init__(*args, **kwargs)
            if kwargs["attn_implementation"] == "moba":
                apply(self._model, moba)

    register_model(MODEL_NAME)(MobaHFLM)


def _embedded_paths(model_args: str) -> str:
    """`pretrained=` / `tokenizer=` naming an embedded model (models.EMBEDDED) -> its local directory (made on first
    use); other args as given. Only lm-eval's comma-separated key=value form is read."""
    from ..models import EMBEDDED, local_path

    def resolved(item: str) -> str:
        key, _, value = item.partition("=")
        if key.strip() in ("pretrained", "tokenizer") and value.strip() in EMBEDDED and not Path(value).exists():
            return f"{key}={local_path(value.strip())}"
        return item

    return ",".join(resolved(item) for item in model_args.split(","))


def _with_embedded_paths(argv: list[str]) -> list[str]:
    out = list(argv)
    for i, arg in enumerate(out):
        if arg.startswith("--model_args="):
            out[i] = "--model_args=" + _embedded_paths(arg.removeprefix("--model_args="))
        elif arg == "--model_args" and i + 1 < len(out):
            out[i + 1] = _embedded_paths(out[i + 1])
    return out


def run_lm_eval(argv: Sequence[str]) -> int:
    """lm-eval's command line, in this process, after registration; adds our task folder to --include_path."""
    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError as error:
        raise SystemExit(f"moba-hf lm-eval needs lm-eval: pip install 'moba-hf[eval]' ({error})") from error
    argv = list(argv)
    if not {"-h", "--help"} & set(argv):  # help exits before any model is built: skip loading transformers
        register_lm_eval()
        argv = _with_embedded_paths(argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if "--include_path" not in argv and not any(a.startswith("--include_path=") for a in argv):
        argv += ["--include_path", str(TASKS_DIR)]
    saved = sys.argv
    sys.argv = ["lm-eval", *argv]
    try:
        cli_evaluate()
    except SystemExit as done:
        return int(done.code or 0) if not isinstance(done.code, str) else 1
    finally:
        sys.argv = saved
    return 0


def write_task_data(
    tokenizer: Any,
    out_dir: str | Path,
    lengths: Sequence[int] = (1024, 2048, 4096),
    depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0),
    trials: int = 1,
    seed: int = 0,
) -> list[Path]:
    """passkey.jsonl and niah.jsonl (prompt, answer, length, depth) sized with `tokenizer`.

    Point the tasks at them with --metadata '{"passkey_jsonl": ".../passkey.jsonl", "niah_jsonl": "..."}'.
    """
    from .niah import NEEDLE, QUESTION, Haystack, trial_answer
    from .passkey import build_prompt, check_grid, trial_passkey
    from .runner import atomic_write_text
    from .texts import generated_text

    lengths, depths = check_grid(lengths, depths, trials)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hay = Haystack(tokenizer, [generated_text(max(lengths) + 2000, seed)])
    rows: dict[str, list[dict[str, Any]]] = {"passkey": [], "niah": []}
    for length in lengths:
        for depth in depths:
            for i in range(trials):
                key = trial_passkey(seed, length, depth, i)
                prompt = build_prompt(tokenizer, length, depth, key)
                rows["passkey"].append({"prompt": prompt, "answer": str(key), "length": length, "depth": depth})
                answer = trial_answer(seed, length, depth, i)
                fill = NEEDLE.replace("{answer}", answer), QUESTION.replace("{answer}", answer)
                rows["niah"].append({"prompt": hay.prompt(length, depth, *fill), "answer": answer,
                                     "length": length, "depth": depth})  # fmt: skip
    return [atomic_write_text(out / f"{task}.jsonl", "".join(json.dumps(r) + "\n" for r in items))
            for task, items in rows.items()]  # fmt: skip
