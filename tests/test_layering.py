"""The package's import structure: no import cycle (imports inside functions included), and every module
can be imported first (a module-level cycle between two modules breaks one of those orders)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "zoa_train"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = sorted(module_name(p) for p in PACKAGE.rglob("*.py"))


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The package modules that `path` imports anywhere, inside functions too (an import made late to
    dodge a cycle is still the cycle), each `from a import b` counted as a.b where that is a module."""
    found = set()

    def visit(nodes):
        for node in nodes:
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
                found.update(f"{node.module}.{alias.name}" for alias in node.names)
            visit(ast.iter_child_nodes(node))

    visit(ast.parse(path.read_text()).body)
    # Importing a.b.c first imports a and a.b, except the packages this module is in: they are being
    # imported already when it is (a package's face importing its submodules is no cycle).
    me = module_name(path)
    return {prefix for name in found for prefix in _prefixes(name) if prefix in modules and not (me + ".").startswith(prefix + ".")}


def _prefixes(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def test_no_import_cycle():
    modules = set(MODULES)
    graph = {module_name(p): imports_of(p, modules) for p in PACKAGE.rglob("*.py")}
    state: dict[str, str] = {}
    path: list[str] = []

    def walk(node: str) -> None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                pytest.fail("import cycle: " + " -> ".join(path[path.index(nxt) :] + [nxt]))
            elif nxt not in state:
                walk(nxt)
        path.pop()
        state[node] = "done"

    for module in MODULES:
        if module not in state:
            walk(module)


FIRST_IMPORTS = """
import importlib, sys, traceback
failed = []
for module in sys.argv[1:]:
    for name in [n for n in sys.modules if n == "zoa_train" or n.startswith("zoa_train.")]:
        del sys.modules[name]  # what the package itself defines starts afresh; torch & co stay loaded
    try:
        importlib.import_module(module)
    except Exception:
        failed.append(module + ": " + traceback.format_exc().strip().splitlines()[-1])
print("\\n".join(failed))
"""


def test_the_core_does_not_import_the_integrations():
    """zoa_train.integrations holds the optional frameworks' glue: the core package never imports it."""
    modules = set(MODULES)
    core = [p for p in PACKAGE.rglob("*.py") if not module_name(p).startswith("zoa_train.integrations")]
    offenders = {module_name(p): sorted(m for m in imports_of(p, modules) if m.startswith("zoa_train.integrations")) for p in core}
    assert not {k: v for k, v in offenders.items() if v}, offenders


def test_every_module_imports_first():
    """Each module imported first of the package's, in one interpreter that forgets the package in
    between (a fresh interpreter per module would cost a torch import each)."""
    done = subprocess.run([sys.executable, "-c", FIRST_IMPORTS, *MODULES], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not done.stdout.strip(), done.stdout
