"""MoBA kernels vs causal SDPA, same run: verify, then time forward and forward+backward, and measure memory.

    python benchmarks/bench_attention.py                       # CPU, float32, N = 8K..64K, backend torch
    python benchmarks/bench_attention.py --lengths 8192 --backends torch flex --repeats 5

Each backend is first checked against `moba_attention_reference` (forward and gradients) on a small awkward
case; a mismatch drops it. Every function is warmed up, then SDPA and the backends alternate call by call, so all
see the same machine load; `--busy N` runs N CPU-bound processes beside the timing. Timings are min / median over
repeats (wall clock); ratio = SDPA time / MoBA time (> 1: MoBA is faster); limit = the ratio the work allows
(causal pairs over MoBA's attended pairs plus its gate's dot products). Peak memory of one forward is measured
in a fresh subprocess per case: peak RSS (VmHWM, reset just before the call) minus the RSS just before the call,
inputs already allocated — so it counts what the attention itself allocates, output included (PyTorch has no CPU
allocator statistics). The children run with MALLOC_MMAP_THRESHOLD_=65536 so glibc returns freed large buffers to
the OS instead of keeping them in its heap (its default adaptive threshold would make RSS count memory already
freed). Every CSV row carries the torch version, device, dtype, threads and shape.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import multiprocessing
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moba_hf.kernels import backend_available, moba_attention  # noqa: E402

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


def gate_options(args) -> dict:
    return dict(pooling=args.pooling, sink_blocks=args.sink_blocks, local_blocks=args.local_blocks)


def moba(backend: str, args):
    gate = dict(block_size=args.block_size, top_k=args.top_k, **gate_options(args))

    def run(q, k, v):
        return moba_attention(q, k, v, backend=backend, **gate)

    return run


def inputs(args, n: int, requires_grad: bool = False):
    dtype, dev = DTYPES[args.dtype], torch.device(args.device)
    q = torch.randn(1, args.heads, n, args.head_dim, dtype=dtype, device=dev)
    k = torch.randn(1, args.kv_heads, n, args.head_dim, dtype=dtype, device=dev)
    v = torch.randn(1, args.kv_heads, n, args.head_dim, dtype=dtype, device=dev)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def verify(backend: str, args) -> float:
    """Max abs error (forward and q/k/v gradients) vs the reference on a small awkward case, float64 on CPU."""
    dev = args.device
    dtype = torch.float64 if dev == "cpu" else torch.float32
    q = torch.randn(2, args.heads, 301, 32, dtype=dtype, device=dev, requires_grad=True)
    k = torch.randn(2, args.kv_heads, 301, 32, dtype=dtype, device=dev, requires_grad=True)
    v = torch.randn(2, args.kv_heads, 301, 32, dtype=dtype, device=dev, requires_grad=True)
    grad = torch.randn_like(q)
    err = 0.0
    results = []
    for name in ("reference", backend):
        out = moba_attention(q, k, v, block_size=32, top_k=3, backend=name, **gate_options(args))
        results.append((out, *torch.autograd.grad(out, (q, k, v), grad)))
    for a, b in zip(*results, strict=True):
        err = max(err, (a - b).abs().max().item())
    return err


def timed(fns: dict, args, n: int, backward: bool, repeats: int) -> dict[str, list[float]]:
    """Seconds per call of each function, warmed up, then alternated so every one sees the same machine load."""
    q, k, v = inputs(args, n, requires_grad=backward)

    def once(fn) -> float:
        sync(args.device)
        start = time.perf_counter()
        if backward:
            fn(q, k, v).sum().backward()
        else:
            with torch.no_grad():
                fn(q, k, v)
        sync(args.device)
        q.grad = k.grad = v.grad = None
        return time.perf_counter() - start

    if n <= args.warmup_max:
        for fn in fns.values():
            once(fn)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(once(fn))
    return times


def _spin() -> None:
    while True:
        pass


@contextlib.contextmanager
def busy(processes: int):
    """`processes` CPU-bound processes running beside the timing (a machine shared with other jobs)."""
    workers = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(processes)]
    for w in workers:
        w.start()
    try:
        yield
    finally:
        for w in workers:
            w.terminate()
            w.join()


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """VmHWM: this process's peak RSS (unlike ru_maxrss it does not inherit the parent's peak across exec)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    except OSError:
        pass


