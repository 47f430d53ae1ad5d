"""The package's layers import one way: foundations (config, files, rundir, runtime) ← engines ← rl ←
distributed ← commands ← cli, with no cycles."""

import ast
from pathlib import Path

import parity

ROOT = Path(parity.__file__).parent
LAYERS = {"engines": 1, "rl": 2, "distributed": 3, "commands": 4, "builtin": 4}  # builtin: `parity build-model`
# api: the Python front door, on the commands and runs the CLI uses; the package root re-exports it (lazily)
TOP = {"cli": 5, "__main__": 5, "api": 5}  # every other top-level module is a foundation (0)
ROOT_LAYER = 6  # `parity` itself (__init__.py): above everything it re-exports
# Modules split out of one along its seams, lowest first: each imports only those before it in its row.
SPLITS = [
    ("parity.engines.models.config", "parity.engines.models.modules", "parity.engines.models.io"),
    # rl/tasks.py: data files and the built-in rewards both build on the problems, and not on each other
    ("parity.rl.problems", "parity.rl.data"),
    ("parity.rl.problems", "parity.rl.builtin_rewards"),
]


def _layer(module: str) -> int:
    parts = module.split(".")[1:]
    if not parts:
        return ROOT_LAYER
    return LAYERS.get(parts[0], TOP.get(parts[0], 0))


def _from_import(module: str, name: str) -> str:
    """What `from module import name` imports: the submodule `module.name` where there is one, else `module`."""
    sub = ROOT.parent.joinpath(*module.split("."), name)
    if module == "parity" or sub.with_suffix(".py").is_file() or (sub / "__init__.py").is_file():
        return f"{module}.{name}"
    return module


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):  # lazy imports inside functions count too
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("parity"):
            # `from parity import config` imports the module parity.config, not the package's API (and
            # `from parity.engines.kernels import cpu` the module parity.engines.kernels.cpu)
            found.update(_from_import(node.module, a.name) for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("parity"))
    return found


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    return ".".join(p for p in rel.parts if p != "__init__")


def test_imports_point_down_the_layers():
    upward = []
    for path in ROOT.rglob("*.py"):
        name = _module_name(path)
        for target in _imports(path):
            if _layer(target) > _layer(name):
                upward.append(f"{name} imports {target}")
    assert not upward, "imports against the layering: " + "; ".join(sorted(upward))


def test_split_modules_import_down_their_row():
    backward = []
    for row in SPLITS:
        for i, name in enumerate(row):
            path = ROOT.parent.joinpath(*name.split(".")).with_suffix(".py")
            assert path.is_file(), f"{name}: no such module (update SPLITS)"
            backward += [f"{name} imports {t}" for t in _imports(path) if t in row[i + 1 :]]
    assert not backward, "imports against a split's order: " + "; ".join(sorted(backward))


def test_no_import_cycles():
    graph = {_module_name(p): {t for t in _imports(p)} for p in ROOT.rglob("*.py")}
    modules = set(graph)
    graph = {m: {t for t in ts if t in modules and t != m} for m, ts in graph.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycles.append(" -> ".join(stack[stack.index(t) :] + [m, t]) if t in stack else f"{m} -> {t}")
            elif t not in state:
                visit(t, stack + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert not cycles, "import cycles: " + "; ".join(cycles)


def _timed(node: ast.AST, elapsed: set[str]) -> bool:
    """Whether `node` holds a clock reading's difference (`time.monotonic() - start`) or a name bound to one."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and sub.id in elapsed:
            return True
        if isinstance(sub, ast.BinOp) and isinstance(sub.op, ast.Sub):
            for side in (sub.left, sub.right):
                call = side.func if isinstance(side, ast.Call) else None
                if isinstance(call, ast.Attribute) and call.attr in {"time", "monotonic", "perf_counter"}:
                    return True
    return False


def test_no_test_asserts_a_wall_clock_time():
    """Speed is measured in benchmarks/, never asserted in a test: a loaded CI machine fails such an assert.
    A deadline that fails a test which waited for something that never came is a hang guard, and allowed."""
    found = []
    for path in sorted((Path(__file__).parents[1]).rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        elapsed = {
            target.id
            for node in ast.walk(tree)
            if isinstance(node, ast.Assign) and _timed(node.value, set())
            for target in node.targets
            if isinstance(target, ast.Name)
        }
        found += [
            f"{path.name}:{node.lineno}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Assert) and _timed(node.test, elapsed)
        ]
    assert not found, "tests assert an elapsed time: " + ", ".join(found)


# Imported only where they are needed, each refused in one line when missing (or, for triton, only on CUDA,
# whose PyTorch builds bring it): the extras, not dependencies.
OPTIONAL_IMPORTS = {"triton", "wandb", "trackio", "mlflow", "huggingface_hub"}


def _distribution(name: str) -> str:
    return name.lower().replace("_", "-")


def test_every_package_the_source_imports_is_a_dependency():
    """`pip install -e .` alone runs every command: each third-party module the source imports is one of the
    project's dependencies, or an optional import (OPTIONAL_IMPORTS). psutil came through Ray until Ray 2.60
    stopped bringing it, and `parity sanity`, the README's first command, failed on a fresh machine."""
    import importlib.metadata
    import re
    import sys
    import tomllib

    pyproject = tomllib.loads((ROOT.parent.parent / "pyproject.toml").read_text())
    declared = {_distribution(re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0]) for d in pyproject["project"]["dependencies"]}
    providers = importlib.metadata.packages_distributions()
    undeclared = []
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for top in {n.split(".")[0] for n in names}:
                if top in sys.stdlib_module_names or top == "parity" or top in OPTIONAL_IMPORTS:
                    continue
                if not {_distribution(d) for d in providers.get(top, [top])} & declared:
                    undeclared.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} imports {top}")
    assert not undeclared, "not in pyproject.toml's dependencies: " + "; ".join(sorted(undeclared))
