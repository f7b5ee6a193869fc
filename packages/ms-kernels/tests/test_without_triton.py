"""ms_kernels imports and runs its torch paths where triton is not installed (macOS, Windows).

triton is a Linux-only dependency; the kernels' modules are imported only when a
call runs on the Triton backend. Checked in a fresh interpreter whose import system
refuses ``triton``.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import importlib.abc, sys

    class RefuseTriton(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ImportError(f"refused: {name}")
            return None

    sys.meta_path.insert(0, RefuseTriton())
    import torch
    import ms_kernels as mk

    x = torch.randn(4, 16)
    w, b = torch.ones(16), torch.zeros(16)
    mk.layer_norm(x, (16,), w, b)
    mk.add_layer_norm(x, x, (16,), w, b)
    mk.rms_norm(x, (16,), w)
    mk.bias_gelu(x, b, "tanh")
    q = torch.randn(1, 8, 2, 16)
    mk.sliding_window_attention(q, q, q, window=mk.hf_window(3))
    mk.sliding_window_attention(q, q, q, 0.1, window=mk.hf_window(3))
    assert not [m for m in sys.modules if m == "triton" or m.startswith("triton.")]
    for call in (
        lambda: mk.layer_norm(x, (16,), w, b, backend="triton"),
        lambda: mk.bias_gelu(x, b, backend="triton"),
        lambda: mk.sliding_window_attention(q, q, q, backend="triton"),
    ):
        try:
            call()
        except RuntimeError as err:
            assert "pip install" in str(err), err
        else:
            raise AssertionError("backend='triton' ran without triton")
    print("ok")
    """
)


def test_torch_paths_work_without_triton() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "ok"
