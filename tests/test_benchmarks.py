"""The benchmark scripts still run (tiny sizes) and write what RESULTS.md quotes; no timing is asserted."""

import csv
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_bench_attention_verifies_then_writes_rows(tmp_path):
    out = tmp_path / "attention.csv"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_attention.py"), "--lengths", "300", "--repeats", "1"]
    cmd += ["--block-size", "32", "--top-k", "3", "--pooling", "bound", "--sink-blocks", "1"]
    cmd += ["--memory-lengths", "300", "--csv", str(out), "--threads", "1", "--busy", "1"]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "verify torch: max abs error vs reference" in res.stdout and "-> ok" in res.stdout
    rows = list(csv.DictReader(out.open()))
    assert {r["mode"] for r in rows} == {"fwd", "fwd+bwd"}
    assert all(r["backend"] == "torch" and r["pooling"] == "bound" and r["sink_blocks"] == "1" for r in rows)
    assert all(r["busy"] == "1" for r in rows)
    assert all(float(r["sdpa_min_s"]) > 0 and float(r["moba_min_s"]) > 0 for r in rows)


@pytest.mark.slow
def test_bench_model_verifies_bfloat16_then_writes_a_row(tmp_path):
    out = tmp_path / "model.csv"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_model.py"), "--tokens", "160", "--block-size", "32"]
    cmd += ["--dtype", "bfloat16", "--csv", str(out), "--threads", "1"]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "vs float32 sdpa" in res.stdout and "(bfloat16 sdpa:" in res.stdout
    assert "idle: moba prefill 160 tokens" in res.stdout and "busy: moba prefill 160 tokens" in res.stdout
    idle, loaded = list(csv.DictReader(out.open()))
    assert (idle["load"], idle["busy_processes"], loaded["load"], loaded["busy_processes"]) == (
        "idle",
        "0",
        "busy",
        "1",
    )
    for row in (idle, loaded):
        assert row["model"] == "SmolLM2-135M-Instruct bfloat16" and row["tokens"] == "160" and row["block_size"] == "32"
        assert float(row["sdpa_min_s"]) > 0 and float(row["moba_min_s"]) > 0 and float(row["ratio_median"]) > 0
        assert row["date"]


@pytest.mark.slow
def test_bench_model_against_dense_dca(tmp_path):
    # c = 64, s = 56: a 160-token prefill spans three DCA chunks, the baseline the same DCA with sparse = false
    config = tmp_path / "dca.toml"
    config.write_text("[moba]\nblock_size = 8\ntop_k = 2\ndense_tail = 16\n\n[moba.dca]\npretraining_length = 64\n")
    out = tmp_path / "model.csv"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_model.py"), "--tokens", "160", "--config", str(config)]
    cmd += ["--baseline", "dense", "--csv", str(out), "--threads", "1", "--loads", "idle"]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "dense prefill 160 tokens" in res.stdout
    assert "DCA + MoBA with all blocks selected at 128 tokens, 30 layers: worst layer" in res.stdout
    (row,) = list(csv.DictReader(out.open()))
    assert row["baseline"] == "dense" and '"dense_tail": 16' in row["moba_config"]
    assert '"pretraining_length": 64' in row["moba_config"]
    assert float(row["sdpa_min_s"]) > 0 and float(row["moba_min_s"]) > 0


