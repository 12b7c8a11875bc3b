"""Imports point down only (docs/architecture.md shows the same table). Read from the source with ast, so an import
inside a function counts, and so does a module path written as a string (`importlib.import_module("moba_hf.x")`,
`__import__`, the name -> module maps of lazy `__getattr__`s, the backend registry's "moba_hf.kernels.x:fn")."""

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "moba_hf"
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"

# Bottom first. A module may import its own entry and the entries of the rows below it; two entries of one row know
# nothing of each other. An entry is a file or a package (all of it, but for the files of that package with
# entries of their own). A package's __init__ runs whenever any of its modules is imported, so what it imports at
# import time must be allowed to each of them.
LAYERS = (
    (
        "options.py",
        "window.py",
        "logs.py",
        "rundir.py",
        "lazy.py",
    ),  # torch-free: vocabularies, the position window, log-once, run directories, names loaded on first use
    ("kernels",),  # tensor math
    ("presets",),  # the shipped preset files and their names
    ("dca/config.py", "config_files.py", "config_vocabularies.py"),  # DcaConfig; the file reader; other vocabularies
    ("config.py",),  # MobaConfig, read from a mapping or a file
    ("core.py",),  # the attention of one sequence, for every host
    ("integration",),  # everything that knows transformers
    ("dca", "models.py", "serving.py"),  # the public DCA names; the one model loader; what server plugins share
    ("__init__.py",),  # the package's public names
    ("cli_args.py", "prompts.py"),  # what the commands share; the passkey prompt eval and train share
    ("eval", "train", "vllm", "sglang"),
    ("demo.py", "dca/cli.py", "presets/cli.py", "train/experiment.py"),  # commands built on the row below
    ("cli.py",),  # `moba-hf`: finds each command's module
)

THIRD_PARTY = {  # entry -> libraries it may not import at all
    "options.py": ("torch", "transformers", "vllm", "sglang"),
    "window.py": ("torch", "transformers", "vllm", "sglang"),
    "logs.py": ("torch", "transformers", "vllm", "sglang"),
    "rundir.py": ("torch", "transformers", "vllm", "sglang"),
    "lazy.py": ("torch", "transformers", "vllm", "sglang"),
    "presets": ("torch", "transformers", "vllm", "sglang"),
    "dca/config.py": ("torch", "transformers", "vllm", "sglang"),
    "config_files.py": ("torch", "transformers", "vllm", "sglang"),
    "config_vocabularies.py": ("torch", "transformers", "vllm", "sglang"),
    "config.py": ("torch", "transformers", "vllm", "sglang"),
    "kernels": ("transformers", "vllm", "sglang"),
    "core.py": ("transformers", "vllm", "sglang"),
    "integration": ("vllm", "sglang"),
    "cli_args.py": ("torch", "transformers", "vllm", "sglang"),
    "prompts.py": ("torch", "transformers", "vllm", "sglang"),
}

_MODULE_PATH = re.compile(r"moba_hf(\.[A-Za-z_]\w*)+(:[A-Za-z_]\w*)?")
_LAYER = {entry: row for row, entries in enumerate(LAYERS) for entry in entries}


def modules(root: Path = PACKAGE) -> dict[str, Path]:
    """Dotted name -> file of every module in the package."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = ["moba_hf", *path.relative_to(root).with_suffix("").parts]
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def entry(path: Path, root: Path = PACKAGE) -> str | None:
    """The LAYERS entry a file belongs to: its own, else its closest package's."""
    rel = path.relative_to(root)
    candidates = [rel.as_posix(), *(Path(*rel.parts[:n]).as_posix() for n in range(len(rel.parts) - 1, 0, -1))]
    return next((c for c in candidates if c in _LAYER), None)


def _package(path: Path, root: Path) -> list[str]:
    return ["moba_hf", *path.relative_to(root).parent.parts]


def _strings(tree: ast.AST) -> Iterator[ast.Constant]:
    """String constants, but not the pieces of an f-string (random seeds like f"moba_hf.x:{seed}")."""
    pieces = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in pieces:
            yield node


