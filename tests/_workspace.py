"""Facts about the workspace layout shared by the workspace tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tomllib

ROOT = Path(__file__).resolve().parent.parent
LEAVES = ("ms-kernels", "ms-parallel", "ms-optim", "ms-data", "ms-ckpt", "ms-health")
PACKAGES = (*LEAVES, "ms-train")


def module_name(package: str) -> str:
    return package.replace("-", "_")


def pyproject(package: str) -> dict[str, Any]:
    with open(ROOT / "packages" / package / "pyproject.toml", "rb") as f:
        return tomllib.load(f)
