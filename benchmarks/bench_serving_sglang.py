"""SGLang serving speed on CPU: SGLang's own `torch_native` attention against the MoBA plugin, in the same run.

    .venv-sglang/bin/python benchmarks/bench_serving_sglang.py --lengths 4096 8192 16384 --dtype bfloat16 \
        --settings torch_native moba serving-chat [--moba '{"block_size": 512, "top_k": 3}']

Settings: torch_native (SGLang's own attention), moba (--moba, default block 512 / top 3), or a preset name (the
plugin with that preset, e.g. serving-chat). For each setting one server (`python -m sglang.launch_server`, in its
own process group) times, per prompt length, the time to first token: a /generate request with max_new_tokens=1,
the prompt prefilled in one step (chunked prefill off), a different first token per repeat so the radix cache
serves nothing; best and median over --repeats. Before timing, every server answers a 1024-token prompt (its
warm-up), and each plugin setting's greedy tokens on it must equal the transformers path's with the same
MobaConfig in the same --dtype (computed before any server starts): a mismatch stops the run before its timings.
Lengths above the model's max_position_embeddings raise it to the longest request (--json-model-override-args),
so the RoPE table covers it. Rows go to a CSV with the machine (benchmarks/machine.py's line, with the load
average when the setting's timings ended), versions, dtype, settings and date on each
(benchmarks/results_serving_sglang.csv).
SGLang's CPU path imports `sgl_kernel` and torchvision, which have no CPU build on the registry: without them
installed the servers get tests_sglang/stand_ins/ on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests_sglang"), str(ROOT / "tests")]

import servers  # noqa: E402  the tests' server helpers: start, stop, /generate, the transformers path
from machine import describe  # noqa: E402  benchmarks/machine.py
from server_helpers import free_port, model_path, prompt_ids  # noqa: E402  shared with the vLLM plugin's tests

VERIFY_TOKENS, VERIFY_LENGTH = 4, 1024
DTYPES = ("float32", "bfloat16")


def machine_line() -> str:
    """benchmarks/machine.py's description of this machine, with the load average now."""
    read = lambda path: Path(path).read_text() if Path(path).exists() else ""  # noqa: E731
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"{describe(read('/proc/cpuinfo'), read('/proc/meminfo'), len(os.sched_getaffinity(0)))}, load {load}"


def moba_config(setting: str, moba: dict) -> dict | str | None:
    return None if setting == "torch_native" else moba if setting == "moba" else setting


def expected_tokens(setting: str, moba: dict, dtype: str) -> list[int] | None:
    """The transformers path's greedy tokens on the check prompt with the setting's MobaConfig (None for
    torch_native, which has no plugin to check)."""
    config = moba_config(setting, moba)
    if config is None:
        return None
    from moba_hf import MobaConfig

    spec = MobaConfig.from_spec(config).to_dict()
    return servers.hf_generate(spec, [prompt_ids(VERIFY_LENGTH, 11)], VERIFY_TOKENS, dtype=dtype)[0]


def server_args(setting: str, moba: dict, longest: int, dtype: str) -> list[str]:
    from transformers import AutoConfig

    overrides: dict = {}
    config = moba_config(setting, moba)
    if config is not None:
        overrides["moba_config"] = config
    trained = AutoConfig.from_pretrained(model_path()).max_position_embeddings
    if longest + 8 > trained:
        overrides["max_position_embeddings"] = longest + 8
    backend = "torch_native" if setting == "torch_native" else "moba"
    # SGLang's default static memory fraction reserves 1.5 MB per prefill token of the memory it sees: at 16K
    # tokens in one step more than a 24 GB machine has (the server refuses to start); the KV pool is bounded by
    # --max-total-tokens anyway
    return ["--dtype", dtype, "--attention-backend", backend, "--chunked-prefill-size", "-1",
            "--max-prefill-tokens", str(longest + 8), "--context-length", str(longest + 8),
            "--mem-fraction-static", "0.8", "--json-model-override-args", json.dumps(overrides)]  # fmt: skip


def run_setting(
    setting: str, moba: dict, lengths: list[int], repeats: int, log_dir: Path, dtype: str, expected: list[int] | None
) -> dict:
    """Time to first token per length; the server's greedy tokens on the check prompt must be `expected` first."""
    port = free_port()
    args = server_args(setting, moba, max(lengths), dtype)  # the last --dtype wins over SERVER_ARGS' float32
    command = servers.launch_command(*args, port=port, max_total_tokens=max(lengths) + 64)
    stand_ins = importlib.util.find_spec("sgl_kernel") is None
    env = servers.server_env() if stand_ins else {**os.environ, **servers.SERVER_ENV}
    result: dict = {"ttft": {}}
    with servers.server(command, env, log_dir / f"{setting}.log", port) as base:
        got = servers.generate(base, prompt_ids(VERIFY_LENGTH, 11), VERIFY_TOKENS)["tokens"]
        if expected is not None and got != expected:
            raise SystemExit(f"{setting} ({dtype}): greedy tokens {got} != transformers' {expected}; nothing timed")
        for n in lengths:
            ids = prompt_ids(n, 12)
            times = []
            for r in range(repeats):
                t = time.perf_counter()
                servers.generate(base, [ids[0] + r + 1, *ids[1:]], 1)
                times.append(time.perf_counter() - t)
            result["ttft"][n] = times
            print(f"{setting} {n}: {' '.join(f'{t:.2f}' for t in times)} s, load {os.getloadavg()[0]:.1f}", flush=True)
    result["machine"] = machine_line()
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--settings", nargs="+", default=["torch_native", "moba", "serving-chat"])
    parser.add_argument("--moba", type=json.loads, default={"block_size": 512, "top_k": 3})
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="the servers' --dtype")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results_serving_sglang.csv")
    parser.add_argument("--log-dir", type=Path, default=ROOT / "runs" / "bench_serving_sglang")
    args = parser.parse_args(argv)
    if any(n < 2 for n in args.lengths) or args.repeats < 1:
        parser.error(f"--lengths must be >= 2 and --repeats >= 1, got {args.lengths} and {args.repeats}")
    if "torch_native" not in args.settings:
        parser.error("--settings must include torch_native (the baseline every ratio is against)")
    args.log_dir.mkdir(parents=True, exist_ok=True)
    import sglang
    import torch

    expected = {setting: expected_tokens(setting, args.moba, args.dtype) for setting in args.settings}
    results = {}
    for setting in args.settings:
        results[setting] = run_setting(
            setting, args.moba, args.lengths, args.repeats, args.log_dir, args.dtype, expected[setting]
        )
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    fields = ["date", "machine", "torch", "sglang", "dtype", "setting", "config", "length", "repeats",
              "ttft_best_s", "ttft_median_s", "speedup_median_vs_torch_native"]  # fmt: skip
    new = not args.out.exists()
    with args.out.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        if new:
            writer.writeheader()
        for setting, result in results.items():
            for n, times in result["ttft"].items():
                base = statistics.median(results["torch_native"]["ttft"][n])
                row = {"date": date, "machine": result["machine"], "torch": torch.__version__,
                       "sglang": sglang.__version__, "dtype": args.dtype, "setting": setting,
                       "config": json.dumps(moba_config(setting, args.moba)), "length": n, "repeats": len(times),
                       "ttft_best_s": f"{min(times):.3f}", "ttft_median_s": f"{statistics.median(times):.3f}",
                       "speedup_median_vs_torch_native": f"{base / statistics.median(times):.2f}"}  # fmt: skip
                writer.writerow(row)
                print(" | ".join(str(row[k]) for k in fields[4:]))


if __name__ == "__main__":
    main()
