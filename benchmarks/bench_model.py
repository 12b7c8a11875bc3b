"""Whole-model prefill: SmolLM2-135M with MoBA vs the same model with "sdpa", same run.

    python benchmarks/bench_model.py                     # 16K tokens, block 512, top 3, backend torch
    python benchmarks/bench_model.py --tokens 4096 --repeats 2
    python benchmarks/bench_model.py --tokens 4096 --loads idle   # without the busy timing
    python benchmarks/bench_model.py --tokens 8000 --config training-free --repeats 3
    python benchmarks/bench_model.py --dtype bfloat16    # SmolLM2's published dtype
    python benchmarks/bench_model.py --tokens 32768 --config dca-moba --baseline dense   # vs dense DCA

First checks that MoBA with every block selected gives the "sdpa" logits (a short prompt; in bfloat16 by
flash-attention's rule: error vs the float32 "sdpa" logits at most 2x that of bfloat16 "sdpa"), and for a config
with DCA and `--baseline dense` that each layer's DCA + MoBA attention gives dense DCA's on a prompt spanning three
DCA chunks (same rule, against float64 dense DCA); then times one
prefill forward (`use_cache=False`, only the last position's logits) per setting and repeat, after a short
warm-up of each, alternating the settings. Ratio = baseline time / MoBA time. The baseline is "sdpa", or with
`--baseline dense` the same config with `sparse = false` (dense DCA for a config with DCA: what MoBA saves on top
of DCA). The timing runs idle (nothing added; other jobs on a shared machine still run) and busy (`--busy`
CPU-bound processes beside it), as `--loads` says. A CSV row per load carries the date, torch version, threads,
load and settings, with the ratio of the best and of the median times.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_attention import append_rows, busy  # noqa: E402

from moba_hf import MobaConfig, core  # noqa: E402
from moba_hf.integration import apply, revert, rope_remap  # noqa: E402
from moba_hf.models import load  # noqa: E402


def prefill(model, ids: torch.Tensor) -> float:
    start = time.perf_counter()
    with torch.inference_mode():
        model(ids, use_cache=False, logits_to_keep=1)
    return time.perf_counter() - start


def verify_dca(model, moba: MobaConfig, chunk_size: int, vocab: int) -> None:
    """DCA + MoBA with every block selected and no dense tail gives dense DCA's attention, layer by layer on the
    model's own queries, keys and values, on a prompt reaching into a third DCA chunk (so the intra, successive and
    inter query variants all run). By flash-attention's rule: each layer's error against float64 dense DCA at
    most 2x that of dense DCA in the same dtype (plus 1e-6). Layer by layer, because SmolLM2's layers amplify
    rounding: at 1920 tokens (c = 1024) in float64, attention outputs equal to 1e-14 in every layer gave logits
    1e-5 apart, so a logit comparison measures the model's gain rather than the kernel's error."""
    n = 2 * chunk_size + 2 * moba.block_size
    ids = torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(1))
    errors = []
    timed = core.dca_attention

    def checked(q, k, v, **kwargs):
        out = timed(q, k, v, **kwargs)
        dense = {key: kwargs[key] for key in ("pretraining_length", "chunk_size", "inv_freq", "scale", "temperature")}
        exact = timed(q.double(), k.double(), v.double(), **dense)
        same_dtype = timed(q, k, v, **dense)
        errors.append(((out.double() - exact).abs().max().item(), (same_dtype.double() - exact).abs().max().item()))
        return out

    core.dca_attention = checked
    try:
        with torch.inference_mode():
            apply(model, moba.replace(top_k=n // moba.block_size + 1, dense_tail=0))
            model(ids, use_cache=False, logits_to_keep=1)
    finally:
        core.dca_attention = timed
        revert(model)
    worst = max(range(len(errors)), key=lambda i: errors[i][0] / (2 * errors[i][1] + 1e-6))
    print(
        f"verify: DCA + MoBA with all blocks selected at {n} tokens, {len(errors)} layers: worst layer {worst} max "
        f"|diff| vs float64 dense DCA {errors[worst][0]:.2e} (dense DCA in the same dtype: {errors[worst][1]:.2e})"
    )
    if not errors or any(err > 2 * dense_err + 1e-6 for err, dense_err in errors):
        raise SystemExit("DCA + MoBA does not reproduce dense DCA; not timing")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--block-size", type=int, default=512)
    p.add_argument("--top-k", type=int, default=3)
    p.add_argument("--backend", default="torch")
    p.add_argument("--config", default=None, help="MoBA preset or config file (replaces --block-size / --top-k)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument(
        "--baseline", choices=["sdpa", "dense"], default="sdpa",
        help="sdpa, or dense: the config with sparse = false (dense DCA when it has DCA)",
    )  # fmt: skip
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="model weights and activations")
    p.add_argument("--loads", nargs="+", choices=["idle", "busy"], default=["idle", "busy"])
    p.add_argument("--busy", type=int, default=1, help="CPU-bound processes beside the busy timing")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--csv", default="benchmarks/results_model.csv")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    model, _ = load("smollm2")
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    if args.config:
        moba = dataclasses.replace(MobaConfig.from_spec(args.config), backend=args.backend)
    else:
        moba = MobaConfig(block_size=args.block_size, top_k=args.top_k, backend=args.backend)
    check_ids = torch.randint(0, vocab, (1, 2 * moba.block_size), generator=gen)
    ids = torch.randint(0, vocab, (1, args.tokens), generator=gen)
    covering = dataclasses.replace(moba, top_k=check_ids.shape[1] // moba.block_size + 1)  # every block: dense

    with torch.inference_mode():
        reference = model(check_ids, use_cache=False).logits.float()
        model.to(getattr(torch, args.dtype))
        dense_logits = model(check_ids, use_cache=False).logits.float()
        apply(model, covering)
        moba_logits = model(check_ids, use_cache=False).logits.float()
        revert(model)
    err = (reference - moba_logits).abs().max().item()
    dense_err = (reference - dense_logits).abs().max().item()
    print(
        f"verify: MoBA with all blocks selected, max |logit diff| vs float32 sdpa = {err:.2e} "
        f"({args.dtype} sdpa: {dense_err:.2e})"
    )
    if err > 2 * dense_err + 1e-3:
        raise SystemExit("MoBA does not reproduce dense attention; not timing")
    dca = rope_remap.resolve(moba.dca, model.config, moba.block_size)
    if dca is not None and args.baseline == "dense":
        verify_dca(model, moba, dca.chunk_size, vocab)

    def switch(setting: str) -> None:
        if setting == "moba":
            apply(model, moba)
        elif args.baseline == "dense":
            apply(model, moba.replace(sparse=False))
        else:
            revert(model)

    for setting in ("sdpa", "moba"):  # warm-up
        switch(setting)
        prefill(model, ids[:, : 2 * moba.block_size])
    rows = []
    for load_name in args.loads:
        times: dict[str, list[float]] = {"sdpa": [], "moba": []}  # "sdpa": the baseline
        with busy(args.busy if load_name == "busy" else 0):
            for _ in range(args.repeats):  # alternate the settings so both see the same machine load
                for setting in ("sdpa", "moba"):
                    switch(setting)
                    times[setting].append(prefill(model, ids))
                    name = args.baseline if setting == "sdpa" else setting
                    print(f"{load_name}: {name} prefill {args.tokens} tokens: {times[setting][-1]:.1f} s", flush=True)
        sdpa_median, moba_median = statistics.median(times["sdpa"]), statistics.median(times["moba"])
        rows.append(
            {
                "date": datetime.date.today().isoformat(),
                "torch": torch.__version__,
                "device": f"{platform.machine()} cpu x{torch.get_num_threads()} threads",
                "model": f"SmolLM2-135M-Instruct {args.dtype}",
                "tokens": args.tokens,
                "block_size": moba.block_size,
                "top_k": moba.top_k,
                "backend": args.backend,
                "repeats": args.repeats,
                "baseline": args.baseline,
                "load": load_name,
                "busy_processes": args.busy if load_name == "busy" else 0,
                "sdpa_min_s": round(min(times["sdpa"]), 2),
                "sdpa_median_s": round(sdpa_median, 2),
                "moba_min_s": round(min(times["moba"]), 2),
                "moba_median_s": round(moba_median, 2),
                "ratio_min": round(min(times["sdpa"]) / min(times["moba"]), 2),
                "ratio_median": round(sdpa_median / moba_median, 2),
                "moba_config": json.dumps(moba.to_dict(), sort_keys=True),
            }
        )
    revert(model)
    path = Path(args.csv)
    append_rows(path, rows)
    for row in rows:
        print(row)
        print(
            f"prefill {args.tokens} tokens, {row['load']}: {args.baseline} {row['sdpa_min_s']:.1f} s, "
            f"moba {row['moba_min_s']:.1f} s, ratio {row['ratio_min']:.2f}x best, {row['ratio_median']:.2f}x median "
            f"(CSV: {path})"
        )


if __name__ == "__main__":
    main()
