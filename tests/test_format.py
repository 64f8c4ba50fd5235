"""Style checks: C++/CUDA under csrc/ formatted by clang-format (.clang-format), Python by the
pycodestyle and pyflakes rules of ruff (pyproject.toml). Both tools come with the `test` extra,
pinned; where they are missing the checks skip, except in CI (CI=true), where that fails."""
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _tool(name):
    here = pathlib.Path(sys.executable).parent / name
    path = str(here) if here.exists() else shutil.which(name)
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{name} is not installed (pip install '.[test]')")
        pytest.skip(f"{name} is not installed (pip install '.[test]')")
    return path


def _tracked(*patterns):
    out = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True,
                         text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    return out.stdout.split()


def test_cpp_is_clang_formatted():
    files = _tracked("csrc/*.cc", "csrc/*.cu", "csrc/*.cuh", "csrc/*.h")
    assert files
    p = subprocess.run([_tool("clang-format"), "--dry-run", "-Werror", *files], cwd=ROOT,
                       capture_output=True, text=True)
    assert p.returncode == 0, "clang-format -i <file> fixes:\n" + p.stderr[-3000:]


def test_python_style():
    p = subprocess.run([_tool("ruff"), "check", "--output-format", "concise", "jax_ep", "tests",
                        "benchmarks", "examples", "scripts"], cwd=ROOT, capture_output=True,
                       text=True)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-1000:]
