"""drain/ is in layers, and imports only run downwards.

Every module of the package belongs to one layer (a new module must be given
one here); an import, at module level or inside a function, may only reach a
layer its own is allowed to use. The allowed directions form no cycle, and the
module graph itself has none either (a function-level import hides a cycle
from Python, not from this test).
"""

from __future__ import annotations

import ast
import graphlib
from collections.abc import Iterator
from pathlib import Path

import pytest

import drain

ROOT = Path(drain.__file__).resolve().parent

#: Top-level modules by layer; a subpackage is its own layer (see LAYER_OF).
FOUNDATION = {"drain.errors", "drain.limits", "drain.version", "drain.trace_context",
              "drain.redaction"}
#: What applications import: the staging API, the consumer helpers, the package.
APP = {"drain", "drain.staging", "drain.staging_values", "drain.signatures",
       "drain.celery_task", "drain.consumer", "drain.consumer_sql", "drain.store"}
TESTING = {"drain.pytest_plugin"}
#: Run as programs, never imported: they may start any layer.
ENTRY = {"drain.__main__", "drain.spark.__main__"}

#: Which layers each layer may import (its own included).
ALLOWED: dict[str, set[str]] = {
    "foundation": {"foundation"},
    "settings": {"foundation", "settings"},
    "postgres": {"foundation", "settings", "postgres"},
    "broker": {"foundation", "settings", "broker"},
    "celery": {"foundation", "settings", "postgres", "broker", "celery"},
    "daemon": {"foundation", "settings", "postgres", "broker", "celery", "daemon"},
    # drain.store re-exports drain.postgres.migration.migrate for applications.
    "app": {"foundation", "app", "postgres"},
    "spark": {"foundation", "settings", "postgres", "app", "spark"},
    "testing": {"foundation", "settings", "postgres", "celery", "daemon", "app", "testing"},
    "cli": {"foundation", "settings", "postgres", "broker", "celery", "daemon", "app",
            "spark", "cli"},
}


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def layer_of(module: str) -> str:
    if module in FOUNDATION:
        return "foundation"
    if module in APP:
        return "app"
    if module in TESTING or module.startswith("drain.testing"):
        return "testing"
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] in ALLOWED:
        return parts[1]
    raise AssertionError(f"{module} belongs to no layer: add it to tests/unit/test_layers.py")


def imports(module: str, path: Path, known: dict[str, Path]) -> Iterator[tuple[int, str]]:
    """The drain modules ``module`` imports, anywhere in it, with the line."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text("utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "drain":
                    yield node.lineno, _deepest(alias.name, known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            if base.split(".")[0] != "drain":
                continue
            for alias in node.names:
                # `from drain.celery import message` imports a module, not a name.
                target = f"{base}.{alias.name}"
                yield node.lineno, target if target in known else _deepest(base, known)


def _deepest(name: str, known: dict[str, Path]) -> str:
    while name not in known:
        name = name.rpartition(".")[0]
    return name


def test_every_module_has_a_layer() -> None:
    for module in modules():
        if module not in ENTRY:
            layer_of(module)


def test_layers_allow_no_cycle() -> None:
    graph = {layer: allowed - {layer} for layer, allowed in ALLOWED.items()}
    tuple(graphlib.TopologicalSorter(graph).static_order())  # raises CycleError


def test_imports_only_run_downwards() -> None:
    known = modules()
    wrong = []
    for module, path in known.items():
        if module in ENTRY:
            continue
        mine = layer_of(module)
        for line, target in imports(module, path, known):
            if layer_of(target) not in ALLOWED[mine]:
                wrong.append(f"{path.relative_to(ROOT.parent)}:{line}: {module} ({mine}) "
                             f"imports {target} ({layer_of(target)})")
    assert not wrong, "imports that run upwards:\n" + "\n".join(wrong)


def test_no_module_import_cycle() -> None:
    known = modules()
    graph = {module: {t for _, t in imports(module, path, known)
                      # a package's __init__ runs before its modules: not a cycle
                      if not module.startswith(t + ".") and t != module}
             for module, path in known.items()}
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as exc:
        pytest.fail(f"import cycle: {' -> '.join(exc.args[1])}")


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    """The check itself can fail: a postgres module importing the daemon is caught."""
    path = tmp_path / "store.py"
    path.write_text("def f():\n    from drain.daemon import runner\n")
    known = modules()
    found = list(imports("drain.postgres.store", path, known))
    assert found == [(2, "drain.daemon.runner")]
    assert layer_of("drain.daemon.runner") not in ALLOWED["postgres"]
