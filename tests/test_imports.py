"""The house's shape, from the code's own imports: no module imports one that imports it
back (but the one circle `vllm_ext`'s docstring explains), the vLLM loader stays out of the
receiver, the replica side never reaches the trainer package, and each package's docstring
lists every module it holds.

Imports are read from the source (every `import` statement, those inside functions and
under `TYPE_CHECKING` too), so nothing is imported and vLLM need not be installed.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("delta_sync", "vllm_ext")
#: The one import circle kept, with its reason in vllm_ext/__init__.py.
KEPT_CIRCLES = {frozenset({"vllm_ext.engine", "vllm_ext.worker"})}


def _modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


MODULES = _modules()


def _imports(module: str) -> set[str]:
    """The package modules `module` imports, anywhere in its source."""
    path = MODULES[module]
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in MODULES)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join([*base, *([node.module] if node.module else [])])
            for alias in node.names:
                if f"{target}.{alias.name}" in MODULES:
                    found.add(f"{target}.{alias.name}")
                elif target in MODULES:
                    found.add(target)
    found.discard(module)
    return found


IMPORTS = {module: _imports(module) for module in MODULES}


def _is_package(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def test_no_module_imports_one_that_imports_it_back():
    circles = {
        frozenset({a, b})
        for a, targets in IMPORTS.items()
        for b in targets
        if a in IMPORTS[b] and not (_is_package(a) or _is_package(b))
    }
    assert circles - KEPT_CIRCLES == set()
    assert circles >= KEPT_CIRCLES, "a kept circle is gone: drop it from KEPT_CIRCLES and vllm_ext's docstring"


def test_the_vllm_loader_uses_the_replica_s_loaders_not_the_receiver():
    assert "delta_sync.replica.loaders" in IMPORTS["vllm_ext.loader"]
    assert "delta_sync.replica.receiver" not in IMPORTS["vllm_ext.loader"]


def _reached(module: str) -> set[str]:
    """Every package module that importing `module` can import, its parent packages included."""
    reached, pending = set(), [module]
    while pending:
        current = pending.pop()
        if current in reached:
            continue
        reached.add(current)
        parts = current.split(".")
        pending.extend(parent for i in range(1, len(parts)) if (parent := ".".join(parts[:i])) in MODULES)
        pending.extend(IMPORTS[current])
    return reached


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith(("delta_sync.replica", "vllm_ext"))))
def test_the_replica_side_never_reaches_the_trainer_package(module):
    # A replica runs in a vLLM server's environment: what both sides use lives below both.
    trainer = sorted(m for m in _reached(module) if m == "delta_sync.trainer" or m.startswith("delta_sync.trainer."))
    assert trainer == [], f"{module} imports {trainer}"


@pytest.mark.parametrize("package", ["delta_sync.replica", "delta_sync.trainer", "vllm_ext"])
def test_a_package_docstring_lists_every_module(package):
    docstring = ast.get_docstring(ast.parse(MODULES[package].read_text())) or ""
    listed = set(re.findall(r"^\| `(\w+)` \|", docstring, flags=re.MULTILINE))
    modules = {
        name.rsplit(".", 1)[1]
        for name in MODULES
        if name.startswith(package + ".") and name.count(".") == package.count(".") + 1
    }
    assert modules - listed == set(), f"{package}'s docstring does not list these modules"
    assert listed - modules == set(), f"{package}'s docstring lists modules it does not hold"
