"""Meta-test: every hookspec has a test that calls it and appears in the docs."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from tokenloom.protocols import hookspecs

REPO = Path(__file__).resolve().parents[1]
HOOKS = sorted(
    name
    for name, obj in vars(hookspecs).items()
    if name.startswith("tokenloom_") and inspect.isfunction(obj)
)
DOCS = [
    REPO / "protocols" / "README.md",
    REPO / "README.md",
    *sorted((REPO / "docs").rglob("*.md")),
]


def test_hookspecs_are_found() -> None:
    assert "tokenloom_register_components" in HOOKS and len(HOOKS) >= 6


def files_calling(hook: str) -> list[Path]:
    """Test files (other than this one) that call the hook or implement it in a
    plugin the test registers: ``hook.NAME(`` or ``def NAME(``."""
    call = re.compile(rf"(\.{hook}\(|def {hook}\()")
    found = []
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        if path.name != Path(__file__).name and call.search(path.read_text()):
            found.append(path)
    return found


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_has_a_test(hook: str) -> None:
    assert files_calling(hook), f"no test calls or implements {hook}"


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_appears_in_the_docs(hook: str) -> None:
    text = "\n".join(p.read_text() for p in DOCS if p.exists())
    assert f"`{hook}`" in text, f"{hook} is not documented in {[str(p) for p in DOCS]}"


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hookspec_has_a_docstring_that_says_who_calls_it(hook: str) -> None:
    doc = inspect.getdoc(getattr(hookspecs, hook)) or ""
    assert "Called" in doc, f"{hook}'s docstring does not say who calls it and when"
