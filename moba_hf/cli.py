"""`moba-hf` command line; the vocabulary every subcommand shares is in `cli_args`.

Each feature module adds its subcommands through `add_commands(subparsers)`. Only the module of the command
being run is imported (the others appear in `moba-hf --help` by name), and command modules import their
machinery inside the function that runs the command: `moba-hf --help` answers at once.

Shared flags: lengths as token counts (`2048`, `2K`, `1M`), `--attn` settings, `--model`, `--text`, and
`--out` (default `runs/<command>`). A bad value is one line on stderr and exit status 2, before any model
loads; Ctrl-C is one line and exit status 130.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from .cli_args import EXIT_INTERRUPTED, EXIT_USAGE, Parser, UsageError

# command -> (module whose add_commands(subparsers) defines it, one-line help for `moba-hf --help`)
COMMANDS = {
    "demo": ("moba_hf.demo", "passkey retrieval on the embedded SmolLM2: full attention vs MoBA"),
    "eval": ("moba_hf.eval.cli", "long-context evaluation: passkey, niah, ppl, sweep (settings side by side)"),
    "lm-eval": ("moba_hf.eval.cli", "lm-eval's command line with 'moba' registered and the moba_hf tasks included"),
    "train": ("moba_hf.train.cli", "continue-train a model with MoBA (Trainer; accelerate launch for multi-GPU)"),
    "dca-matrix": ("moba_hf.dca.cli", "print the DCA relative-position matrix"),
    "presets": ("moba_hf.presets.cli", "list the named MoBA / DCA presets (MobaConfig.preset(NAME), moba:NAME)"),
    "model-path": ("moba_hf.models", "print an embedded model's directory (for vllm serve, lm-eval pretrained=, ...)"),
}
COMMAND_MODULES = tuple(dict.fromkeys(module for module, _ in COMMANDS.values()))


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("moba-hf")
    except PackageNotFoundError:
        from . import __version__

        return __version__


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The full parser; with `argv`, only the module of the command in argv is imported."""
    parser = Parser(prog="moba-hf", description="MoBA / DCA attention for Hugging Face models")
    parser.add_argument("--version", action="version", version=f"moba-hf {version()}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging (shows the kernel backend)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = next((a for a in argv if not a.startswith("-")), None) if argv is not None else None
    modules = COMMAND_MODULES if argv is None else [COMMANDS[chosen][0]] if chosen in COMMANDS else []
    for module in modules:
        importlib.import_module(module).add_commands(sub)
    for name, (_, text) in COMMANDS.items():
        if name not in sub.choices:  # listed by name; its module loads when it is the command run
            sub.add_parser(name, help=text, add_help=False)
    return parser


def command_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the (sub)command that `args` came from: `moba-hf eval passkey`'s for an eval passkey run."""
    while True:
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        chosen = getattr(args, sub.dest, None) if sub is not None else None
        if chosen not in getattr(sub, "choices", {}):
            return parser
        parser = sub.choices[chosen]


def refuse_unknown(parser: argparse.ArgumentParser, unknown: list[str]) -> None:
    """One line from the command's own parser, with the closest flag of that command."""
    import difflib

    flags = [o for action in parser._actions for o in action.option_strings]
    first = next((u.split("=")[0] for u in unknown if u.startswith("-")), "")
    close = difflib.get_close_matches(first, flags, n=1) if first else []
    hint = f"; did you mean {close[0]}?" if close else ""
    parser.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        refuse_unknown(command_parser(parser, args), unknown)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(message)s")
    prog = getattr(args, "prog", f"moba-hf {args.command}")
    try:
        return int(args.func(args) or 0)
    except UsageError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        out = getattr(args, "out", None)
        kept = f"; finished trials are kept in {out} (rerun the same command to resume)" if out else ""
        print(f"\n{prog}: interrupted{kept}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # output piped into `head` that closed early: not an error worth a traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
