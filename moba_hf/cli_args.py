"""What every `moba-hf` subcommand shares: lengths as token counts (`2048`, `2K`, `1M`), `--attn` settings,
`--model`, `--text`, `--out` (default `runs/<command>`), and `UsageError` for a bad value found after parsing
(one line on stderr, exit status 2, before any model loads). No torch, transformers or command module here:
the commands import it, `moba_hf.cli` runs them.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

OUT_ROOT = "runs"
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class UsageError(Exception):
    """A bad command-line value found after parsing (a missing model, a short text ...): exit status 2."""


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (the usage block hides the message on a narrow terminal)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def parse_length(text: str) -> int:
    """'2048' -> 2048, '2K' -> 2048, '1.5k' -> 1536, '1M' -> 1048576; must be >= 1."""
    part = text.strip()
    scale = {"k": 1024, "m": 1024 * 1024}.get(part[-1:].lower(), 1)
    try:
        value = float(part[:-1] if scale > 1 else part) * scale
    except ValueError:
        value = float("nan")
    if not value >= 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"lengths must be token counts >= 1 like 2048 or 2K, got {text!r}")
    return int(value)


def parse_lengths(text: str) -> list[int]:
    """'1K,2K,4096' -> [1024, 2048, 4096]."""
    parts = [p for p in text.replace(" ", "").split(",") if p]
    if not parts:
        raise argparse.ArgumentTypeError(f"lengths must list at least one token count, got {text!r}")
    return [parse_length(p) for p in parts]


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def fractions(text: str) -> list[float]:
    """'0,0.5,1' -> [0.0, 0.5, 1.0], each in [0, 1]."""
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        values = []
    if not values or not all(0.0 <= v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"must be fractions in [0, 1] like 0,0.5,1, got {text!r}")
    return values


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="smollm2",
        help="embedded model name (smollm2, the default), a local checkpoint directory or a hub id",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="auto: float32 on CPU, bfloat16 on GPU",
    )
    parser.add_argument("--device", default="auto", help="cpu / cuda / cuda:1 (auto: cuda when available)")


def add_settings_args(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument(
        "--attn",
        action="append",
        metavar="SETTING",
        help="an attention setting (repeatable): sdpa | moba | moba:PRESET (e.g. moba:paper-8k) | moba:FILE.toml "
        "| moba:block_size=64,top_k=16 | a sweep grid name (b64-k12-f3) | NAME=SETTING | a settings .toml; "
        f"default: {default}",
    )
    parser.add_argument("--settings", action="append", metavar="FILE", help="TOML file with [[setting]] tables")


def add_out_arg(parser: argparse.ArgumentParser, command: str, what: str = "results") -> None:
    default = f"{OUT_ROOT}/{command}"
    parser.add_argument(
        "--out",
        default=default,
        metavar="DIR",
        help=f"{what} directory; re-running into it resumes (default {default})",
    )


def add_text_args(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--text", metavar="PATH", help=f"{what}: a text file or a directory of text files")
    parser.add_argument("--haystack", dest="text", help=argparse.SUPPRESS)  # an alias of --text
    parser.add_argument("--dataset", help="a `datasets` dataset name (datasets.load_dataset), instead of --text")
    parser.add_argument("--dataset-config", help="the dataset's configuration name")
    parser.add_argument("--split", default="train", help="dataset split (default train)")
    parser.add_argument("--column", default="text", help="dataset text column (default text)")
    parser.add_argument("--max-docs", type=positive_int, help="use at most this many documents")


def check_out(path: str) -> Path:
    """--out must be a directory or creatable as one."""
    out = Path(path).expanduser()
    for parent in (out, *out.parents):
        if parent.exists():
            if not parent.is_dir():
                raise UsageError(f"--out {path}: {parent} is a file; give a directory")
            break
    return out


# a hub id is org/name (one slash, no leading dot or tilde); a bare word is an embedded name or a mistake
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def check_model(name: str, flag: str = "--model") -> None:
    """--model must be an embedded name, a checkpoint directory, or (online) a hub id `org/name`: anything else is
    refused at once (a bare word with the closest embedded name), without asking the hub."""
    import difflib

    from .models import EMBEDDED

    if name in EMBEDDED:
        return
    given = f"{flag}{name}" if flag.endswith("=") else f"{flag} {name}"  # --model x, or pretrained=x
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UsageError(f"{given}: the directory has no config.json (not a saved checkpoint)")
        return
    accepted = f"give an embedded name ({', '.join(EMBEDDED)}), a checkpoint directory or a hub id org/name"
    if path.exists():
        raise UsageError(f"{given}: a file; {accepted}")
    # org/name whose org is a local directory (runs/my-run) means a directory too
    if _HUB_ID.match(name) is None or name.startswith((".", "~")) or path.parent.is_dir() and path.parent.name:
        close = difflib.get_close_matches(name.lower(), list(EMBEDDED), n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}? " if close else ""
        raise UsageError(f"{given}: no such directory, embedded name or hub id; {hint}{accepted}")
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false") and not _in_hub_cache(name):
        raise UsageError(f"{given}: no such directory, and HF_HUB_OFFLINE is set (no hub lookup); {accepted}")


def _in_hub_cache(repo_id: str) -> bool:
    """Whether the hub cache holds the repo's config.json (what an offline from_pretrained would read)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
