"""The flex backend on CPU: the reference's result for every sequence of shapes, float64 sent to another backend.

The compiled cases run in a fresh interpreter: torch.compile's caches and recompile counts live in the process,
so in the suite's process an earlier test's compiles would decide which code path a later call takes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from kernel_cases import call, rounding_tol

from moba_hf import kernels
from moba_hf.kernels import moba_attention, moba_attention_reference

# (B, Hq, Hkv, Nq, Nk, D), gate keywords: a small B first, then shapes whose second compile torch 2.13 turned
# into wrong values or a CppCompileError when it switched to dynamic shapes
SEQUENCE = [
    ((1, 2, 2, 16, 16, 8), {"block_size": 4, "top_k": 2}),
    ((2, 2, 2, 21, 50, 16), {"block_size": 2, "top_k": 3, "pooling": "max"}),
    ((2, 2, 1, 8, 38, 16), {"block_size": 4, "top_k": 5, "pooling": "max", "sink_blocks": 1, "local_blocks": 1}),
]

_SCRIPT = r"""
import json, random, sys
import torch
from moba_hf.kernels import moba_attention

def fuzz(seed, n):
    rng = random.Random(seed)
    for _ in range(n):
        hkv, g = rng.choice([1, 2]), rng.choice([1, 2])
        nk = rng.randint(1, 70)
        shape = (rng.choice([1, 2]), hkv * g, hkv, rng.randint(1, nk), nk, rng.choice([4, 8, 16]))
        gate = {"block_size": rng.choice([1, 2, 4, 8, 16, 32]), "top_k": rng.randint(1, 5),
                "pooling": rng.choice(["mean", "max", "mean+max", "bound"]),
                "sink_blocks": rng.choice([0, 0, 1]), "local_blocks": rng.choice([0, 0, 1])}
        yield shape, gate

cases = json.loads(sys.argv[1]) if sys.argv[1] != "fuzz" else list(fuzz(int(sys.argv[2]), int(sys.argv[3])))
results = []
for i, ((b, hq, hkv, nq, nk, d), gate) in enumerate(cases):
    g = torch.Generator().manual_seed(i)
    q, k, v = (torch.randn(b, h, n, d, generator=g) for h, n in ((hq, nq), (hkv, nk), (hkv, nk)))
    if sys.argv[2:] == ["nan-after"]:  # each row's memory after its last query / key holds NaN
        q, k, v = (torch.cat([t, torch.full((b, t.shape[1], 200, d), float("nan"))], dim=2)[:, :, : t.shape[2]]
                   for t in (q, k, v))
    try:
        out = moba_attention(q, k, v, backend="flex", **gate)
        err = (out - moba_attention(q, k, v, backend="reference", **gate)).abs().max().item()
    except Exception as e:  # noqa: BLE001 - reported to the test
        err = f"{type(e).__name__}: {str(e)[:200]}"
    results.append([[b, hq, hkv, nq, nk, d], gate, err])
print(json.dumps(results))
"""


def _run_fresh(*args: str) -> list:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, *args], capture_output=True, text=True, timeout=900, env=env, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _assert_all_match(results: list) -> None:
    # float32 flash-style kernel against the float32 reference: rounding of at most 70 keys of head_dim 16
    tol = rounding_tol(torch.float32, 70, 70, 16)
    wrong = [r for r in results if isinstance(r[2], str) or not r[2] <= tol]
    assert not wrong, f"flex differs from the reference (tolerance {tol:.1e}): {wrong}"


@pytest.mark.slow
def test_flex_cpu_after_another_shape_matches_reference():
    """Shape B, then shapes A: each call equals the reference (CPU compiles one static kernel per signature;
    three compiles: 50-95 s with an empty Inductor cache, 20 s with a warm one, on a shared 2-core box)."""
    _assert_all_match(_run_fresh(json.dumps(SEQUENCE)))


@pytest.mark.slow
def test_flex_cpu_reads_nothing_past_the_tensors():
    """Queries and keys that end inside a tile, each (row, head) followed in memory by NaN: the CPU kernel reads
    whole tiles, so without padding the NaN past the last key reaches the output (masked weight 0 x NaN)."""
    cases = [
        ((1, 2, 1, 45, 56, 8), {"block_size": 4, "top_k": 2}),
        ((2, 2, 2, 7, 130, 16), {"block_size": 8, "top_k": 3}),
    ]
    _assert_all_match(_run_fresh(json.dumps(cases), "nan-after"))


@pytest.mark.slow
def test_flex_cpu_fuzz_matches_reference():
    """Seeded random configurations (shapes, GQA, gates) one after another in one process."""
    _assert_all_match(_run_fresh("fuzz", "1", "6"))


def test_flex_cpu_float64_falls_back_with_one_log_line(caplog, monkeypatch):
    """FlexAttention's CPU kernel has no float64: asked for by name, the registry runs "auto"'s pick (one log
    line for any number of calls); the backend called directly refuses with the dtype named."""
    from moba_hf.kernels.flex import moba_attention_flex

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 24, 8, dtype=torch.float64, generator=g) for _ in range(3))
    with caplog.at_level("WARNING", logger="moba_hf"):
        outs = [moba_attention(q, k, v, block_size=8, top_k=2, backend="flex") for _ in range(2)]
    expected = call(moba_attention_reference, q, k, v, block_size=8, top_k=2)
    tol = rounding_tol(torch.float64, 24, 24, 8)
    for out in outs:
        torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
    lines = [r.getMessage() for r in caplog.records if "'flex'" in r.getMessage()]
    assert len(lines) == 1 and "float64" in lines[0] and "'torch'" in lines[0], lines
    assert kernels.resolve_backend("flex", q) == "torch"
    with pytest.raises(ValueError, match="backend 'flex' takes CPU tensors in torch.float32.* got torch.float64"):
        call(moba_attention_flex, q, k, v, block_size=8, top_k=2)
