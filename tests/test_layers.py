"""The layout's rules as a test: every library file belongs to exactly one part of the compiler,
no import (at module level or inside a function) goes in a forbidden direction, and no file or
function outgrows the project's limits.

The parts, from the bottom (README, "How the layout maps to the compiler"):

    base         autopar/errors.py: the errors every part raises
    plan data    autopar/plans/: the plan language, torch-free
    capture      autopar/tracer.py, autopar/graph.py, autopar/models/: model -> Graph
    cost         cost/ (autopar.cost): devices, prices, the estimator
    solver       autopar/solver/, and autopar/timeline.py (the simulation of torch's schedules
                 the planner records a plan's bubble with, which `explain` draws)
    passes       passes/ (autopar.passes): rewrites of a stage's program
    runtime      autopar/runtime/: process groups, schedules, FSDP2, optimizer, checkpoints
    face         autopar/__init__.py, api.py, cli.py, commands/: what users call
    measurement  autopar/calibrate/, autopar/testing/, autopar/simulate/: probes and harnesses
                 that start ranks (simulate: on fake tensors, one rank at a time)

Capture and cost read each other (the tracer counts FLOPs with the cost model's rules; the cost
model prices a Graph); every other direction is in FORBIDDEN or free.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LIBRARY = ("autopar", "cost", "passes")
# installed name -> folder of the checkout (pyproject.toml's package-dir)
ROOTS = {"autopar.passes": "passes", "autopar.cost": "cost", "autopar": "autopar"}
PARTS = {
    "base": ("autopar/errors.py",),
    "plan data": ("autopar/plans/",),
    "capture": ("autopar/tracer.py", "autopar/graph.py", "autopar/mixed_dtypes.py", "autopar/models/"),
    "cost": ("cost/",),
    "solver": ("autopar/solver/", "autopar/timeline.py"),
    "passes": ("passes/",),
    "runtime": ("autopar/runtime/",),
    "face": ("autopar/__init__.py", "autopar/api.py", "autopar/cli.py", "autopar/commands/"),
    "measurement": ("autopar/calibrate/", "autopar/testing/", "autopar/simulate/"),
}
ABOVE_PLANS = ("capture", "cost", "solver", "passes", "runtime", "face", "measurement")
FORBIDDEN = {
    "base": ABOVE_PLANS + ("plan data",),
    "plan data": ABOVE_PLANS,
    "capture": ("solver", "passes", "runtime", "face", "measurement"),
    "cost": ("solver", "passes", "runtime", "face", "measurement"),
    "solver": ("passes", "runtime", "face", "measurement"),
    "passes": ("solver", "runtime", "face", "measurement"),
    "runtime": ("solver", "face", "measurement"),
}
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 60


def library_files(root: Path) -> list[str]:
    return sorted(str(path.relative_to(root)) for folder in LIBRARY if (root / folder).is_dir()
                  for path in (root / folder).rglob("*.py"))


def part_of(path: str) -> list[str]:
    """Every part whose entries name `path` (a file, or a folder it is in)."""
    return [part for part, entries in PARTS.items()
            if any(path == entry or entry.endswith("/") and path.startswith(entry) for entry in entries)]


def module_file(root: Path, module: str) -> str | None:
    """The library file that defines `module` ("autopar.cost.mesh" -> "cost/mesh.py")."""
    for name, folder in ROOTS.items():
        if module == name or module.startswith(name + "."):
            rest = module[len(name):].lstrip(".").replace(".", "/")
            base = f"{folder}/{rest}" if rest else folder
            for candidate in (f"{base}.py", f"{base}/__init__.py"):
                if (root / candidate).is_file():
                    return candidate
            return None
    return None


def imported(root: Path, path: str) -> list[tuple[int, str]]:
    """(line, library file) of every import in `path`, wherever it is (module level, inside a
    function, under TYPE_CHECKING); `from package import name` counts the submodule `name`
    when there is one, else the package."""
    tree = ast.parse((root / path).read_text(), filename=path)
    package = path.rsplit("/", 1)[0].replace("/", ".")
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:      # relative: from the file's own package, in the checkout's names
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
                base = _installed(base)
            modules = [f"{base}.{alias.name}" if module_file(root, f"{base}.{alias.name}") else base
                       for alias in node.names]
        else:
            continue
        found += [(node.lineno, target) for target in map(lambda m: module_file(root, m), modules)
                  if target is not None]
    return found


def _installed(checkout_module: str) -> str:
    """A module named by its checkout folder ("cost.mesh") by its installed name."""
    for name, folder in ROOTS.items():
        if checkout_module == folder or checkout_module.startswith(folder + "."):
            return name + checkout_module[len(folder):]
    return checkout_module


def problems(root: Path) -> list[str]:
    """Everything in the tree at `root` that breaks the layout's rules, one line each."""
    found = []
    for path in library_files(root):
        parts = part_of(path)
        if len(parts) != 1:
            found.append(f"{path} belongs to {parts or 'no part'}; map it to exactly one in "
                         f"tests/test_layers.py PARTS")
            continue
        for line, target in imported(root, path):
            target_parts = part_of(target)
            if target_parts and target_parts[0] in FORBIDDEN.get(parts[0], ()):
                found.append(f"{path}:{line} ({parts[0]}) imports {target} ({target_parts[0]})")
        found += _sizes(root, path)
    return found


