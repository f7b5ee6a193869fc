"""Set up Triton's CPU interpreter for tests.

Triton decides between compiling and interpreting when ``@triton.jit`` runs, by
reading ``TRITON_INTERPRET`` at that moment. The variable therefore has to be set
before the first module that defines a kernel is imported; a kernel defined
earlier stays compiled and fails on a machine without a GPU.
"""

from __future__ import annotations

import os
import sys

__all__ = ["interpreter_enabled", "use_triton_interpreter"]


def use_triton_interpreter() -> None:
    """Make every Triton kernel defined from now on run in Triton's interpreter.

    Raises:
        RuntimeError: a compiled (non-interpreted) kernel was already defined by a
            module imported before this call; it names the kernels.
    """
    os.environ["TRITON_INTERPRET"] = "1"
    compiled = _compiled_kernels()
    if compiled:
        raise RuntimeError(
            "use_triton_interpreter() must run before any Triton kernel is defined; "
            f"already compiled: {', '.join(compiled)}. Call it first (the workspace "
            "conftest.py does so at start-up)."
        )


def interpreter_enabled() -> bool:
    """Whether kernels defined now would run in Triton's interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _compiled_kernels() -> list[str]:
    jit = sys.modules.get("triton.runtime.jit")
    if jit is None:
        return []  # triton not imported yet: no kernel can exist
    kernel_type = jit.JITFunction
    found = []
    for name, module in list(sys.modules.items()):
        if module is None or name == "triton" or name.startswith("triton."):
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, kernel_type):
                found.append(f"{name}.{attr}")
    return sorted(found)
