"""Measure a tail-estimated selection before adding it: `moba-hf eval sweep` with the prefill's gate replaced.

Tail-estimated selection (MInference's last-q estimation, applied to MoBA's blocks): the last `--tail` queries
of a prompt score the blocks once (their gate softmax over the blocks before their own, averaged per head), and
every query of the prompt ranks its candidate blocks by that shared score instead of its own; forced blocks,
causality and top_k are as in MoBA. Only the torch backend's prefill is replaced, in this process; decode steps
and the package are unchanged. It is a probe, not an option: docs/eval.md has the measurement.

    python benchmarks/probe_tail_selection.py --tail 64 -- --settings FILE --lengths 4096 --trials 5 --families ...
    python benchmarks/probe_tail_selection.py --check-only    # the replaced kernel against a naive construction

The sweep runs only after the check passes.
"""

from __future__ import annotations

import argparse
import sys
import threading

import torch

import moba_hf.kernels as kernels
import moba_hf.kernels.selection as selection
import moba_hf.kernels.torch_impl as torch_impl
from moba_hf.kernels.checks import effective_block_size
from moba_hf.kernels.pooling import pooled_keys

_call = threading.local()  # the whole prompt's (q, k) while a dense tail splits it, and the shared scores
_selection_slices, _gate_scores, _with_dense_tail = (
    selection.selection_slices,
    selection.gate_scores,
    kernels.with_dense_tail,
)


def shared_scores(q: torch.Tensor, k: torch.Tensor, block_size: int, pooling: str, tail: int) -> torch.Tensor:
    """[B, Hq, n_blocks]: sqrt(D) * log of the tail queries' mean gate softmax (ranks as that mean; a top_p
    budget over it sees the mean distribution)."""
    nk, d = k.shape[2], q.shape[3]
    bs = effective_block_size(block_size, nk)
    scores = _gate_scores(q[:, :, -tail:], k, bs, pooling, pooled_keys(k, bs, pooling))
    own = (torch.arange(tail) + nk - tail) // bs
    scores = scores.masked_fill(torch.arange(scores.shape[-1]) >= own[:, None], float("-inf"))
    share = (scores * d**-0.5).softmax(-1).nan_to_num(0.0).mean(2)
    return share.log() * d**0.5


def install(tail: int) -> None:
    """Replace the torch backend's prefill gate with the tail-estimated one (calls with more than `tail` queries)."""

    def with_dense_tail(q, k, v, dense_tail, sparse, dense):
        _call.prompt = (q, k)
        try:
            return _with_dense_tail(q, k, v, dense_tail, sparse, dense)
        finally:
            _call.prompt = None

    def selection_slices(q, k, *, block_size, top_k, gate, slice_rows, trim=False):
        pq, pk = getattr(_call, "prompt", None) or (q, k)
        if pq.shape[2] > tail and top_k > 1:
            _call.shared = shared_scores(pq, pk, block_size, gate.pooling, tail)
        try:
            yield from _selection_slices(
                q, k, block_size=block_size, top_k=top_k, gate=gate, slice_rows=slice_rows, trim=trim
            )
        finally:
            _call.shared = None

    def gate_scores(q, k, block_size, pooling="mean", pooled=None):
        shared = getattr(_call, "shared", None)
        if shared is None:
            return _gate_scores(q, k, block_size, pooling, pooled)
        n = pooled.shape[2]
        return shared[:, :, None, :n].expand(q.shape[0], q.shape[1], q.shape[2], n).clone()

    kernels.with_dense_tail = with_dense_tail
    selection.selection_slices = torch_impl.selection_slices = selection_slices
    selection.gate_scores = gate_scores


def naive(q, k, v, *, block_size, top_k, sink, local, dense_tail, tail):
    """Tail-estimated MoBA written out per query in float64 (mean pooling)."""
    q, k, v = (t.double() for t in (q, k, v))
    b, hq, n, d = q.shape
    group = hq // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    nb = -(-n // block_size)
    pooled = torch.stack([k[:, :, i * block_size : (i + 1) * block_size].mean(2) for i in range(nb)], 2)
    out = torch.empty_like(q)
    for bi in range(b):
        for h in range(hq):
            share = torch.zeros(nb, dtype=torch.float64)
            for t in range(n - tail, n):
                s = torch.full((nb,), float("-inf"), dtype=torch.float64)
                s[: t // block_size] = pooled[bi, h, : t // block_size] @ q[bi, h, t]
                share += (s / d**0.5).softmax(0).nan_to_num(0.0) / tail
            for i in range(n):
                c = i // block_size
                keys = torch.zeros(n, dtype=torch.bool)
                if i >= n - dense_tail:
                    keys[: i + 1] = True
                else:
                    blocks = {c} | {j for j in range(c) if j < sink or j >= c - local}
                    others = sorted((j for j in range(c) if j not in blocks), key=lambda j: -share[j].item())
                    blocks |= set(others[: top_k - 1])
                    for j in blocks:
                        keys[j * block_size : min((j + 1) * block_size, i + 1)] = True
                w = (k[bi, h, keys] @ q[bi, h, i] / d**0.5).softmax(0)
                out[bi, h, i] = w @ v[bi, h, keys]
    return out


def check(tail: int = 8) -> float:
    """The replaced torch kernel against `naive` (odd length, GQA, batch 2, sink / local blocks, a dense tail);
    returns the max abs error. Also that the replacement is live (the per-query gate answers otherwise)."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 203, 16), torch.randn(2, 2, 203, 16), torch.randn(2, 2, 203, 16)
    args = dict(block_size=16, top_k=3, sink_blocks=1, local_blocks=1, dense_tail=12)
    per_query = kernels.moba_attention(q, k, v, backend="torch", **args)
    install(tail)
    got = kernels.moba_attention(q, k, v, backend="torch", **args)
    want = naive(q, k, v, block_size=16, top_k=3, sink=1, local=1, dense_tail=12, tail=tail)
    error = (got.double() - want).abs().max().item()
    assert (got - per_query).abs().max() > 1e-3, "the tail-estimated gate chose what the per-query gate chose"
    return error


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tail", type=int, default=64, help="queries at the prompt's end that choose the blocks")
    p.add_argument("--check-only", action="store_true", help="check the replaced kernel and stop")
    p.add_argument("sweep", nargs=argparse.REMAINDER, help="-- then `moba-hf eval sweep`'s arguments")
    args = p.parse_args(argv)
    if args.tail < 1:
        p.error(f"--tail must be at least 1, got {args.tail}")
    error = check()
    # float32 kernel vs float64 construction over at most 203 keys of unit-scale inputs
    ok = error < 1e-4
    print(f"check: tail-estimated torch kernel vs naive, max abs error {error:.2e} -> {'ok' if ok else 'FAILED'}")
    if not ok:
        return 1
    if args.check_only:
        return 0
    install(args.tail)  # again with the sweep's tail (check() installed its own)
    from moba_hf.cli import main as cli

    sweep = args.sweep[1:] if args.sweep[:1] == ["--"] else args.sweep
    return cli(["eval", "sweep", *sweep])


if __name__ == "__main__":
    sys.exit(main())
