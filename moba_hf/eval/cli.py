"""`moba-hf eval {passkey,niah,ppl,lm-eval-data}` and the `moba-hf lm-eval ...` passthrough."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

logger = logging.getLogger("moba_hf")


def parse_lengths(text: str) -> list[int]:
    """'1K,2K,4096' -> [1024, 2048, 4096]."""
    out = []
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        scale = 1024 if part[-1] in "kK" else 1
        try:
            out.append(int(float(part[:-1] if scale > 1 else part) * scale))
        except ValueError:
            raise argparse.ArgumentTypeError(f"lengths must be token counts like 1024 or 2K, got {part!r}") from None
    if not out:
        raise argparse.ArgumentTypeError(f"lengths must list at least one token count, got {text!r}")
    return out


def parse_floats(text: str) -> list[float]:
    try:
        return [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"depths must be fractions like 0,0.5,1, got {text!r}") from None


def load_model(name: str, *, dtype: str = "auto", device: str = "auto") -> tuple[Any, Any]:
    """The embedded model by name (`smollm2`) or any local path / hub id, loaded once with dense attention."""
    import torch
    from transformers import AutoTokenizer

    from ..integration import from_pretrained
    from ..models import EMBEDDED, load

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    if name in EMBEDDED:
        model, tokenizer = load(name, dtype=dtype)
    else:
        model = from_pretrained(name, attn_implementation="sdpa", dtype=dtype).eval()
        tokenizer = AutoTokenizer.from_pretrained(name)
    return model.to(device), tokenizer


def _common(parser: argparse.ArgumentParser, default_lengths: str) -> None:
    parser.add_argument("--model", default="smollm2", help="embedded model name (smollm2) or a local path / hub id")
    parser.add_argument(
        "--attn", action="append", metavar="SETTING",
        help="a setting to compare (repeatable): sdpa | moba | moba:FILE.toml | moba:block_size=64,top_k=16 | "
        "NAME=SETTING | a settings .toml file; default: sdpa",
    )  # fmt: skip
    parser.add_argument("--settings", action="append", metavar="FILE", help="TOML file with [[setting]] tables")
    parser.add_argument("--lengths", type=parse_lengths, default=parse_lengths(default_lengths),
                        help=f"context lengths in tokens, e.g. 1K,2K,4K (default {default_lengths})")  # fmt: skip
    parser.add_argument("--out", required=True, help="output directory (re-running with it resumes)")
    parser.add_argument("--dtype", default="auto", help="float32 / bfloat16 / float16 (auto: fp32 on CPU, bf16 on GPU)")
    parser.add_argument("--device", default="auto", help="cpu / cuda / cuda:1 (auto: cuda when available)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--no-sparsity", action="store_true", help="do not measure sparsity (saves the gate recompute)")


def _grid(parser: argparse.ArgumentParser, trials: int) -> None:
    parser.add_argument("--depths", type=parse_floats, default=[0.0, 0.25, 0.5, 0.75, 1.0],
                        help="needle depths as fractions (default 0,0.25,0.5,0.75,1)")  # fmt: skip
    parser.add_argument("--trials", type=int, default=trials, help=f"trials per length x depth cell (default {trials})")
    parser.add_argument("--seed", type=int, default=0)


def _source(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(what, metavar="PATH", help="a text file or a directory of text files")
    parser.add_argument("--dataset", help="a `datasets` dataset name (datasets.load_dataset), instead of PATH")
    parser.add_argument("--dataset-config", help="the dataset's configuration name")
    parser.add_argument("--split", default="train", help="dataset split (default train)")
    parser.add_argument("--column", default="text", help="dataset text column (default text)")
    parser.add_argument("--max-docs", type=int, help="use at most this many documents")


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    evaluate = subparsers.add_parser("eval", help="long-context evaluation: passkey, niah, ppl (settings side by side)")
    tasks = evaluate.add_subparsers(dest="task", required=True)

    p = tasks.add_parser("passkey", help="passkey retrieval (Landmark-attention prompt), lengths x depths grid")
    _common(p, "1K,2K")
    _grid(p, 3)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.set_defaults(func=_run_passkey)

    p = tasks.add_parser("niah", help="needle in a haystack: depth x length heatmap per setting")
    _common(p, "1K,2K")
    _grid(p, 2)
    _source(p, "--haystack")
    p.add_argument("--needle", help="needle sentence; {answer} is replaced by a random number per trial")
    p.add_argument("--question", help="question / completion prompt after the haystack")
    p.add_argument("--answer", help="expected answer when the needle has no {answer} placeholder")
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.set_defaults(func=_run_niah)

    p = tasks.add_parser("ppl", help="perplexity of long documents at several context lengths")
    _common(p, "512,1K,2K")
    _source(p, "--text")
    p.add_argument(
        "--mode",
        choices=("first", "sliding"),
        default="first",
        help="first: the first L tokens of each document; sliding: L-token windows over --max-tokens",
    )
    p.add_argument("--stride", type=int, help="sliding-window stride (default L/2)")
    p.add_argument("--max-tokens", type=int, help="sliding mode: tokens scored per document (default: longest L)")
    p.set_defaults(func=_run_ppl)

    p = tasks.add_parser("lm-eval-data", help="write passkey.jsonl / niah.jsonl for the lm-eval tasks")
    p.add_argument("--tokenizer", default="smollm2", help="embedded model name or a tokenizer path / hub id")
    p.add_argument("--lengths", type=parse_lengths, default=parse_lengths("1K,2K,4K"))
    _grid(p, 1)
    p.add_argument("--out", required=True)
    p.set_defaults(func=_run_lm_eval_data)

    from .sweep import add_sweep_task

    add_sweep_task(tasks)

    p = subparsers.add_parser(
        "lm-eval", help="lm-eval's command line with 'moba' registered and the moba_hf tasks included",
        description="Everything after `lm-eval` goes to lm-eval, e.g. moba-hf lm-eval --model hf --model_args "
        "pretrained=PATH,attn_implementation=moba --tasks moba_passkey",
        prefix_chars="+",  # so that --options are not ours: all of them go to lm-eval
        add_help=False,
    )  # fmt: skip
    p.add_argument("lm_eval_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_run_lm_eval)


def _prepare(args: argparse.Namespace) -> tuple[Any, Any, list[Any], dict[str, Any]]:
    from .settings import setting_args

    settings = setting_args(args.attn, args.settings)  # bad settings fail here, before the model loads
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    common = {"model_name": args.model, "progress": not args.no_progress, "track": not args.no_sparsity}
    return model, tokenizer, settings, common


def _texts(args: argparse.Namespace, path: str | None) -> list[str] | None:
    from .texts import load_texts

    if path is None and args.dataset is None:
        return None
    return load_texts(path, dataset=args.dataset, dataset_config=args.dataset_config, split=args.split,
                      column=args.column, max_docs=args.max_docs)  # fmt: skip


def _report(result: Any) -> int:
    print(result.summary)
    for path in result.files:
        print(f"wrote {path}")
    if result.failures:
        print(f"{len(result.failures)} setting(s) failed: {', '.join(result.failures)}", file=sys.stderr)
    return 1 if len(result.failures) == len(result.settings) else 0


def _run_passkey(args: argparse.Namespace) -> int:
    from .passkey import passkey_eval

    model, tokenizer, settings, common = _prepare(args)
    result = passkey_eval(model, tokenizer, settings, args.lengths, args.depths, args.trials, args.out,
                          seed=args.seed, max_new_tokens=args.max_new_tokens, **common)  # fmt: skip
    return _report(result)


def _run_niah(args: argparse.Namespace) -> int:
    from .niah import NEEDLE, QUESTION, niah_eval

    haystack = _texts(args, args.haystack)
    model, tokenizer, settings, common = _prepare(args)
    result = niah_eval(
        model, tokenizer, settings, args.lengths, args.depths, args.trials, args.out, haystack=haystack,
        needle=args.needle or NEEDLE, question=args.question or QUESTION, answer=args.answer, seed=args.seed,
        max_new_tokens=args.max_new_tokens, **common,
    )  # fmt: skip
    return _report(result)


def _run_ppl(args: argparse.Namespace) -> int:
    from .ppl import ppl_eval

    documents = _texts(args, args.text)
    model, tokenizer, settings, common = _prepare(args)
    result = ppl_eval(model, tokenizer, settings, args.lengths, args.out, documents=documents, mode=args.mode,
                      stride=args.stride, max_tokens=args.max_tokens, max_docs=args.max_docs, **common)  # fmt: skip
    return _report(result)


def _run_lm_eval_data(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from ..models import EMBEDDED, local_path
    from .harness import write_task_data

    source = local_path(args.tokenizer) if args.tokenizer in EMBEDDED else args.tokenizer
    tokenizer = AutoTokenizer.from_pretrained(source)
    for path in write_task_data(tokenizer, args.out, args.lengths, args.depths, args.trials, args.seed):
        print(f"wrote {path}")
    return 0


def _run_lm_eval(args: argparse.Namespace) -> int:
    from .harness import run_lm_eval

    return run_lm_eval(args.lm_eval_args)
