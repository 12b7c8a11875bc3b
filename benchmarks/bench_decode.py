"""Decode speed: MoBA sparse decode vs SDPA decode, for the attention op and for whole-model `generate`.

    .venv/bin/python benchmarks/bench_decode.py                      # op at 2K..128K, SmolLM2 at 2K..32K
    .venv/bin/python benchmarks/bench_decode.py --model-contexts     # op only

Op: one decode step of one layer (B=1, Hq=9, Hkv=3, D=64, float32, block 512, top 3): MoBA = append the new
key to the running block sums + the sparse kernel (gate + selected blocks) from the measured crossover on, a
plain dense step below it (what decode="moba" runs) vs `F.scaled_dot_product_attention` over the whole cache; the
sums are then rolled back so every repeat sees the same cache (timed too: MoBA is charged twice for the sum
update). The sparse kernel alone is timed as well. Both are checked against the reference first.

Model: SmolLM2-135M (30 layers), greedy `generate` of --new-tokens tokens after a context of N tokens,
--rounds times per setting, alternating MoBA and SDPA.
A real prefill of 32K tokens takes many minutes on a laptop CPU, so the KV cache is filled synthetically (random
keys/values at every layer, the same for both settings) and only decode steps are timed: per-token latency is
the time between tokens reported to a streamer (the first, which includes generate's setup, is dropped).
Before timing, one sparse decode step's logits are checked against the reference MoBA path on the same cache;
the timed steps then follow the measured crossover (`moba_hf.kernels.decode.decode_crossover`).
Both settings use transformers' DynamicCache, which copies the whole cache at every step (torch.cat): that
cost is in both columns.
"""

from __future__ import annotations

import argparse
import csv
import inspect
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from moba_hf import MobaConfig  # noqa: E402
from moba_hf.integration import cache as moba_cache  # noqa: E402
from moba_hf.kernels import GateOptions, moba_attention_reference  # noqa: E402
from moba_hf.kernels.decode import CROSSOVER_ENV, decode_crossover, moba_decode  # noqa: E402


def _cache_keyword() -> str:
    from transformers import LlamaForCausalLM

    params = inspect.signature(LlamaForCausalLM.forward).parameters
    return "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.2x


CACHE = _cache_keyword()


def timing_fields(t_moba: list[float], t_sdpa: list[float]) -> dict[str, float]:
    """Min / median of both sides in ms and the speed-ups (SDPA time / MoBA time), for one CSV row."""
    return {
        "moba_min_ms": min(t_moba) * 1e3,
        "moba_median_ms": statistics.median(t_moba) * 1e3,
        "sdpa_min_ms": min(t_sdpa) * 1e3,
        "sdpa_median_ms": statistics.median(t_sdpa) * 1e3,
        "speedup_median": statistics.median(t_sdpa) / statistics.median(t_moba),
        "speedup_min": min(t_sdpa) / min(t_moba),
    }


def timed_pair(first, second, repeats: int, warmup: int = 2) -> tuple[list[float], list[float]]:
    """Alternate the two calls so both see the same machine load (the CPU here is shared)."""
    for _ in range(warmup):
        first()
        second()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, out in ((first, times[0]), (second, times[1])):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
    return times


def env() -> dict:
    return {
        "torch": torch.__version__,
        "device": f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)",
        "dtype": "float32",
    }


