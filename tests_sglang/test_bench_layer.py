"""benchmarks/bench_sglang_layer.py runs at a small size: the plugin's output equals core.attend's before any timing,
and the three paths are timed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import servers

ROOT = Path(__file__).resolve().parents[1]


def test_bench_sglang_layer_checks_then_times():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(servers.STAND_INS)])}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_sglang_layer.py"), "--tokens", "1100", "--repeats", "1",
           "--threads", "1", "--moba", '{"block_size": 128, "top_k": 2}']  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.splitlines()
    assert lines[0].startswith("1100 tokens, bfloat16, 1 threads"), res.stdout
    assert [line.split("  ")[0] for line in lines[1:]] == [
        "SGLang torch_native extend",
        "plugin moba_pool",
        "core.attend, keys laid out",
    ], res.stdout


def test_bench_sglang_layer_refuses_bad_tokens():
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_sglang_layer.py"), "--tokens", "1"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "--tokens must be >= 2" in res.stderr, res.stderr
