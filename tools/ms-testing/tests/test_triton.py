"""use_triton_interpreter must take effect before kernels are defined, and refuse after."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# Triton reads a kernel's source from its file, so the kernel lives in a module.
KERNEL_MODULE = """
import triton
import triton.language as tl

@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, x + y, mask=mask)
"""


def _run(tmp_path: Path, code: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "kern.py").write_text(KERNEL_MODULE)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_kernels_defined_after_the_call_run_on_cpu(tmp_path: Path) -> None:
    result = _run(
        tmp_path,
        """
        from ms_testing import interpreter_enabled, use_triton_interpreter
        assert not interpreter_enabled()
        use_triton_interpreter()
        assert interpreter_enabled()
        import torch
        from kern import add_kernel
        x = torch.arange(37, dtype=torch.float32)
        y = torch.full((37,), 0.5)
        out = torch.empty_like(x)
        add_kernel[(3,)](x, y, out, 37, BLOCK=16)
        torch.testing.assert_close(out, x + y)
        print("ran", type(add_kernel).__name__)
        """,
    )
    assert result.returncode == 0, result.stderr
    assert "ran InterpretedFunction" in result.stdout


@pytest.mark.slow
def test_refuses_when_a_compiled_kernel_already_exists(tmp_path: Path) -> None:
    result = _run(
        tmp_path,
        """
        import kern
        from ms_testing import use_triton_interpreter
        try:
            use_triton_interpreter()
        except RuntimeError as e:
            print("refused:", e)
        """,
    )
    assert result.returncode == 0, result.stderr
    assert "refused:" in result.stdout and "kern.add_kernel" in result.stdout