# --- op level -----------------------------------------------------------------------------------------------------
def bench_op(context: int, repeats: int, block: int, top_k: int) -> dict:
    b, hq, hkv, d = 1, 9, 3, 64
    q = torch.randn(b, hq, 1, d)
    k, v = torch.randn(b, hkv, context, d), torch.randn(b, hkv, context, d)
    state = moba_cache.BlockState(k, block, "mean")
    state.append(k[:, :, :-1], None)
    new_key = k[:, :, -1:]
    crossover = decode_crossover(q, k, block_size=block, top_k=top_k, gate=GateOptions())

    def moba_step(sparse: bool = True):
        if not sparse:  # below the crossover decode="moba" runs the dense step and keeps no block state
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        state.append(new_key, None)
        out = moba_decode(q, k, v, state.block_keys(), block_size=block, top_k=top_k)
        state.sums[:, :, (context - 1) // block] -= new_key[:, :, 0]  # roll back: same cache every repeat
        state.counts -= 1
        state.n -= 1
        return out

    def sdpa_step():
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    want = moba_attention_reference(q, k, v, block_size=block, top_k=top_k)
    torch.testing.assert_close(moba_step(), want, rtol=1e-4, atol=1e-5)
    dense = moba_attention_reference(q, k, v, block_size=context, top_k=1)
    torch.testing.assert_close(sdpa_step(), dense, rtol=1e-4, atol=1e-5)
    t_sparse, t_sdpa = timed_pair(moba_step, sdpa_step, repeats)
    # what decode="moba" runs: the sparse kernel from the measured crossover on, a dense step below it
    chosen = -(-context // block) >= crossover
    t_moba, t_sdpa2 = timed_pair(lambda: moba_step(chosen), sdpa_step, repeats)
    sparse_only = timing_fields(t_sparse, t_sdpa)
    return {
        "bench": "op",
        "context": context,
        **timing_fields(t_moba, t_sdpa2),
        "crossover_blocks": crossover,
        "step": "sparse" if chosen else "dense",
        "sparse_kernel_median_ms": sparse_only["moba_median_ms"],
        "sparse_kernel_speedup_median": sparse_only["speedup_median"],
    }


# --- whole model ----------------------------------------------------------------------------------------------------
class StepClock:
    """A generate streamer that timestamps every emitted token."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def synthetic_cache(model, context: int, seed: int = 0):
    from transformers import DynamicCache

    cfg = model.config
    gen = torch.Generator().manual_seed(seed)
    cache = DynamicCache(config=cfg)
    shape = (1, cfg.num_key_value_heads, context, cfg.hidden_size // cfg.num_attention_heads)
    for layer in range(cfg.num_hidden_layers):
        cache.update(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen), layer)
    return cache


def decode_latencies(model, context: int, new_tokens: int) -> list[float]:
    ids = torch.randint(0, model.config.vocab_size, (1, context + 1), generator=torch.Generator().manual_seed(1))
    clock = StepClock()
    with torch.no_grad():
        model.generate(
            ids,
            past_key_values=synthetic_cache(model, context),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            streamer=clock,
        )
    stamps = clock.times[1:]  # the first put() is the prompt itself
    return [b - a for a, b in zip(stamps[1:], stamps[2:], strict=False)]  # drop the first step (cache setup, hooks)


def verify_model_step(model, context: int) -> float:
    """One sparse decode step == the reference MoBA path on the same cache; returns the max logit difference
    relative to the largest logit."""
    tok, pos = torch.tensor([[7]]), torch.tensor([[context]])
    for layer in model.model.layers:  # normally installed by the first moba call
        moba_cache.install_hooks(layer.self_attn)
    crossover = os.environ.get(CROSSOVER_ENV)
    os.environ[CROSSOVER_ENV] = "0"  # the sparse step, whatever the crossover
    try:
        with torch.no_grad():
            sparse = model(tok, **{CACHE: synthetic_cache(model, context)}, position_ids=pos, use_cache=True).logits
    finally:
        if crossover is None:
            del os.environ[CROSSOVER_ENV]
        else:
            os.environ[CROSSOVER_ENV] = crossover
    with torch.no_grad():
        limit, moba_cache.DECODE_MAX_QUERIES = moba_cache.DECODE_MAX_QUERIES, 0  # force the reference path
        try:
            ref = model(tok, **{CACHE: synthetic_cache(model, context)}, position_ids=pos, use_cache=True).logits
        finally:
            moba_cache.DECODE_MAX_QUERIES = limit
    diff = float((sparse - ref).abs().max() / ref.abs().max())
    if not diff < 1e-4:  # float32 rounding; a different block choice would move logits far more
        raise AssertionError(f"sparse decode logits differ from the reference path by {diff:.2e} (relative)")
    return diff


def bench_model(contexts: list[int], new_tokens: int, block: int, top_k: int, rounds: int) -> list[dict]:
    import moba_hf
    from moba_hf.models import load

    model, _ = load("smollm2")
    rows = []
    for context in contexts:
        moba = MobaConfig(block_size=block, top_k=top_k)
        diff = verify_model_step(moba_hf.apply(model, moba), context)
        moba_hf.revert(model)
        t_moba, t_sdpa = [], []
        for _ in range(rounds):  # alternate the settings so both see the same machine load
            t_moba += decode_latencies(moba_hf.apply(model, moba), context, new_tokens)
            t_sdpa += decode_latencies(moba_hf.revert(model), context, new_tokens)  # back to "sdpa"
        rows.append(
            {
                "bench": "smollm2-generate",
                "context": context,
                **timing_fields(t_moba, t_sdpa),
                "moba_tok_s": 1 / statistics.median(t_moba),
                "sdpa_tok_s": 1 / statistics.median(t_sdpa),
                "check_rel_logit_diff": diff,
            }
        )
        print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--op-contexts", type=int, nargs="*", default=[2048, 4096, 8192, 16384, 32768, 131072])
    parser.add_argument("--model-contexts", type=int, nargs="*", default=[2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--repeats", type=int, default=30, help="op-level repeats")
    parser.add_argument("--new-tokens", type=int, default=8, help="tokens per generate call")
    parser.add_argument("--rounds", type=int, default=2, help="alternating MoBA / SDPA generate calls per context")
    parser.add_argument("--block-size", type=int, default=512)
    parser.add_argument("--top-k", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--csv", type=Path, default=ROOT / "benchmarks" / "decode.csv")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    rows = []
    for context in args.op_contexts:
        rows.append(bench_op(context, args.repeats, args.block_size, args.top_k))
        print(rows[-1], flush=True)
    if args.model_contexts:
        rows += bench_model(args.model_contexts, args.new_tokens, args.block_size, args.top_k, args.rounds)

    settings = {**env(), "block_size": args.block_size, "top_k": args.top_k}
    rows = [{**row, **settings} for row in rows]
    fields = sorted({key for row in rows for key in row}, key=lambda f: (f not in rows[0], f))
    with args.csv.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    print(f"\n| bench | context | step | MoBA median ms | SDPA median ms | speed-up | sparse kernel | ({settings})")
    for row in rows:
        sparse = f"{row['sparse_kernel_speedup_median']:.2f}x" if "sparse_kernel_speedup_median" in row else ""
        print(
            f"| {row['bench']} | {row['context']} | {row.get('step', '')} | {row['moba_median_ms']:.2f} "
            f"| {row['sdpa_median_ms']:.2f} | {row['speedup_median']:.2f}x | {sparse} |"
        )
    print(f"wrote {args.csv}")


if __name__ == "__main__":
    main()