def _nodes(tree: ast.Module, *, eager_only: bool) -> Iterator[ast.AST]:
    """The nodes that can run, leaving out `if TYPE_CHECKING:` blocks; `eager_only`: those that run at import time
    (not in a function body)."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if eager_only and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo += node.orelse
            continue
        yield node
        todo += list(ast.iter_child_nodes(node))


def imported_modules(path: Path, root: Path = PACKAGE, *, eager_only: bool = False) -> set[str]:
    """Absolute names of every module `path` imports: import statements (relative ones resolved against its
    package; `from pkg import name` counts pkg.name when that is a module, pkg otherwise) and string module paths.
    Third-party names are kept as written. `eager_only`: the imports that run when the module is imported."""
    known = modules(root)
    package = _package(path, root)
    tree = ast.parse(path.read_text(), str(path))
    nodes = list(_nodes(tree, eager_only=eager_only))
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            subs = {f"{module}.{alias.name}" for alias in node.names} & set(known)
            names |= subs or {module}
            if len(subs) < len(node.names):  # some names are attributes of the package itself
                names.add(module)
        elif isinstance(node, ast.Call) and not eager_only:
            func = ast.unparse(node.func)
            first = node.args[0] if node.args else None
            if func.endswith("import_module") and isinstance(first, ast.Constant) and str(first.value)[:1] == ".":
                level = len(first.value) - len(first.value.lstrip("."))
                rest = first.value[level:]
                names.add(".".join([*package[: len(package) - level + 1], *([rest] if rest else [])]))
    if not eager_only:
        names |= {node.value.split(":")[0] for node in _strings(tree) if _MODULE_PATH.fullmatch(node.value)}
    return names


def owner(name: str, known: dict[str, Path]) -> str | None:
    """The module of the package that `name` (a module, or an attribute path under one) lives in."""
    parts = name.split(".")
    return next((".".join(parts[:n]) for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in known), None)


def upward_imports(root: Path = PACKAGE) -> list[str]:
    known = modules(root)
    offences = []
    for path in known.values():
        mine = entry(path, root)
        for name in sorted(imported_modules(path, root)):
            target = owner(name, known) if name.split(".")[0] == "moba_hf" else None
            if target is None:
                continue
            theirs = entry(known[target], root)
            if mine is None or theirs is None or theirs == mine or _LAYER[theirs] < _LAYER[mine]:
                continue
            offences.append(f"{path.relative_to(root.parent)} ({mine}, row {_LAYER[mine]}) imports {name} "
                            f"({theirs}, row {_LAYER[theirs]})")  # fmt: skip
    return offences


def eager_package_imports(root: Path = PACKAGE) -> list[str]:
    """A package's __init__ runs before any of its modules: its import-time imports must be allowed to each."""
    known = modules(root)
    offences = []
    for init in (p for p in known.values() if p.name == "__init__.py"):
        subtree = [p for p in known.values() if p.is_relative_to(init.parent)]
        for name in sorted(imported_modules(init, root, eager_only=True)):
            target = owner(name, known) if name.split(".")[0] == "moba_hf" else None
            if target is None:
                continue
            theirs = entry(known[target], root)
            for module in subtree:
                mine = entry(module, root)
                if theirs != mine and _LAYER[theirs] >= _LAYER[mine]:
                    offences.append(f"{init.relative_to(root.parent)} imports {name} ({theirs}) when "
                                    f"{module.relative_to(root.parent)} ({mine}) is imported")  # fmt: skip
    return offences


def import_cycles(root: Path = PACKAGE) -> list[list[str]]:
    """Cycles among the modules (lazy imports count), leaving out each module's own packages (imported anyway)."""
    known = modules(root)
    graph = {}
    for name, path in known.items():
        targets = {owner(n, known) for n in imported_modules(path, root) if n.split(".")[0] == "moba_hf"}
        graph[name] = sorted(t for t in targets if t and t != name and not name.startswith(t + "."))
    cycles, done = [], set()

    def visit(node: str, stack: list[str]) -> None:
        for nxt in graph[node]:
            if nxt in stack:
                cycles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in done:
                visit(nxt, [*stack, nxt])
        done.add(node)

    for start in sorted(graph):
        if start not in done:
            visit(start, [start])
    return cycles


def private_imports(root: Path = PACKAGE) -> list[str]:
    """`from other_module import _name`: a private name used outside its module."""
    offences = []
    for path in modules(root).values():
        package = _package(path, root)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("moba_hf")):
                base = package[: len(package) - node.level + 1] if node.level else []
                module = ".".join([*base, *([node.module] if node.module else [])])
                offences += [f"{path.relative_to(root.parent)}:{node.lineno} imports {module}.{alias.name}"
                             for alias in node.names
                             if alias.name.startswith("_") and not alias.name.startswith("__")]  # fmt: skip
    return offences


