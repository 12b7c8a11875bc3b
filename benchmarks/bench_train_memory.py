"""Peak memory of one training step with gradient checkpointing: MoBA vs "sdpa" at 16K tokens per row.

    python benchmarks/bench_train_memory.py                          # tiny Llama, 16K, block 512, top 3
    python benchmarks/bench_train_memory.py --tokens 4096 --model smollm2

Each measurement runs in its own subprocess, since a process's peak resident memory (getrusage ru_maxrss;
tracemalloc does not see torch's allocator) only grows. A child builds the model, notes its resident memory,
runs forward + backward of one row (`use_cache=False`, gradient checkpointing on, non-reentrant) and reports
the peak; "step" = peak - memory before the step, i.e. what the step itself adds.

Checks before measuring, each in a child at 1024 tokens: MoBA with every block selected gives the "sdpa" loss
and gradients (within float32 rounding), and checkpointing leaves loss and gradients unchanged.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moba_hf import MobaConfig  # noqa: E402
from moba_hf.integration import apply  # noqa: E402

TINY = dict(
    vocab_size=1024,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    max_position_embeddings=32768,
)


def build(model_name: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if model_name == "tiny":
        return LlamaForCausalLM(LlamaConfig(**TINY))
    from moba_hf.models import load

    return load(model_name)[0]


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def step(model, tokens: int, attn: str, block_size: int, top_k: int, checkpointing: bool) -> dict:
    """One forward + backward of a row of `tokens` random ids; loss and the gradient, flattened."""
    if attn == "moba":
        apply(model, MobaConfig(block_size=block_size, top_k=top_k))
    else:
        model.set_attn_implementation("sdpa")
    model.config.use_cache = False
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(1))
    before = rss_mb()
    start = time.perf_counter()
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return {"loss": loss.item(), "grad": grad, "before_mb": before, "peak_mb": peak, "seconds": seconds}


def child(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    model = build(args.model)
    if args.check:
        n = 1024
        dense = step(build(args.model), n, "sdpa", args.block_size, args.top_k, False)
        every = step(build(args.model), n, "moba", 128, n // 128, True)  # all blocks selected == dense
        plain = step(model, n, "moba", 128, 2, False)
        ckpt = step(build(args.model), n, "moba", 128, 2, True)
        scale = dense["grad"].abs().max().item()
        report = {
            "all_blocks_vs_sdpa_loss": abs(every["loss"] - dense["loss"]),
            "all_blocks_vs_sdpa_grad": (every["grad"] - dense["grad"]).abs().max().item() / scale,
            "checkpointing_loss": abs(plain["loss"] - ckpt["loss"]),
            "checkpointing_grad": (plain["grad"] - ckpt["grad"]).abs().max().item() / scale,
        }
    else:
        r = step(model, args.tokens, args.attn, args.block_size, args.top_k, True)
        report = {k: v for k, v in r.items() if k != "grad"} | {"step_mb": r["peak_mb"] - r["before_mb"]}
    print(json.dumps(report))


def run_child(argv: list[str]) -> dict:
    done = subprocess.run([sys.executable, __file__, "--child", *argv], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--model", default="tiny", help='"tiny" (a random 2-layer Llama) or an embedded model name')
    p.add_argument("--block-size", type=int, default=512)
    p.add_argument("--top-k", type=int, default=3)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--attn", default="moba", help=argparse.SUPPRESS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--check", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    common = ["--model", args.model, "--block-size", str(args.block_size), "--top-k", str(args.top_k)]
    common += ["--threads", str(args.threads), "--tokens", str(args.tokens)]
    check = run_child([*common, "--check"])
    eps = torch.finfo(torch.float32).eps
    # loss: a mean of ~1e3 terms of order 10; gradient: relative to its largest element
    assert check["all_blocks_vs_sdpa_loss"] < 1e4 * eps and check["all_blocks_vs_sdpa_grad"] < 1e4 * eps, check
    assert check["checkpointing_loss"] == 0 and check["checkpointing_grad"] == 0, check
    print(f"check passed: {json.dumps(check)}")
    results = {attn: run_child([*common, "--attn", attn]) for attn in ("sdpa", "moba")}
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(
        f"# {stamp}, {platform.processor() or platform.machine()}, torch {torch.__version__}, {args.threads} threads,"
        f" model {args.model}, {args.tokens} tokens, block {args.block_size} / top {args.top_k}, checkpointing on"
    )
    print("| attention | step peak (MB) | process peak (MB) | step time (s) | loss |\n|---|---|---|---|---|")
    for attn, r in results.items():
        print(f"| {attn} | {r['step_mb']:.0f} | {r['peak_mb']:.0f} | {r['seconds']:.1f} | {r['loss']:.4f} |")
    ratio = results["sdpa"]["step_mb"] / max(results["moba"]["step_mb"], 1e-9)
    print(f"sdpa / moba step memory: {ratio:.2f}x")


if __name__ == "__main__":
    main()
