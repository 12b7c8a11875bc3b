"""Imports point down only (docs/architecture.md): kernels know neither transformers nor the glue above them,
integration knows nothing of eval / train / the command line or vLLM, the vLLM plugin nothing of eval / train /
the command line. Read from the source with ast, so a lazy import inside a function counts too."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "moba_hf"

FORBIDDEN = {
    "kernels": (
        "transformers", "moba_hf.integration", "moba_hf.eval", "moba_hf.train", "moba_hf.cli", "moba_hf.dca",
        "moba_hf.config", "moba_hf.models", "vllm", "moba_hf.vllm",
    ),
    "integration": ("moba_hf.eval", "moba_hf.train", "moba_hf.cli", "moba_hf.dca.cli", "vllm", "moba_hf.vllm"),
    "vllm": ("moba_hf.eval", "moba_hf.train", "moba_hf.cli", "moba_hf.demo"),
}  # fmt: skip


def imported_modules(path: Path) -> set[str]:
    """Absolute names of every module `path` imports (relative imports resolved against its package)."""
    package = ["moba_hf", *path.relative_to(PACKAGE).parent.parts]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            names.add(module)
            names |= {f"{module}.{alias.name}" for alias in node.names}  # `from . import sparsity`
    return names


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layers_import_only_downwards(layer):
    files = sorted((PACKAGE / layer).rglob("*.py"))
    assert files
    offences = [
        f"{path.relative_to(PACKAGE.parent)} imports {name}"
        for path in files
        for name in sorted(imported_modules(path))
        if any(_under(name, prefix) for prefix in FORBIDDEN[layer])
    ]
    assert not offences, "\n".join(offences)


def test_import_reader_resolves_relative_imports():
    names = imported_modules(PACKAGE / "integration" / "attention.py")
    assert "moba_hf.kernels" in names and "moba_hf.integration.sparsity" in names
