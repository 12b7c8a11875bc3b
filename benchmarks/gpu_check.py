"""One-shot GPU check of the MoBA backends: verify each against the reference, then time against SDPA.

    python benchmarks/gpu_check.py --out results/      # default --out: $OUT if set, else ./gpu_check_out

0. Serve first (where a CUDA vLLM is installed): `bench_serving.py` starts vLLM with the plugin (its Triton
   backend) and without, checks the plugin's greedy tokens against the transformers path at 2K and times the first
   token at 2K and 32K (MoBA block 512 / top 3, float32); its output is copied here.
1. Verify (small case, bf16; a fixed budget and an adaptive one, top_p): forward and q/k/v gradients of every GPU
   backend vs an fp32 reference, with flash-attention's rule: error <= 2x the error of the same attention computed
   naively in bf16 (+1e-4).
2. Time (bf16, B=1, Hq=32, Hkv=8, D=128) forward: N=128K (block 512, top 3) and N=1M (block 4096, top 12) vs
   `scaled_dot_product_attention(is_causal=True)`, CUDA events, min/median over repeats.
3. Decode steps (float32, block 512 / top 3, `decode = "moba"`; `bench_decode.py`'s cases on the GPU): one layer's
   step (Hq=32, Hkv=8, D=128) vs SDPA over the same cache, checked against the reference first; and whole-model
   steps of a SmolLM2-shaped Llama with random weights (nothing is downloaded) over a `StaticCache` on both sides,
   eager, under `torch.compile`, and compiled with mode="reduce-overhead" (CUDA graphs), every cache kind's greedy
   tokens checked equal first.
Every case runs in its own try/except and the script stops starting new cases after --budget seconds, so a
failure or a slow backend costs only its own row. Writes gpu_check.csv and gpu_check.md into --out.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moba_hf.kernels import (  # noqa: E402
    GateOptions,
    backend_available,
    moba_attention,
    selected_blocks,
)

GPU_BACKENDS = ("torch", "flex", "triton", "flash")
CASES = [  # (N, block_size, top_k)
    (131072, 512, 3),
    (1048576, 4096, 12),
]


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


def cuda_time(fn, repeats: int, warmup: int) -> list[float]:
    times = []
    for i in range(warmup + repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with torch.no_grad():
            fn()
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end) / 1e3)
    return times


def naive_same_dtype(q, k, v, *, block_size: int, top_k: int, **gate):
    """MoBA computed naively in the inputs' dtype (scores, softmax, product): flash-attention's error baseline."""
    nq, nk = q.shape[2], k.shape[2]
    sel = selected_blocks(q, k, block_size=block_size, top_k=top_k, gate=GateOptions(**gate))
    key_pos = torch.arange(nk, device=q.device)
    allowed = sel[..., key_pos // block_size] & (
        key_pos[None, :] <= torch.arange(nk - nq, nk, device=q.device)[:, None]
    )
    g = q.shape[1] // k.shape[1]
    scores = q @ k.repeat_interleave(g, dim=1).transpose(-1, -2) * q.shape[-1] ** -0.5
    return scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1) @ v.repeat_interleave(g, dim=1)


# the verified gates: the paper's fixed budget, and an adaptive one (top_p) with the training-free gate
VERIFY_GATES = {
    "top 3": {"block_size": 128, "top_k": 3},
    "top_p 0.8": {"block_size": 128, "top_k": 6, "top_p": 0.8, "pooling": "bound", "sink_blocks": 1},
}


def verify(backend: str, gate: str = "top 3") -> dict:
    torch.manual_seed(0)
    kw = VERIFY_GATES[gate]
    q32 = torch.randn(2, 8, 1000, 64, device="cuda")
    k32 = torch.randn(2, 2, 1000, 64, device="cuda")
    v32 = torch.randn(2, 2, 1000, 64, device="cuda")
    grad32 = torch.randn_like(q32)

    def run(fn, dtype):
        q, k, v = (t.to(dtype).requires_grad_() for t in (q32, k32, v32))
        out = fn(q, k, v, **kw)
        return [out.float(), *(g.float() for g in torch.autograd.grad(out, (q, k, v), grad32.to(dtype)))]

    # the selection is discrete: compare on the blocks the bf16 inputs select, computed exactly in fp32
    exact = run(lambda *t, **a: moba_attention(*(x.float() for x in t), backend="reference", **a), torch.bfloat16)
    baseline = run(naive_same_dtype, torch.bfloat16)
    mine = run(lambda q, k, v, **a: moba_attention(q, k, v, backend=backend, **a), torch.bfloat16)
    res = {}
    ok = True
    for name, e, b, m in zip(("out", "dq", "dk", "dv"), exact, baseline, mine, strict=True):
        err, base = (m - e).abs().max().item(), (b - e).abs().max().item()
        res[name] = f"{err:.1e} (torch {base:.1e})"
        ok &= err <= 2 * base + 1e-4
    res["ok"] = ok
    return res


SERVE_MOBA = '{"block_size": 512, "top_k": 3}'


def serve_check(out_dir: Path, timeout: float) -> list[str]:
    """`bench_serving.py` on this GPU: the plugin's greedy tokens == the transformers path at 2K, then time to first
    token of vLLM's own attention and the plugin at 2K and 32K. The report's lines."""
    if importlib.util.find_spec("vllm") is None:
        return ["vLLM is not installed: skipped"]
    script = Path(__file__).with_name("bench_serving.py")
    command = [sys.executable, str(script), "--lengths", "2048", "32768", "--settings", "vllm", "moba"]
    command += ["--moba", SERVE_MOBA, "--decode-tokens", "8", "--csv", str(out_dir / "serving.csv")]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        tail = (err.stdout or b"").decode(errors="replace").splitlines()[-20:] if err.stdout else []
        return [f"timed out after {timeout:.0f} s", "", "```", *tail, "```"]
    lines = [f"`{' '.join(command[1:])}`: exit {done.returncode}", "", "```", *done.stdout.splitlines()[-30:], "```"]
    if done.returncode != 0:
        lines += ["", "```", *done.stderr.splitlines()[-30:], "```"]
    return lines


DECODE_SHAPE = (32, 8, 128)  # the op rows' query heads, KV heads, head dim
SMOLLM2_SHAPE = dict(  # SmolLM2-135M's architecture, for the model rows (random weights)
    hidden_size=576,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    rope_theta=100000.0,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
)


def smollm2_shaped(layers: int, positions: int, device: str, moba: Any) -> dict[str, torch.nn.Module]:
    """{"moba": ..., "sdpa": ...}: one SmolLM2-shaped Llama with random weights (nothing is downloaded), float32,
    with SDPA, and a copy with `moba` applied."""
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    import moba_hf

    config = LlamaConfig(**SMOLLM2_SHAPE, num_hidden_layers=layers, max_position_embeddings=positions)
    torch.manual_seed(0)
    sdpa_model = LlamaForCausalLM(config).to(device).eval()
    sdpa_model.config._attn_implementation = "sdpa"
    return {"moba": moba_hf.apply(copy.deepcopy(sdpa_model), moba), "sdpa": sdpa_model}


def decode_check(args: argparse.Namespace, device: str) -> tuple[list[str], list[dict]]:
    """Section 3's markdown lines and CSV rows; a case that fails, or starts after --decode-budget seconds, costs
    only its own row. Runs on any device (`--device cpu`: a dry run with small sizes)."""
    import bench_decode as bd

    deadline = time.time() + args.decode_budget
    # a decode step takes well under a millisecond: ten times the kernel rows' repeats; 4 timed model steps per
    # round, 2 rounds per side (bench_decode's --new-tokens / --rounds)
    repeats, new_tokens, rounds, layers = args.repeats * 10, 4, 2, args.decode_layers
    moba = bd.setting("default", 512, 3)
    sync = torch.cuda.synchronize if device == "cuda" else None
    lines = ["## Decode steps, float32, block 512 / top 3, decode = moba (ratio = SDPA / MoBA, median)", ""]
    lines += [
        "| step | context | MoBA min/med ms | SDPA min/med ms | ratio | read limit |",
        "|---|---|---|---|---|---|",
    ]
    rows = []

    def add(bench: str, context: int, times: tuple[list[float], list[float]]) -> None:
        row = {
            "bench": bench,
            "context": context,
            **bd.timing_fields(*times),
            "read_limit": bd.read_limit(moba, context),
        }
        rows.append(row)
        print(row, flush=True)
        lines.append(
            f"| {bench} | {context} | {row['moba_min_ms']}/{row['moba_median_ms']} | {row['sdpa_min_ms']}/"
            f"{row['sdpa_median_ms']} | {row['speedup_median']} | {row['read_limit']} |"
        )

    def failed(bench: str, context: int, what: str) -> None:
        lines.append(f"| {bench} | {context} | {what} | | | |")

    for context in args.decode_op_contexts:
        if time.time() > deadline:
            failed("op", context, "skipped: over the time budget")
            continue
        try:
            case = bd.OpCase(moba, context, device, DECODE_SHAPE)  # checked against the reference here
            add("op", context, bd.timed_pair(case.moba, case.sdpa, repeats, sync=sync))
        except Exception as err:  # noqa: BLE001 - report and go on
            traceback.print_exc()
            failed("op", context, f"FAILED: {type(err).__name__}: {str(err)[:100]}")
        case = None

    models = None  # built at the first model case: a failure there costs the model rows only
    # on a GPU also captured as CUDA graphs (MoBA's one-token steps run `kernels.graph_step` there, no host read)
    caches = ["static", "compiled"] + (["cudagraphs"] if device == "cuda" else [])
    for context in args.decode_model_contexts:
        if time.time() > deadline:
            failed("model", context, "skipped: over the time budget")
            continue
        try:
            if models is None:
                models = smollm2_shaped(args.decode_layers, max(args.decode_model_contexts) + 16, device, moba)
                forwards = {label: bd.model_forwards(model, caches) for label, model in models.items()}
            moba_model, sdpa_model = models["moba"], models["sdpa"]
            for label, model in models.items():
                tokens = bd.check_model_tokens(forwards[label], model, context, new_tokens)
                print(f"check model {context} {label}: {'/'.join(caches)} steps give tokens {tokens}", flush=True)
            for kind in caches:
                times = bd.model_step_times(
                    forwards["moba"][kind],
                    forwards["sdpa"][kind],
                    (moba_model, sdpa_model),
                    kind,
                    context,
                    new_tokens,
                    rounds,
                )
                add(f"model {layers} layers, {kind}", context, times)
        except Exception as err:  # noqa: BLE001
            traceback.print_exc()
            failed("model", context, f"FAILED: {type(err).__name__}: {str(err)[:100]}")
    if "cudagraphs" in caches:  # a step inductor could not capture runs uncaptured: say so beside the rows
        from torch._dynamo.utils import counters

        skips = {name: n for name, n in counters["inductor"].items() if "cudagraph" in name}
        lines += ["", f"CUDA graph skips (inductor's counts over every compiled step): {skips or 'none'}"]
    return lines, rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"))
    p.add_argument("--backends", nargs="+", default=list(GPU_BACKENDS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--budget", type=float, default=150.0, help="no new case starts after this many seconds")
    p.add_argument("--serve-timeout", type=float, default=300.0, help="seconds for the serving check (0: skip it)")
    p.add_argument("--decode-op-contexts", type=int, nargs="*", default=[16384, 131072])
    p.add_argument("--decode-model-contexts", type=int, nargs="*", default=[16384])
    p.add_argument("--decode-layers", type=int, default=30, help="the model rows' layers (SmolLM2 has 30)")
    p.add_argument("--decode-budget", type=float, default=240.0, help="no new decode case after this many seconds")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a dry run of the decode section")
    args = p.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    lines = [f"# GPU check ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})", ""]
    if args.device == "cpu":
        decode_lines, _ = decode_check(args, "cpu")
        (out_dir / "gpu_check.md").write_text("\n".join([*lines, *decode_lines]) + "\n")
        print("\n".join(decode_lines))
        return
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        (out_dir / "gpu_check.md").write_text("\n".join([*lines, "no CUDA device"]) + "\n")
        return
    dev = torch.cuda.get_device_name()
    lines += [f"device {dev}, torch {torch.__version__}", ""]
    print(lines[2])

    if args.serve_timeout > 0:  # first: the plugin's GPU backend has never run on a GPU
        lines += ["## Serving: the vLLM plugin (MoBA block 512 / top 3, float32) vs vLLM's own attention", ""]
        lines += serve_check(out_dir, args.serve_timeout)
        print("\n".join(lines[-3:]), flush=True)
        lines.append("")
    kernels_start = time.time()  # --budget counts from here

    backends = []
    lines += ["## Verification (bf16 vs fp32 reference; rule: error <= 2x PyTorch's bf16 error)", ""]
    lines += ["| backend | gate | out | dq | dk | dv | ok |", "|---|---|---|---|---|---|---|"]
    for name in args.backends:
        if not backend_available(name):
            print(f"{name}: unavailable, skipped")
            lines.append(f"| {name} | | unavailable | | | | |")
            continue
        verified = True
        for gate in VERIFY_GATES:
            try:
                res = verify(name, gate)
            except Exception as err:  # noqa: BLE001 - report and go on
                traceback.print_exc()
                lines.append(f"| {name} | {gate} | FAILED: {type(err).__name__}: {str(err)[:120]} | | | | |")
                verified = False
                continue
            print(f"verify {name} ({gate}): {res}")
            lines.append(f"| {name} | {gate} | {res['out']} | {res['dq']} | {res['dk']} | {res['dv']} | {res['ok']} |")
            verified &= res["ok"]
        if verified:
            backends.append(name)

    rows = []
    lines += ["", "## Forward time, bf16, B=1 Hq=32 Hkv=8 D=128 (ratio = SDPA / MoBA)", ""]
    lines += [
        "| N | block | top_k | backend | SDPA min/med s | MoBA min/med s | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for n, bs, top_k in CASES:
        if time.time() - kernels_start > args.budget:
            lines.append(f"| {n} | {bs} | {top_k} | (skipped: over the time budget) | | | |")
            continue
        torch.cuda.empty_cache()
        try:
            q = torch.randn(1, 32, n, 128, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(1, 8, n, 128, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(1, 8, n, 128, device="cuda", dtype=torch.bfloat16)
            repeats = args.repeats if n <= 131072 else 1
            base = cuda_time(lambda q=q, k=k, v=v: sdpa(q, k, v), repeats, 1 if n <= 131072 else 0)
        except Exception as err:  # noqa: BLE001
            traceback.print_exc()
            lines.append(f"| {n} | {bs} | {top_k} | SDPA FAILED: {type(err).__name__}: {str(err)[:100]} | | | |")
            continue
        for name in backends:
            if time.time() - kernels_start > args.budget:
                lines.append(f"| {n} | {bs} | {top_k} | {name} (skipped: over the time budget) | | | |")
                continue
            try:
                # flex compiles on its first call: always warm it up; at 1M skip the others' warm-up to save time
                warmup = 1 if n <= 131072 or name == "flex" else 0
                times = cuda_time(
                    lambda q=q, k=k, v=v, bs=bs, top_k=top_k, name=name: moba_attention(
                        q, k, v, block_size=bs, top_k=top_k, backend=name
                    ),
                    repeats,
                    warmup,
                )
            except Exception as err:  # noqa: BLE001
                traceback.print_exc()
                torch.cuda.empty_cache()
                lines.append(f"| {n} | {bs} | {top_k} | {name} FAILED: {type(err).__name__}: {str(err)[:100]} | | | |")
                continue
            row = {
                "torch": torch.__version__,
                "device": dev,
                "dtype": "bfloat16",
                "shape": f"B1 Hq32 Hkv8 N{n} D128",
                "backend": name,
                "block_size": bs,
                "top_k": top_k,
                "repeats": repeats,
                "sdpa_min_s": round(min(base), 4),
                "sdpa_median_s": round(statistics.median(base), 4),
                "moba_min_s": round(min(times), 4),
                "moba_median_s": round(statistics.median(times), 4),
                "ratio_min": round(min(base) / min(times), 2),
            }
            rows.append(row)
            print(row, flush=True)
            lines.append(
                f"| {n} | {bs} | {top_k} | {name} | {row['sdpa_min_s']}/{row['sdpa_median_s']} "
                f"| {row['moba_min_s']}/{row['moba_median_s']} | {row['ratio_min']} |"
            )
        q = k = v = None  # free before the next case
    torch.cuda.empty_cache()
    decode_lines, decode_rows = decode_check(args, "cuda")
    lines += ["", *decode_lines]
    for row in decode_rows:  # one CSV: the kernel rows' columns, the decode rows' own
        rows.append({"torch": torch.__version__, "device": dev, "dtype": "float32", **row})
    lines += ["", f"total {time.time() - t0:.0f} s"]
    (out_dir / "gpu_check.md").write_text("\n".join(lines) + "\n")
    if rows:
        with (out_dir / "gpu_check.csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for row in rows for k in row)))
            writer.writeheader()
            writer.writerows(rows)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