def test_bench_decode_op_checks_then_times_idle_and_busy(tmp_path):
    out = tmp_path / "decode.csv"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_decode.py"), "--op-contexts", "128", "300"]
    cmd += ["--model-contexts", "--repeats", "2", "--block-size", "64", "--top-k", "2", "--csv", str(out)]
    cmd += ["--threads", "default", "1"]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "check op default 300: max abs error vs reference" in res.stdout and "-> ok" in res.stdout
    rows = list(csv.DictReader(out.open()))
    cases = [(r["threads"], r["setting"], r["context"], r["load"]) for r in rows]
    settings = ("default", "training-free")
    default = rows[0]["threads"]  # torch's own choice, labelled
    assert default.endswith(" (default)")
    want = [
        (t, s, c, load) for t in (default, "1") for load in ("idle", "busy") for s in settings for c in ("128", "300")
    ]
    assert cases == want
    assert all(float(r["moba_min_ms"]) > 0 and float(r["speedup_best"]) > 0 and r["date"] and r["torch"] for r in rows)
    # read limit: 300 keys / (2 blocks of 64) for the default setting; 128 keys / all of them (5 + 1 + 1 blocks of 64)
    limits = {(r["setting"], r["context"]): float(r["read_limit"]) for r in rows}
    assert limits[("default", "300")] == round(300 / 128, 2) and limits[("training-free", "128")] == 1.0
    # the keys a step reads per KV head: at least one query head's (its own block of 44, one of 64), at most all
    for r in rows:
        read, context = float(r["kv_keys_read"]), int(r["context"])
        assert (108 if (r["setting"], context) == ("default", 300) else 1) <= read <= context
        assert float(r["kv_read_limit"]) == pytest.approx(context / read, abs=0.01)
    bad = subprocess.run([*cmd[:2], "--threads", "0", "--model-contexts"], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode != 0 and "--threads takes 'default' or thread counts >= 1, got '0'" in bad.stderr


def test_tail_selection_probe_checks_its_kernel_first():
    cmd = [sys.executable, str(ROOT / "benchmarks" / "probe_tail_selection.py"), "--check-only"]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "check: tail-estimated torch kernel vs naive" in res.stdout and "-> ok" in res.stdout
    bad = subprocess.run([*cmd[:2], "--tail", "0"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert bad.returncode == 2 and "--tail must be at least 1, got 0" in bad.stderr


def test_machine_line_reads_the_vector_isa_from_the_cpu_flags():
    import importlib.util

    spec = importlib.util.spec_from_file_location("machine", ROOT / "benchmarks" / "machine.py")
    machine = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(machine)
    cpu = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse avx avx2 fma hypervisor\n\nprocessor\t: 1\n"
    line = machine.describe(cpu, "MemTotal:       24683772 kB\n", 2)
    assert "AMD EPYC (VM), 2 cores, AVX2, 23.5 GiB" in line  # AVX2 only: no avx512f flag
    assert machine.describe(cpu.replace("avx2", "avx2 avx512f"), "", 2).endswith("2 cores, AVX-512")
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "machine.py")], capture_output=True, text=True)
    assert res.returncode == 0 and " cores, " in res.stdout and ", load " in res.stdout, res.stderr


@pytest.mark.slow
def test_bench_decode_model_rows_check_tokens_then_time_each_cache(tmp_path):
    """The whole-model rows (SmolLM2): every cache kind's greedy tokens checked equal, then one row per cache with
    the thread count, the read limit and the attention-free limit."""
    out = tmp_path / "decode.csv"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_decode.py"), "--op-contexts", "300", "--threads", "1"]
    cmd += ["--model-contexts", "600", "--caches", "dynamic", "static", "--model-threads", "1", "--loads", "idle"]
    cmd += ["--block-size", "64", "--top-k", "2", "--new-tokens", "2", "--rounds", "1", "--csv", str(out)]
    cmd += ["--settings", "default", "--repeats", "2"]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert res.returncode == 0, res.stderr
    assert "check model default 600 moba: dynamic/static caches give tokens" in res.stdout
    op, *rows = list(csv.DictReader(out.open()))  # one CSV: the op row leaves the model rows' columns empty
    assert op["bench"] == "op" and op["free_limit"] == ""
    assert [r["bench"] for r in rows] == ["smollm2-step-dynamic", "smollm2-step-static"]
    assert all(r["threads"] == "1" and r["read_limit"] == "4.69" and float(r["speedup_median"]) > 0 for r in rows)
    # the attention-free step: SDPA's median over it, timed in the same rounds
    for r in rows:
        assert float(r["free_median_ms"]) > 0
        assert float(r["free_limit"]) == pytest.approx(float(r["sdpa_median_ms"]) / float(r["free_median_ms"]), 1e-2)
        # the read-bound limit: the free step plus SDPA's attention time scaled to the keys read per KV head
        sdpa, free, read = (float(r[k]) for k in ("sdpa_median_ms", "free_median_ms", "kv_keys_read"))
        assert 0 < read <= 601
        want = sdpa / (free + (sdpa - free) * read / 601)
        assert float(r["read_bound_limit"]) == pytest.approx(want, 1e-2)


@pytest.mark.slow
def test_gpu_check_decode_section_dry_runs_on_the_cpu(tmp_path):
    """The GPU check's decode section (`--device cpu`): the op checked against the reference, the static and
    compiled model steps' tokens checked equal, then one row each; a case past the budget is skipped by name."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--out", str(tmp_path)]
    cmd += ["--decode-op-contexts", "1536", "--decode-model-contexts", "1100", "--decode-layers", "2"]
    res = subprocess.run([*cmd, "--repeats", "1"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert res.returncode == 0, res.stderr
    assert "check model 1100 moba: static/compiled steps give tokens" in res.stdout
    table = (tmp_path / "gpu_check.md").read_text()
    for row in ("| op | 1536 |", "| model 2 layers, static | 1100 |", "| model 2 layers, compiled | 1100 |"):
        assert row in table and "FAILED" not in table
    res = subprocess.run([*cmd, "--decode-budget", "0"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert res.returncode == 0 and "| op | 1536 | skipped: over the time budget |" in res.stdout, res.stderr
