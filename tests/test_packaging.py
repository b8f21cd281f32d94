"""Packaging: the wheel maps the folders to the one package ``tokenloom``."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FOLDERS = {"core": "tokenloom", "protocols": "tokenloom/protocols", "plugins": "tokenloom/plugins", "contrib": "tokenloom/contrib"}  # fmt: skip


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Build from a copy, so the build leaves nothing in the working tree.
    src = tmp_path_factory.mktemp("src")
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for folder in FOLDERS:
        shutil.copytree(REPO / folder, src / folder, ignore=ignore)
    for name in ("pyproject.toml", "setup.py", "README.md"):
        if (REPO / name).exists():
            shutil.copy(REPO / name, src / name)
    if not (src / "README.md").exists():
        (src / "README.md").write_text("tokenloom\n")
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-index",
         "--no-build-isolation", "--wheel-dir", str(out), str(src)],
        check=True,
    )  # fmt: skip
    (built,) = out.glob("tokenloom-*.whl")
    return built


@pytest.fixture(scope="module")
def wheel_names(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as zf:
        return set(zf.namelist())


def source_modules() -> list[tuple[str, str]]:
    pairs = []
    for folder, package_path in FOLDERS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            rel = path.relative_to(REPO / folder).as_posix()
            pairs.append((f"{folder}/{rel}", f"{package_path}/{rel}"))
    return pairs


def test_wheel_holds_every_module_under_its_package_path(wheel_names: set[str]) -> None:
    missing = [src for src, dest in source_modules() if dest not in wheel_names]
    assert missing == []
    assert "tokenloom/protocols/README.md" in wheel_names


def test_wheel_has_no_bare_top_level_folders(wheel_names: set[str]) -> None:
    tops = {name.split("/")[0] for name in wheel_names}
    assert {"core", "plugins", "protocols", "contrib"}.isdisjoint(tops)
    assert "tokenloom" in tops


def test_nothing_is_importable_as_bare_core_or_plugins(tmp_path: Path) -> None:
    code = (
        "import importlib.util as u\n"
        "names = ['core', 'plugins', 'protocols', 'contrib']\n"
        "print([n for n in names if u.find_spec(n) is not None])\n"
        "import tokenloom.protocols, tokenloom.plugins, tokenloom.contrib\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


def test_the_console_script_points_at_the_cli(wheel: Path, wheel_names: set[str]) -> None:
    (entry_points,) = [n for n in wheel_names if n.endswith(".dist-info/entry_points.txt")]
    with zipfile.ZipFile(wheel) as zf:
        text = zf.read(entry_points).decode()
    assert "tokenloom = tokenloom.entrypoints.cli:main" in text