def memory_child(args) -> None:
    """Run in a fresh process: one forward, print the peak RSS growth in bytes."""
    fn = sdpa if args.memory_child == "sdpa" else moba(args.memory_child, args)
    with torch.no_grad():  # first calls load code and start threads: keep that out of the measurement
        fn(*inputs(args, min(256, args.lengths[0])))
    q, k, v = inputs(args, args.lengths[0])
    reset_peak_rss()
    before = rss_bytes()
    with torch.no_grad():
        fn(q, k, v)
    print(json.dumps({"peak_delta": peak_rss_bytes() - before}))


def memory(name: str, n: int, args) -> float | None:
    cmd = [sys.executable, __file__, "--memory-child", name, "--lengths", str(n), "--threads", str(args.threads)]
    for flag in (
        "heads",
        "kv_heads",
        "head_dim",
        "block_size",
        "top_k",
        "pooling",
        "sink_blocks",
        "local_blocks",
        "dtype",
        "device",
    ):
        cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    try:
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
        res = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
        return json.loads(res.stdout.strip().splitlines()[-1])["peak_delta"] / 2**20
    except (subprocess.CalledProcessError, ValueError, KeyError, IndexError) as err:
        print(f"memory measurement failed for {name} N={n}: {err}", file=sys.stderr)
        return None


def flop_limit(n: int, block_size: int, top_k: int, sink_blocks: int = 0, local_blocks: int = 0) -> float:
    """The best ratio MoBA can reach at N over causal attention, by work: causal query-key pairs over MoBA's
    attended pairs plus its gate's dot products (one per query and earlier block)."""
    c = torch.arange(n, dtype=torch.float64) // block_size  # each query's own block
    own = torch.arange(n, dtype=torch.float64) - c * block_size + 1
    picked = torch.minimum(c, torch.tensor(float(max(top_k - 1, sink_blocks + local_blocks))))
    return n * (n + 1) / 2 / float((own + picked * block_size + c).sum())


