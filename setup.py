"""Package-dir mapping: the top-level folders install as the one package ``tokenloom``.

core/ is the package root; protocols/, plugins/ and contrib/ are its subpackages.
Metadata lives in pyproject.toml; this file only maps folders to package names.
"""

from pathlib import Path

from setuptools import setup

ROOTS = {
    "tokenloom": "core",
    "tokenloom.protocols": "protocols",
    "tokenloom.plugins": "plugins",
    "tokenloom.contrib": "contrib",
}


def find_packages() -> tuple[list[str], dict[str, str]]:
    here = Path(__file__).parent
    packages: list[str] = []
    package_dir: dict[str, str] = {}
    for name, folder in ROOTS.items():
        package_dir[name] = folder
        for init in sorted((here / folder).rglob("__init__.py")):
            rel = init.parent.relative_to(here / folder)
            if any(part.startswith((".", "__")) for part in rel.parts):
                continue
            sub = ".".join((name, *rel.parts)) if rel.parts else name
            packages.append(sub)
            package_dir[sub] = str(init.parent.relative_to(here))
    return packages, package_dir


PACKAGES, PACKAGE_DIR = find_packages()

setup(
    packages=PACKAGES,
    package_dir=PACKAGE_DIR,
    package_data={
        "tokenloom.protocols": ["README.md"],
        "tokenloom.eval": ["data/*.json", "data/*.txt", "data/*.md"],
        "tokenloom.sim": ["data/*.json", "data/*.csv", "data/*.md"],
    },
)
