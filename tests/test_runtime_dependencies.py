"""Every third-party module that the package imports at run time is a runtime
dependency in pyproject.toml, so that ``scripts/setup`` (without the test extras)
gives an engine that starts. numpy once came only with the test extras and the first
``tokenloom serve`` on a fresh machine crashed; this keeps that class of bug out.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE_FOLDERS = ("core", "plugins", "protocols", "contrib")

# (file, module) -> why it may import a package outside the runtime dependencies.
# Such an import must sit inside a function, so the module itself imports without it.
OPTIONAL_IMPORTS = {
    ("core/bench/throughput.py", "transformers"): "`bench throughput --peer hf` only",
    ("core/sim/report.py", "matplotlib"): "`tokenloom sim`'s plots only (extra: plot)",
}
# Test support shipped in the package (``tokenloom.testing``: conformance suites a
# third-party plugin's tests subclass). Only test runs import it, so it may use the
# test extras at module level; nothing outside it may import it.
TEST_SUPPORT = ("core/testing/",)
TEST_EXTRAS = {"pytest", "hypothesis"}


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def runtime_distributions() -> set[str]:
    """The normalized names in ``[project].dependencies``."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = (re.match(r"[A-Za-z0-9._-]+", spec) for spec in project["dependencies"])
    return {_normalize(m.group(0)) for m in names if m}


class _ImportCollector(ast.NodeVisitor):
    """Top-level module names imported at run time, with whether each import is lazy
    (inside a function). Skips ``if TYPE_CHECKING:`` blocks and relative imports."""

    def __init__(self) -> None:
        self.found: list[tuple[str, bool, int]] = []  # (module, lazy, line)
        self._depth = 0

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
        if name == "TYPE_CHECKING":
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def _in_function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self._depth += 1
        self.generic_visit(node)
        self._depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = _in_function

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.found.append((alias.name.split(".")[0], self._depth > 0, node.lineno))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level == 0 and node.module:
            self.found.append((node.module.split(".")[0], self._depth > 0, node.lineno))


def third_party_imports() -> list[tuple[str, str, bool, int]]:
    """(file, module, lazy, line) for every import of a module outside the standard
    library and the package itself, under the package folders."""
    skip = set(sys.stdlib_module_names) | {"tokenloom", "__future__"}
    found = []
    for folder in PACKAGE_FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            collector = _ImportCollector()
            collector.visit(ast.parse(path.read_text(), str(path)))
            rel = path.relative_to(REPO).as_posix()
            found += [(rel, m, lazy, line) for m, lazy, line in collector.found if m not in skip]
    return found


def test_the_import_scan_sees_lazy_and_type_checking_imports_apart():
    collector = _ImportCollector()
    source = (
        "import numpy\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import httpx\n"
        "def f():\n    from transformers import AutoModel\nfrom . import sibling\n"
    )
    collector.visit(ast.parse(source))
    assert collector.found == [("numpy", False, 1), ("typing", False, 2), ("transformers", True, 6)]


def test_every_runtime_import_is_a_runtime_dependency():
    runtime = runtime_distributions()
    owners = metadata.packages_distributions()
    problems = []
    for rel, module, lazy, line in third_party_imports():
        where = f"{rel}:{line} imports {module}"
        dists = {_normalize(d) for d in owners.get(module, [])}
        if not dists:
            problems.append(f"{where}, which no installed distribution provides")
        elif not dists & runtime:
            if rel.startswith(TEST_SUPPORT) and module in TEST_EXTRAS:
                continue
            if (rel, module) not in OPTIONAL_IMPORTS:
                problems.append(f"{where} ({', '.join(sorted(dists))}: not a runtime dependency)")
            elif not lazy:
                problems.append(f"{where} at module level; an optional import must be lazy")
    assert problems == []


def test_only_test_support_imports_the_test_support_package():
    pattern = re.compile(r"^\s*(from|import) tokenloom\.testing\b", re.MULTILINE)
    for folder in PACKAGE_FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if not rel.startswith(TEST_SUPPORT):
                assert not pattern.search(path.read_text()), f"{rel} imports tokenloom.testing"


def test_the_optional_imports_are_still_there():
    """The exceptions stay few and true: each one names an import that exists."""
    present = {(rel, module) for rel, module, _, _ in third_party_imports()}
    assert set(OPTIONAL_IMPORTS) <= present


def test_the_test_only_tools_stay_out_of_the_runtime_dependencies():
    assert not runtime_distributions() & {"pytest", "hypothesis", "transformers", "openai"}