def _sizes(root: Path, path: str) -> list[str]:
    text = (root / path).read_text()
    found = []
    lines = len(text.splitlines())
    if lines > MAX_FILE_LINES:
        found.append(f"{path} has {lines} lines (at most {MAX_FILE_LINES})")
    for node in ast.walk(ast.parse(text, filename=path)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(f"{path}:{node.lineno} function {node.name} has {length} lines "
                             f"(at most {MAX_FUNCTION_LINES})")
    return found


def test_the_library_keeps_the_layer_rules():
    assert problems(REPO) == []


def _tree(root: Path, files: dict[str, str]) -> Path:
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    return root


CLEAN = {"autopar/__init__.py": "", "autopar/errors.py": "",
         "autopar/plans/__init__.py": "from autopar.errors import AutoparError\n",
         "autopar/solver/__init__.py": "", "autopar/solver/search.py": "import autopar.plans\n",
         "autopar/runtime/__init__.py": "", "autopar/runtime/steps.py": "from autopar.plans import x\n",
         "cost/__init__.py": "", "cost/price.py": "from autopar.plans import records\n",
         "passes/__init__.py": "", "passes/split.py": "from autopar.cost import price\n"}


@pytest.mark.parametrize("name,files,expected", [
    ("plan data importing the solver", {"autopar/plans/records.py": "import autopar.solver.search\n"},
     "autopar/plans/records.py:1 (plan data) imports autopar/solver/search.py (solver)"),
    ("cost importing the solver in a function",
     {"cost/price.py": "def f():\n    from autopar.solver import search\n"},
     "cost/price.py:2 (cost) imports autopar/solver/search.py (solver)"),
    ("solver importing the runtime relatively", {"autopar/solver/search.py": "from ..runtime import steps\n"},
     "autopar/solver/search.py:1 (solver) imports autopar/runtime/steps.py (runtime)"),
    ("solver importing the runtime", {"autopar/solver/search.py": "from autopar.runtime.steps import run\n"},
     "autopar/solver/search.py:1 (solver) imports autopar/runtime/steps.py (runtime)"),
    ("passes importing the runtime", {"passes/split.py": "import autopar.runtime.steps as steps\n"},
     "passes/split.py:1 (passes) imports autopar/runtime/steps.py (runtime)"),
    ("capture importing the solver", {"autopar/graph.py": "from autopar.solver import search\n"},
     "autopar/graph.py:1 (capture) imports autopar/solver/search.py (solver)"),
    ("a file in no part", {"autopar/utils.py": ""}, "autopar/utils.py belongs to no part"),
    ("a long file", {"passes/long.py": "x = 1\n" * 501}, "passes/long.py has 501 lines"),
    ("a long function", {"passes/long.py": "def f():\n" + "    x = 1\n" * 60},
     "passes/long.py:1 function f has 61 lines"),
])
def test_the_checker_finds_each_kind_of_breach(tmp_path, name, files, expected):
    """The same checker on a small fake tree: clean as built, and each breach found when added."""
    root = _tree(tmp_path, CLEAN)
    assert problems(root) == []
    _tree(root, files)
    found = problems(root)
    assert len(found) == 1 and found[0].startswith(expected), (name, found)


def test_every_library_package_is_installed():
    """`pip install .` copies only the packages pyproject.toml lists: a folder of the library
    missing from that list is missing from every non-editable install (and its command fails)."""
    import tomllib

    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {name: folder for name, folder in setuptools["package-dir"].items()}
    installed = set()
    for name in setuptools["packages"]:
        root = max((n for n in (*folders, "autopar") if name == n or name.startswith(n + ".")), key=len)
        rest = name[len(root):].lstrip(".").replace(".", "/")
        installed.add(f"{folders.get(root, root)}/{rest}".rstrip("/"))
    packages = {str(path.parent.relative_to(REPO)) for folder in LIBRARY
                for path in (REPO / folder).rglob("__init__.py")}
    assert packages - installed == set(), "list these in pyproject.toml's [tool.setuptools] packages"
