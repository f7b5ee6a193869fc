"""Every package is a real distribution laid out as DESIGN.md says."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import re

import pytest
from _workspace import PACKAGES, ROOT, module_name, pyproject
from packaging.specifiers import SpecifierSet
from packaging.version import Version


def test_the_packages_folder_holds_exactly_the_designed_packages() -> None:
    found = sorted(p.name for p in (ROOT / "packages").iterdir() if p.is_dir())
    assert found == sorted(PACKAGES)


@pytest.mark.parametrize("package", PACKAGES)
def test_package_files(package: str) -> None:
    base = ROOT / "packages" / package
    src = base / "src" / module_name(package)
    for path in (base / "README.md", base / "CHANGELOG.md", src / "py.typed", base / "tests"):
        assert path.exists(), f"{package} lacks {path.relative_to(ROOT)}"


@pytest.mark.parametrize("package", PACKAGES)
def test_metadata(package: str) -> None:
    project = pyproject(package)["project"]
    assert project["name"] == package
    assert Version("3.10") in SpecifierSet(project["requires-python"])
    assert "torch" in " ".join(project["dependencies"])
    # One source for the version: the module's _version.py, read by the build.
    assert project["dynamic"] == ["version"]
    attr = pyproject(package)["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == f"{module_name(package)}._version.__version__"


@pytest.mark.parametrize("package", PACKAGES)
def test_version_is_consistent_and_in_the_changelog(package: str) -> None:
    module = importlib.import_module(module_name(package))
    installed = importlib.metadata.version(package)
    assert module.__version__ == installed, (
        f"{package}: __version__ {module.__version__} but installed metadata says {installed}; "
        "reinstall the workspace (make test does)"
    )
    changelog = (ROOT / "packages" / package / "CHANGELOG.md").read_text()
    assert re.search(rf"^## {re.escape(module.__version__)}\b", changelog, re.M), (
        f"{package}'s CHANGELOG.md has no section for version {module.__version__}"
    )


@pytest.mark.parametrize("package", PACKAGES)
def test_public_api_is_declared(package: str) -> None:
    init = ROOT / "packages" / package / "src" / module_name(package) / "__init__.py"
    tree = ast.parse(init.read_text())
    declared = [
        node
        for node in tree.body
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
    ]
    assert declared, f"{init.relative_to(ROOT)} defines no __all__"
    module = importlib.import_module(module_name(package))
    missing = [name for name in module.__all__ if not hasattr(module, name)]
    assert not missing, f"{package}.__all__ names what the module lacks: {missing}"
