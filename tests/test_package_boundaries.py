"""ARCHITECTURE.md's arrows that keep a frontend, router or planner host free of the engine (and so of
torch), and benchmarks on top: api, fleet, runtime, router and planner import no `tokenmill.engine`; no
product package imports `tokenmill.bench`; the HTTP surface (`api`) sits on the fleet client (`fleet`),
never the other way; `tokenmill.textgen`, the request types they share with the
engine, imports no other tokenmill package. Checked twice: statically over every module (lazy imports
inside functions included) and by importing them all in a fresh interpreter."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import tokenmill

PACKAGE = Path(tokenmill.__file__).parent
FORBIDDEN = {"api": ("engine", "bench"), "fleet": ("engine", "bench", "api"),
             "runtime": ("engine", "bench"), "router": ("engine", "bench"),
             "planner": ("engine", "bench"),
             "tenants": ("engine", "engines", "api", "fleet", "router", "runtime", "worker", "planner", "bench"),
             "textgen": ("engine", "api", "fleet", "router", "runtime", "worker", "kv", "sim", "planner", "bench",
                         "transfer"),
             "workloads": ("engine", "engines", "api", "fleet", "router", "runtime", "worker", "planner", "bench",
                           "transfer")}
# benchmarks sit on top: no product package imports them
FORBIDDEN.update({package: FORBIDDEN.get(package, ()) + ("bench",)
                  for package in ("engine", "engines", "kv", "sim", "transfer", "worker", "datasets")})


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)  # a module, if it is one
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_module_imports_across_a_forbidden_arrow(package: str) -> None:
    crossings = [f"{path.relative_to(PACKAGE)} imports {name}"
                 for path in sorted((PACKAGE / package).rglob("*.py"))
                 for name in sorted(_imported_modules(path))
                 if any(name == f"tokenmill.{other}" or name.startswith(f"tokenmill.{other}.")
                        for other in FORBIDDEN[package])]
    assert not crossings


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_two_modules_of_one_package_import_each_other() -> None:
    """No circle inside a package, however long and whatever the import's kind (at module level, in
    a function, for type checking only): each package reads as layers."""
    modules = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    imports = {name: {m for m in _imported_modules(path) if m in modules and m != name}
               for name, path in modules.items()}
    circles = []
    for name in modules:
        package = name.rpartition(".")[0]
        reached, frontier = set(), [m for m in imports[name] if m.rpartition(".")[0] == package]
        while frontier:
            module = frontier.pop()
            if module not in reached:
                reached.add(module)
                frontier += [m for m in imports[module] if m.rpartition(".")[0] == package]
        if name in reached:
            circles.append(name)
    assert not circles


def test_the_frontend_process_loads_no_torch_and_no_engine() -> None:
    script = (
        "import importlib, pkgutil, sys, tokenmill\n"
        "for package in ('api', 'fleet', 'runtime', 'router', 'textgen', 'planner', 'workloads'):\n"
        "    root = importlib.import_module(f'tokenmill.{package}')\n"
        "    for info in pkgutil.walk_packages(root.__path__, f'tokenmill.{package}.'):\n"
        "        importlib.import_module(info.name)\n"
        "import tokenmill.api.frontend_cli, tokenmill.backend\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('tokenmill.engine')))\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


# the stack-overhead benchmark runs the engine benchmark's workload in process and over HTTP
CROSS_FAMILY = {("serving", "engine")}


def test_a_benchmark_family_imports_only_the_harness_and_itself() -> None:
    """`bench/<family>/` shares through `bench/harness/`, not through another family's module."""
    crossings = []
    for path in sorted((PACKAGE / "bench").glob("*/*.py")):
        family = path.parent.name
        for name in sorted(_imported_modules(path)):
            parts = name.split(".")
            if len(parts) > 2 and parts[:2] == ["tokenmill", "bench"] and parts[2] not in (family, "harness"):
                if (family, parts[2]) not in CROSS_FAMILY:
                    crossings.append(f"{path.relative_to(PACKAGE)} imports {name}")
    assert not crossings
