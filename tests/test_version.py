"""The version has one source, `jax_ep.__version__` in jax_ep/__init__.py: pyproject.toml reads
it at build time (scikit-build-core's regex metadata provider), and an installed jax_ep reports
the same version in its metadata."""
from __future__ import annotations

import importlib.metadata
import pathlib
import re

import pytest

import jax_ep

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = pathlib.Path(__file__).resolve().parents[1]
# scikit-build-core's default pattern for a version (scikit_build_core/metadata/regex.py)
DEFAULT_REGEX = r'(?i)^(__version__|VERSION)(?: ?\: ?str)? *= *([\'"])v?(?P<value>.+?)\2'


def _pyproject():
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def test_pyproject_reads_the_version_from_the_package():
    cfg = _pyproject()
    assert "version" not in cfg["project"], "pyproject.toml: a second, static version"
    assert "version" in cfg["project"].get("dynamic", [])
    meta = cfg["tool"]["scikit-build"]["metadata"]["version"]
    assert meta["provider"] == "scikit_build_core.metadata.regex"
    source = ROOT / meta["input"]
    # the package's own __init__.py (the imported jax_ep may be an installed copy of it)
    assert source == ROOT / "jax_ep" / "__init__.py" and source.is_file()
    m = re.search(meta.get("regex", DEFAULT_REGEX), source.read_text(), re.MULTILINE)
    assert m, f"{meta['input']}: no version the build can read"
    assert m.group("value") == jax_ep.__version__


def test_version_is_a_release_number():
    assert re.fullmatch(r"\d+\.\d+\.\d+((a|b|rc)\d+)?(\.dev\d+)?", jax_ep.__version__), \
        jax_ep.__version__


def test_installed_metadata_matches():
    try:
        dist = importlib.metadata.distribution("jax_ep")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("jax_ep is not installed (run from the source tree)")
    installed = pathlib.Path(dist.locate_file("jax_ep/__init__.py")).resolve()
    if installed != pathlib.Path(jax_ep.__file__).resolve():
        pytest.skip(f"the jax_ep imported ({jax_ep.__file__}) is not the installed one")
    assert dist.version == jax_ep.__version__
