"""Every ```python block of README.md and docs/*.md runs as printed, each in a fresh interpreter (slow).

How a block is run: `python -c` with `path = "<the embedded SmolLM2 directory>"` put before its first line
(`path` is the one name a snippet may use without defining it: the reader's checkpoint), the working directory
a new temporary one holding a copy of the repository's `configs/` (snippets name files as from a clone's root
and write their outputs under `runs/` there). It must exit 0.

A block that cannot run on a CPU box without a hub has, on the line right before its opening fence,

    <!-- not run: <reason> -->

and is reported as skipped with that reason; the marker is visible in the Markdown source. A block without
the marker is run, so a snippet that cannot run as printed fails here. Bash, TOML and plain blocks are not run.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN = re.compile(r"^<!--\s*not run:\s*(?P<reason>.*?)\s*-->$")
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>\S*)\s*$")
TIMEOUT_S = 900  # a hung snippet; on an idle 2-core machine the slowest takes well under a minute

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Block:
    file: str  # relative to the repository root
    line: int  # of the opening fence, 1-based
    code: str
    not_run: str | None  # the marker's reason

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}"


def python_blocks(text: str, file: str) -> list[Block]:
    """The ```python blocks of one Markdown text, with the `not run` marker of the line before each."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            raise ValueError(f"{file}:{i + 1}: a code fence that is never closed")
        if fence["lang"] in ("python", "py", "python3"):
            marker = NOT_RUN.match(lines[i - 1].strip()) if i > 0 else None
            body = [line[len(fence["indent"]) :] for line in lines[i + 1 : end]]
            blocks.append(Block(file, i + 1, "\n".join(body) + "\n", marker["reason"] if marker else None))
        i = end + 1
    return blocks


BLOCKS = [block for doc in DOCS for block in python_blocks(doc.read_text(), str(doc.relative_to(ROOT)))]


def test_blocks_and_markers_are_found():
    # a parser that found nothing would skip every snippet silently
    text = "```bash\nls\n```\n```python\nprint(1)\n```\n\n<!-- not run: needs a CUDA GPU -->\n"
    text += "  ```python\n  x = 1\n  ```\n"
    run, marked = python_blocks(text, "x.md")
    assert (run.id, run.code, run.not_run) == ("x.md:4", "print(1)\n", None)
    assert (marked.id, marked.code, marked.not_run) == ("x.md:9", "x = 1\n", "needs a CUDA GPU")
    first = BLOCKS[0]
    assert first.file == "README.md" and 'attn_implementation="moba"' in first.code and first.not_run is None
    with pytest.raises(ValueError, match="x.md:1: a code fence that is never closed"):
        python_blocks("```python\nx\n", "x.md")


@pytest.fixture(scope="module")
def model_dir() -> str:
    from moba_hf.models import local_path

    return str(local_path())


@pytest.mark.parametrize("block", BLOCKS, ids=[block.id for block in BLOCKS])
def test_snippet_runs(block: Block, model_dir: str, tmp_path: Path):
    if block.not_run is not None:
        pytest.skip(f"{block.id}: {block.not_run}")
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    program = f"path = {model_dir!r}\n{block.code}"
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, "-c", program], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert proc.returncode == 0, f"{block.id} failed (rc {proc.returncode}):\n{block.code}\n{proc.stderr[-4000:]}"
