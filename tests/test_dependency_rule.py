"""The dependency rule of DESIGN.md: a leaf package imports no other ms package.

Leaves meet only in ms-train, through plain PyTorch types; ms-train names its
siblings as version ranges, never exact pins.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _workspace import (
    LEAVES,
    MS_MODULES,
    ROOT,
    imported_siblings,
    module_name,
    ms_imports,
    pyproject,
)
from packaging.requirements import Requirement


def test_the_import_scan_sees_every_import_form(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "import os\nimport ms_optim\nfrom ms_data.loader import x\n"
        "def f():\n    import ms_ckpt.io as io\nfrom . import ms_parallel\n"
    )
    assert ms_imports(source) == [(2, "ms_optim"), (3, "ms_data.loader"), (5, "ms_ckpt.io")]


@pytest.mark.parametrize("leaf", LEAVES)
def test_leaf_source_imports_no_other_ms_package(leaf: str) -> None:
    own = module_name(leaf)
    offenders = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path in sorted((ROOT / "packages" / leaf / "src").rglob("*.py"))
        for line, name in ms_imports(path)
        if name.split(".")[0] != own
    ]
    assert not offenders, "leaf packages must not import other ms packages:\n" + "\n".join(
        offenders
    )


@pytest.mark.parametrize("leaf", LEAVES)
def test_leaf_declares_no_ms_requirement(leaf: str) -> None:
    project = pyproject(leaf)["project"]
    requirements = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        requirements += extra
    ms = [r for r in requirements if Requirement(r).name.startswith("ms-")]
    assert not ms, f"{leaf} requires other ms packages: {ms}"


def _sibling_requirements(requirements: list[str]) -> dict[str, Requirement]:
    parsed = [Requirement(r) for r in requirements]
    return {r.name: r for r in parsed if r.name.startswith("ms-")}


def test_ms_train_requires_exactly_the_siblings_it_imports_as_ranges() -> None:
    # A sibling ms-train does not import would only make installing harder: before
    # this rule, `pip install ms-train` also needed packages that were still empty.
    imported = set(imported_siblings())
    assert imported, "the import scan found no sibling in ms-train's source"
    project = pyproject("ms-train")["project"]
    siblings = _sibling_requirements(project["dependencies"])
    assert sorted(siblings) == sorted(imported), (
        f"ms-train requires {sorted(siblings)} but imports {sorted(imported)}"
    )
    for extra, requirements in project.get("optional-dependencies", {}).items():
        extra_siblings = _sibling_requirements(requirements)
        assert set(extra_siblings) <= imported, (
            f"ms-train[{extra}] requires {sorted(set(extra_siblings) - imported)}, "
            "which ms-train does not import"
        )
        siblings.update({f"{name} (extra {extra})": r for name, r in extra_siblings.items()})
    for name, requirement in siblings.items():
        operators = {spec.operator for spec in requirement.specifier}
        assert operators, f"ms-train requires {name} with no version range"
        assert not operators & {"==", "==="}, f"ms-train pins {requirement}; use a range"


# Run in a fresh interpreter: an import hook refuses every other ms package, which
# also catches imports made at import time by importlib or __import__.
ISOLATED_IMPORT = textwrap.dedent(
    """
    import importlib, sys
    own, others = sys.argv[1], set(sys.argv[2].split(","))

    class Refuse:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in others:
                raise ImportError(f"{own} imported {name}, another ms package")
            return None

    sys.meta_path.insert(0, Refuse())
    module = importlib.import_module(own)
    for name in getattr(module, "__all__", []):
        getattr(module, name)
    print("ok", own)
    """
)


@pytest.mark.slow
def test_each_leaf_imports_with_every_other_ms_package_refused() -> None:
    procs = {
        leaf: subprocess.Popen(
            [
                sys.executable,
                "-c",
                ISOLATED_IMPORT,
                module_name(leaf),
                ",".join(sorted(MS_MODULES - {module_name(leaf)})),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for leaf in LEAVES
    }
    failures = []
    for leaf, proc in procs.items():
        _, err = proc.communicate(timeout=120)
        if proc.returncode != 0:
            failures.append(f"{leaf}:\n{err}")
    assert not failures, "\n".join(failures)
