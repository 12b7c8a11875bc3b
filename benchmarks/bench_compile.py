"""Compiled vs eager: `torch.compile` (inductor, CPU) of a MoBA model against the same model eagerly.

    .venv/bin/python benchmarks/bench_compile.py                                   # SmolLM2, training-free, 512 768
    .venv/bin/python benchmarks/bench_compile.py --lengths 512 --new-tokens 4 --repeats 2 --decode moba

One model, its forward called two ways: `torch.compile(model)` and `model` itself. Checked first, at every length:
greedy decoding (a prefill, then --new-tokens cached steps, each token the argmax) gives the same tokens both ways,
and the prefill logits agree to float32 rounding. The first compiled call at each length compiles (not timed); then
--repeats prefills per length and way, alternated so both see the same load, and every decode step of --repeats
greedy runs. Prints one markdown row per length and phase: best and median of both, and the ratios eager / compiled
(> 1: compiled is faster), with the machine, torch version and date.

Under torch.compile the MoBA attention call and its cache hooks run eagerly (a graph break per layer; see the README's
"torch.compile"): what compiles is everything around attention (embeddings, projections, RoPE, norms, MLPs).
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from moba_hf import MobaConfig  # noqa: E402
from moba_hf.models import load  # noqa: E402


def machine() -> str:
    """CPU model, vector extensions and core count, read from /proc/cpuinfo."""
    model, flags = platform.processor() or "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    vector = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    used = torch.backends.cpu.get_cpu_capability()
    return f"{model} (flags: {vector}; torch's CPU kernels: {used}), {torch.get_num_threads()} threads"


def _cache_keyword() -> str:
    from transformers import LlamaForCausalLM

    params = inspect.signature(LlamaForCausalLM.forward).parameters
    return "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.2x


def greedy(forward, ids: torch.Tensor, new_tokens: int) -> tuple[list[int], torch.Tensor, float, list[float]]:
    """(tokens, prefill logits, prefill seconds, seconds of each decode step) of greedy decoding with `forward`."""
    start = time.perf_counter()
    out = forward(ids, use_cache=True)
    prefill = time.perf_counter() - start
    logits, cache = out.logits, out.past_key_values
    token = out.logits[:, -1:].argmax(-1)
    tokens, steps = [int(token)], []
    for _ in range(new_tokens - 1):
        start = time.perf_counter()
        out = forward(token, use_cache=True, **{_cache_keyword(): cache})
        steps.append(time.perf_counter() - start)
        token = out.logits[:, -1:].argmax(-1)
        tokens.append(int(token))
    return tokens, logits, prefill, steps


def row(length: int, phase: str, eager: list[float], compiled: list[float]) -> str:
    e_best, e_med = min(eager) * 1e3, statistics.median(eager) * 1e3
    c_best, c_med = min(compiled) * 1e3, statistics.median(compiled) * 1e3
    return (
        f"| {length} | {phase} | {e_best:.1f} | {e_med:.1f} | {c_best:.1f} | {c_med:.1f} | "
        f"{e_best / c_best:.2f} | {e_med / c_med:.2f} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="training-free", help="the MoBA preset (default: training-free)")
    parser.add_argument("--decode", choices=["moba", "full"], help="override the preset's decode mode")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 768], help="prompt lengths in tokens")
    parser.add_argument("--new-tokens", type=int, default=8, help="greedy tokens per run (the first is the prefill's)")
    parser.add_argument("--repeats", type=int, default=3, help="timed prefills / greedy runs per length and way")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (1: no spin-waiting on a busy box)")
    args = parser.parse_args(argv)
    if args.new_tokens < 2 or args.repeats < 1 or args.threads < 1 or min(args.lengths) < 2:
        parser.error("--new-tokens must be >= 2, --repeats and --threads >= 1 and every length >= 2")
    torch.set_num_threads(args.threads)

    config = MobaConfig.preset(args.preset)
    if args.decode:
        config = config.replace(decode=args.decode)
    model, tokenizer = load("smollm2", moba=config)
    compiled = torch.compile(model)
    text = "The quick brown fox jumps over the lazy dog while the river runs past the old mill. " * 400
    all_ids = tokenizer(text, return_tensors="pt").input_ids
    rows = []
    with torch.no_grad():
        for length in args.lengths:
            ids = all_ids[:, :length]
            if ids.shape[1] != length:
                parser.error(f"--lengths: the text has {all_ids.shape[1]} tokens, fewer than {length}")
            start = time.perf_counter()
            got, got_logits, _, _ = greedy(compiled, ids, args.new_tokens)  # compiles
            compile_s = time.perf_counter() - start
            want, want_logits, _, _ = greedy(model, ids, args.new_tokens)
            if got != want:
                raise SystemExit(f"length {length}: compiled tokens {got} != eager tokens {want}")
            diff = float((got_logits - want_logits).abs().max())
            print(f"# length {length}: tokens equal, prefill logits max |diff| {diff:.2e}, first compiled run "
                  f"{compile_s:.1f} s (compiling)", flush=True)  # fmt: skip
            prefill = {"eager": [], "compiled": []}
            steps = {"eager": [], "compiled": []}
            for _ in range(args.repeats):
                for way, forward in (("eager", model), ("compiled", compiled)):
                    tokens, _, seconds, step_seconds = greedy(forward, ids, args.new_tokens)
                    if tokens != want:
                        raise SystemExit(f"length {length}: {way} tokens changed between runs")
                    prefill[way].append(seconds)
                    steps[way].extend(step_seconds)
            rows.append(row(length, "prefill", prefill["eager"], prefill["compiled"]))
            rows.append(row(length, "decode step", steps["eager"], steps["compiled"]))
    setting = f"{args.preset} (decode = {config.decode!r})"
    print(f"\n{datetime.date.today()}, {machine()}, torch {torch.__version__}, SmolLM2-135M float32, {setting}, "
          f"{args.repeats} repeats, {args.new_tokens} tokens per greedy run")  # fmt: skip
    print("| prompt tokens | phase | eager best ms | eager median ms | compiled best ms | compiled median ms "
          "| best eager / compiled | median eager / compiled |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
