"""Installing ms-train the way its README says: `make dist`, then
`pip install --find-links dist ms-train` in a fresh venv, which then trains; and each
leaf's wheel installed alone into that venv (torch and nothing else there), beforehand.

One fresh venv for the module: `make dist` creates it (as on a fresh clone) and
builds the wheels once; the tests after the first reuse what it installed.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from _fresh_venv import TORCH_PIN, ms_distributions, pip, user_env
from _workspace import LEAVES, PACKAGES, ROOT, imported_siblings, module_name
from packaging.utils import canonicalize_name

INSTALL = "pip install --find-links dist ms-train"


def _version(package: str) -> str:
    return str(importlib.import_module(module_name(package)).__version__)


@dataclass(frozen=True)
class Built:
    """What `make dist` left: the folder the README's command runs in."""

    home: Path  # holds dist/ and venv/; the install command runs here
    python: Path  # the fresh venv's interpreter


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    if shutil.which("make") is None:
        pytest.skip("GNU make builds the wheels (make dist)")
    home = tmp_path_factory.mktemp("dist")
    # VENV and DIST outside the clone: the developer's .venv and dist/ stay as they are.
    result = subprocess.run(
        [
            "make",
            "--no-print-directory",
            "-C",
            str(ROOT),
            "dist",
            f"VENV={home / 'venv'}",
            f"DIST={home / 'dist'}",
            f"PYTHON={sys.executable}",
        ],
        env=user_env(),
        capture_output=True,
        text=True,
        timeout=240,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, f"make dist failed:\n{result.stdout}\n{result.stderr}"
    return Built(home=home, python=home / "venv" / "bin" / "python")


@pytest.fixture(scope="module")
def with_torch(built: Built) -> Built:
    """The fresh venv with the pinned torch and no ms package yet."""
    assert ms_distributions(built.python) == {}, "the fresh venv already holds ms packages"
    # Torch first, as a user picks their build; the pin keeps the one on this disk.
    # Not compiling its thousands of modules to bytecode halves this, the longest step.
    pip(built.python, "install", "--quiet", "--no-compile", TORCH_PIN)
    return built


@pytest.fixture(scope="module")
def installed(with_torch: Built) -> Built:
    assert ms_distributions(with_torch.python) == {}, "the fresh venv already holds ms packages"
    pip(with_torch.python, *INSTALL.split()[1:], "--quiet", cwd=with_torch.home)
    return with_torch


def _run(built: Built, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    # A session of its own, so that a timeout also ends the ranks torchrun started.
    proc = subprocess.Popen(
        [str(built.python.parent / args[0]), *args[1:]],
        # Not the repository, so nothing can be imported from a source tree.
        cwd=built.home,
        env={**user_env(), "MS_TRAIN_CACHE": str(built.home / "cache")},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=60)
        pytest.fail(f"{' '.join(args)} ran past {timeout} s:\n{out}\n{err}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_the_readmes_give_the_tested_commands() -> None:
    for readme in (ROOT / "README.md", ROOT / "packages" / "ms-train" / "README.md"):
        text = readme.read_text()
        assert "make dist" in text and INSTALL in text, (
            f"{readme.relative_to(ROOT)} should give `make dist` and `{INSTALL}`, "
            "the commands this test runs"
        )
    assert re.search(r"^dist:", (ROOT / "Makefile").read_text(), re.M), "Makefile has no dist"


@pytest.mark.slow
def test_make_dist_builds_a_wheel_and_an_sdist_of_each_package(built: Built) -> None:
    files = sorted(p.name for p in (built.home / "dist").iterdir())
    expected = sorted(
        f"{module_name(p)}-{_version(p)}{suffix}"
        for p in PACKAGES
        for suffix in ("-py3-none-any.whl", ".tar.gz")
    )
    assert files == expected
    # Each sdist builds a wheel with the same files as the one make dist built.
    rebuilt = built.home / "rebuilt"
    sdists = [str(built.home / "dist" / f) for f in files if f.endswith(".tar.gz")]
    pip(
        built.python,
        "wheel",
        "--quiet",
        "--no-deps",
        "--no-build-isolation",
        "-w",
        str(rebuilt),
        *sdists,
    )
    for package in PACKAGES:
        name = f"{module_name(package)}-{_version(package)}-py3-none-any.whl"
        with zipfile.ZipFile(built.home / "dist" / name) as a, zipfile.ZipFile(rebuilt / name) as b:
            assert sorted(a.namelist()) == sorted(b.namelist()), name
            assert f"{module_name(package)}/py.typed" in a.namelist(), name
        sdist = built.home / "dist" / f"{module_name(package)}-{_version(package)}.tar.gz"
        with tarfile.open(sdist) as tar:
            assert any(n.endswith("/README.md") for n in tar.getnames()), sdist.name


@pytest.mark.slow
def test_each_leaf_installs_alone_from_its_wheel(with_torch: Built) -> None:
    # Before `installed` (module order): the venv holds torch and no ms package yet.
    python = with_torch.python
    assert ms_distributions(python) == {}, "the fresh venv already holds ms packages"
    for leaf in LEAVES:
        # The wheel's path, not its name: an index could hold another ms-* of that name.
        # Torch pinned as the dev install does, so no leaf can pull a different build.
        wheel = with_torch.home / "dist" / f"{module_name(leaf)}-{_version(leaf)}-py3-none-any.whl"
        pip(python, "install", "--quiet", "--no-compile", str(wheel), TORCH_PIN)
        installed = sorted(ms_distributions(python))
        assert installed == [leaf], f"installing {leaf} pulled other ms packages: {installed}"
        result = subprocess.run(
            [str(python), "-c", f"import {module_name(leaf)} as m; print(m.__version__)"],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=with_torch.home,  # not the repository: nothing comes from a source tree
            # Without the session's TRITON_INTERPRET: the interpreter needs numpy,
            # which no leaf requires.
            env=user_env(),
        )
        assert result.returncode == 0, f"import {module_name(leaf)} failed:\n{result.stderr}"
        assert result.stdout.strip() == _version(leaf), result.stdout
        pip(python, "uninstall", "--yes", "--quiet", leaf)
    assert ms_distributions(python) == {}


@pytest.mark.slow
def test_the_readme_install_takes_only_the_siblings_ms_train_needs(installed: Built) -> None:
    found = ms_distributions(installed.python)
    # Only what ms-train imports.
    expected = sorted(["ms-train", *imported_siblings()])
    assert sorted(canonicalize_name(n) for n in found) == expected, f"installed {sorted(found)}"
    for name, version in found.items():
        assert version == _version(name), f"{name} {version} is not the workspace's"
    where = subprocess.run(
        [str(installed.python), "-c", "import ms_train; print(ms_train.__file__)"],
        cwd=installed.home,
        env=user_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(installed.home / "venv"), where.stdout


@pytest.mark.slow
def test_the_installed_ms_train_counts_flops(installed: Built) -> None:
    flops = _run(installed, "ms-train", "flops", "--preset", "tiny", timeout=120)
    assert flops.returncode == 0, flops.stdout + flops.stderr
    assert "training FLOPs per token" in flops.stdout


@pytest.mark.slow
def test_the_installed_ms_train_trains_the_tiny_preset_on_two_ranks(installed: Built) -> None:
    out = installed.home / "run"
    overrides = [
        "train.steps=2",
        "optim.warmup_steps=1",
        "checkpoint.every=2",
        "train.log_every=1",
        "train.sample_tokens=8",
        f"train.out_dir={out}",
    ]
    sets = [a for o in overrides for a in ("--set", o)]
    train = _run(installed, "ms-train", "--preset", "tiny", "--nproc", "2", *sets, timeout=240)
    assert train.returncode == 0, train.stdout + train.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["start_step"], summary["end_step"], summary["world_size"]) == (0, 2, 2)
