"""`moba-hf dca-matrix`: print the remapped query-key distances so a DCA setting can be checked by hand."""

from __future__ import annotations

import argparse

from ..cli_args import UsageError, positive_int


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "dca-matrix",
        help="print the DCA relative-position matrix",
        description="Rows are queries i, columns keys j <= i (key chunks separated by '|'); each entry is the "
        "distance RoPE sees. Example: moba-hf dca-matrix --seq-len 13 --pretraining-length 8 --chunk-size 6",
    )
    p.add_argument("--seq-len", type=positive_int, default=16, help="sequence length N (default 16)")
    p.add_argument("--pretraining-length", type=positive_int, default=8, help="c, the trained context (default 8)")
    p.add_argument("--chunk-size", type=positive_int, default=None, help="s < c (default c - c // 8)")
    p.set_defaults(func=run, prog=p.prog)


def run(args: argparse.Namespace) -> int:
    from ..kernels.dual_chunk_positions import format_matrix, relative_positions
    from .config import default_chunk_size

    c = args.pretraining_length
    s = default_chunk_size(c) if args.chunk_size is None else args.chunk_size
    try:
        matrix = relative_positions(args.seq_len, c, s)
    except ValueError as err:
        raise UsageError(str(err)) from None
    print(f"DCA distances: seq_len={args.seq_len}, pretraining_length c={c}, chunk_size s={s}, local window {c - s}")
    print(format_matrix(matrix, s))
    return 0
