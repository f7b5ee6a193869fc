"""Facts about the workspace layout shared by the workspace tests."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import tomllib

ROOT = Path(__file__).resolve().parent.parent
LEAVES = ("ms-kernels", "ms-parallel", "ms-optim", "ms-data", "ms-ckpt", "ms-health")
PACKAGES = (*LEAVES, "ms-train")


def module_name(package: str) -> str:
    return package.replace("-", "_")


MS_MODULES = frozenset(module_name(p) for p in PACKAGES)


def pyproject(package: str) -> dict[str, Any]:
    with open(ROOT / "packages" / package / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def ms_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import of an ms package in a source file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [(node.lineno, n) for n in names if n.split(".")[0] in MS_MODULES]
    return found


def imported_siblings() -> list[str]:
    """The ms packages that ms-train's source imports, by distribution name."""
    found = {
        name.split(".")[0].replace("_", "-")
        for path in sorted((ROOT / "packages" / "ms-train" / "src").rglob("*.py"))
        for _, name in ms_imports(path)
    }
    return sorted(found - {"ms-train"})