def test_every_module_has_a_row():
    unplaced = [str(p.relative_to(PACKAGE.parent)) for p in modules().values() if entry(p) is None]
    assert not unplaced, f"add these to LAYERS (and to docs/architecture.md): {unplaced}"
    paths = {p.relative_to(PACKAGE).as_posix() for p in modules().values()}
    missing = [e for e in _LAYER if not any(p == e or p.startswith(e + "/") for p in paths)]
    assert not missing, f"LAYERS names what the package does not have: {missing}"


def test_imports_point_down():
    offences = upward_imports()
    assert not offences, "\n".join(offences)


def test_package_inits_import_only_what_each_of_their_modules_may():
    offences = eager_package_imports()
    assert not offences, "\n".join(offences)


def test_no_import_cycles():
    cycles = import_cycles()
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_private_names_stay_in_their_module():
    offences = private_imports()
    assert not offences, "\n".join(offences)


def test_module_paths_written_as_strings_exist():
    known = modules()
    wrong = [
        f"{path.relative_to(PACKAGE.parent)}: {name}"
        for path in known.values()
        for name in sorted(imported_modules(path))
        if name.split(".")[0] == "moba_hf" and owner(name, known) in (None, "moba_hf") and name != "moba_hf"
    ]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("layer", sorted(THIRD_PARTY))
def test_third_party_imports(layer):
    offences = [
        f"{path.relative_to(PACKAGE.parent)} imports {name}"
        for path in modules().values()
        if entry(path) == layer
        for name in sorted(imported_modules(path))
        if name.split(".")[0] in THIRD_PARTY[layer]
    ]
    assert not offences, "\n".join(offences)


def test_architecture_doc_shows_the_same_rows():
    """docs/architecture.md's table lists the rows top first: `| row | modules | ... |`, modules in backticks."""
    rows = {}
    for line in ARCHITECTURE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].isdigit():
            rows[int(cells[0])] = tuple(re.findall(r"`moba_hf/([^`]+?)/?`", cells[1]))
    assert {n: set(r) for n, r in rows.items()} == {n: set(r) for n, r in enumerate(LAYERS)}, rows


def test_import_reader_sees_relative_lazy_and_string_imports(tmp_path):
    root = tmp_path / "moba_hf"
    (root / "eval").mkdir(parents=True)
    for name in ("__init__.py", "cli.py", "eval/__init__.py", "eval/runner.py", "train.py"):
        (root / name).write_text("")
    (root / "eval" / "mod.py").write_text(
        "import importlib\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    import torch\n"
        "from . import runner\n"
        "from .. import cli as _cli, __version__\n"
        "_LAZY = {'x': 'moba_hf.train'}\n"
        "def f():\n"
        "    importlib.import_module('moba_hf.cli')\n"
        "    __import__('moba_hf.eval.runner')\n"
        "    importlib.import_module('.runner', __package__)\n"
        "    seed = f'moba_hf.cli:{3}'\n"
    )
    names = imported_modules(root / "eval" / "mod.py", root)
    assert names == {"importlib", "typing", "moba_hf.eval.runner", "moba_hf.cli", "moba_hf", "moba_hf.train"}
    eager = imported_modules(root / "eval" / "mod.py", root, eager_only=True)
    assert eager == {"importlib", "typing", "moba_hf.eval.runner", "moba_hf.cli", "moba_hf"}


def test_checks_catch_what_they_look_for(tmp_path):
    root = tmp_path / "moba_hf"
    (root / "kernels").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "kernels" / "__init__.py").write_text("from . import gate\n_LAZY = {'m': 'moba_hf.models'}\n")
    (root / "kernels" / "gate.py").write_text(
        "def f():\n    from moba_hf.kernels import _hidden\n    from moba_hf import options\n"
    )
    (root / "options.py").write_text("from moba_hf.kernels import gate\n")
    (root / "models.py").write_text("from .options import x\n")
    assert upward_imports(root) == [
        "moba_hf/kernels/__init__.py (kernels, row 1) imports moba_hf.models (models.py, row 7)",
        "moba_hf/options.py (options.py, row 0) imports moba_hf.kernels.gate (kernels, row 1)",
    ]
    assert import_cycles(root) == [["moba_hf.kernels.gate", "moba_hf.options", "moba_hf.kernels.gate"]]
    assert private_imports(root) == ["moba_hf/kernels/gate.py:2 imports moba_hf.kernels._hidden"]
    (root / "kernels" / "__init__.py").write_text("from moba_hf import options\n")
    assert eager_package_imports(root) == []
    (root / "__init__.py").write_text("from . import models\n")
    offence = "moba_hf/__init__.py imports moba_hf.models (models.py) when moba_hf/options.py (options.py) is imported"
    assert offence in eager_package_imports(root)