def append_rows(path: Path, rows: list[dict]) -> None:
    """Append CSV rows; a file written before a column existed is rewritten with the new columns, and a row without
    a column leaves it empty."""
    old: list[dict] = []
    fields = list(dict.fromkeys(c for row in rows for c in row))
    if path.exists():
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            old = list(reader)
            fields = list(reader.fieldnames or []) + [c for c in fields if c not in (reader.fieldnames or [])]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, restval="")
        writer.writeheader()
        writer.writerows(old + rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    p.add_argument("--backends", nargs="+", default=["torch"])
    p.add_argument("--block-size", type=int, default=512)
    p.add_argument("--top-k", type=int, default=3)
    p.add_argument("--pooling", default="mean", help="gate option: block key pooling (mean, max, mean+max, bound)")
    p.add_argument("--sink-blocks", type=int, default=0, help="gate option: always attend the first n blocks")
    p.add_argument("--local-blocks", type=int, default=0, help="gate option: always attend the n previous blocks")
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats (halved per doubling of N above 16K)")
    p.add_argument("--busy", type=int, default=0, help="CPU-bound processes running beside the timing")
    p.add_argument("--warmup-max", type=int, default=16384, help="one untimed warm-up run up to this N")
    p.add_argument("--backward-max", type=int, default=32768, help="time forward+backward up to this N")
    p.add_argument("--memory-lengths", type=int, nargs="*", default=[32768], help="N at which to measure memory")
    p.add_argument("--csv", default="benchmarks/results_attention.csv")
    p.add_argument("--memory-only", action="store_true", help="only measure memory at --memory-lengths")
    p.add_argument("--memory-child", help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.memory_child:
        memory_child(args)
        return

    backends = []
    for name in args.backends:
        if not backend_available(name):
            print(f"skip {name}: not available here")
            continue
        err = verify(name, args)
        ok = err < (1e-9 if args.device == "cpu" else 1e-3)
        print(f"verify {name}: max abs error vs reference {err:.2e} -> {'ok' if ok else 'MISMATCH, skipped'}")
        if ok:
            backends.append(name)

    meta = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name()
        if args.device.startswith("cuda")
        else f"{platform.machine()} cpu x{os.cpu_count()}",
        "threads": args.threads,
        "dtype": args.dtype,
    }
    if args.memory_only:
        for n in args.memory_lengths:
            mems = {name: memory(name, n, args) for name in ["sdpa", *backends]}
            print(f"N={n} forward peak RSS growth (MiB): " + ", ".join(f"{k} {v:.1f}" for k, v in mems.items() if v))
        return
    rows = []
    for n in args.lengths:
        repeats = max(1, args.repeats - max(0, (n // 16384).bit_length() - 1))  # 3, 3, 2, 1 at 8K..64K
        base_mem = memory("sdpa", n, args) if n in args.memory_lengths else None
        fns = {"sdpa": sdpa, **{name: moba(name, args) for name in backends}}
        modes = [("fwd", False)] + ([("fwd+bwd", True)] if n <= args.backward_max else [])
        with busy(args.busy):
            measured = {mode: timed(fns, args, n, backward, repeats) for mode, backward in modes}
        base = {mode: per_fn["sdpa"] for mode, per_fn in measured.items()}
        for name in backends:
            mine = {mode: per_fn[name] for mode, per_fn in measured.items()}
            mem = memory(name, n, args) if n in args.memory_lengths else None
            for mode, times in mine.items():
                ref = base[mode]
                rows.append(
                    {
                        **meta,
                        "shape": f"B1 Hq{args.heads} Hkv{args.kv_heads} N{n} D{args.head_dim}",
                        "n": n,
                        "backend": name,
                        "block_size": args.block_size,
                        "top_k": args.top_k,
                        "pooling": args.pooling,
                        "sink_blocks": args.sink_blocks,
                        "local_blocks": args.local_blocks,
                        "mode": mode,
                        "busy": args.busy,
                        "repeats": repeats,
                        "sdpa_min_s": round(min(ref), 4),
                        "sdpa_median_s": round(statistics.median(ref), 4),
                        "moba_min_s": round(min(times), 4),
                        "moba_median_s": round(statistics.median(times), 4),
                        "ratio_min": round(min(ref) / min(times), 2),
                        "ratio_median": round(statistics.median(ref) / statistics.median(times), 2),
                        "flop_limit": round(
                            flop_limit(n, args.block_size, args.top_k, args.sink_blocks, args.local_blocks), 1
                        ),
                        "sdpa_peak_mib": None if mode != "fwd" or base_mem is None else round(base_mem, 1),
                        "moba_peak_mib": None if mode != "fwd" or mem is None else round(mem, 1),
                    }
                )
                print(json.dumps(rows[-1]), flush=True)

    if rows:
        path = Path(args.csv)
        append_rows(path, rows)
        print(f"\n{meta}  (ratio = SDPA time / MoBA time; memory = peak RSS growth of one forward)")
        print(
            f"{'N':>6} {'backend':>8} {'mode':>8} {'SDPA min/med s':>16} {'MoBA min/med s':>16}"
            f" {'ratio':>6} {'limit':>6} {'mem MiB':>14}"
        )
        for r in rows:
            mem = "" if r["moba_peak_mib"] is None else f"{r['moba_peak_mib']:.0f} vs {r['sdpa_peak_mib']:.0f}"
            print(
                f"{r['n']:>6} {r['backend']:>8} {r['mode']:>8} {r['sdpa_min_s']:>7.3f}/{r['sdpa_median_s']:<8.3f}"
                f" {r['moba_min_s']:>7.3f}/{r['moba_median_s']:<8.3f} {r['ratio_min']:>6.2f}"
                f" {r['flop_limit']:>6.1f} {mem:>14}"
            )
        print(f"CSV: {path}")


if __name__ == "__main__":
    main()
