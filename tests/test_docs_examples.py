"""docs/getting-started.md promises that its Python blocks run as they are, in order, in one
interpreter, on a machine without GPUs (4 fake CPU devices, the reference backend). This runs
them so, in a process of its own (the suite's conftest sets 8 devices before jax is imported):
a block that breaks fails the test with its line on the page."""
from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "getting-started.md"
FENCE = re.compile(r"^```python\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)

# Runs the blocks given as JSON [[first line, code], ...] in one namespace. Each block is
# compiled under the page's name, shifted to its lines there, so that a traceback points at the
# page's line.
RUNNER = r"""
import json, sys, traceback
page, blocks = sys.argv[1], json.load(open(sys.argv[2]))
ns = {"__name__": "__main__"}
for i, (line, code) in enumerate(blocks, 1):
    print(f"--- block {i} (line {line})", flush=True)
    try:
        exec(compile("\n" * (line - 1) + code, page, "exec"), ns)
    except BaseException:
        traceback.print_exc()
        print(f"FAILED: block {i} of {page}, which starts at line {line}", flush=True)
        sys.exit(1)
print("ALL BLOCKS RAN", flush=True)
"""


def python_blocks(text):
    """[(line of the block's first line of code, code)] of every ```python block of `text`."""
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in FENCE.finditer(text)]


def run_blocks(blocks, tmp_path, timeout=900):
    spec = tmp_path / "blocks.json"
    spec.write_text(json.dumps(blocks))
    env = dict(os.environ)
    env.pop("JAX_EP_CHECK", None)   # the page's own settings only
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in
                                           env.get("PYTHONPATH", "").split(os.pathsep) if p]))
    return subprocess.run([sys.executable, "-c", RUNNER, str(PAGE), str(spec)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=timeout)


def test_the_page_has_its_blocks():
    blocks = python_blocks(PAGE.read_text())
    assert len(blocks) >= 8, f"{PAGE}: {len(blocks)} python blocks"
    first = blocks[0][1]
    assert first.index("xla_force_host_platform_device_count=4") < first.index("import jax"), \
        "the first block must ask for 4 CPU devices before it imports jax"


def test_every_python_block_runs_on_cpu(tmp_path):
    pytest.importorskip("flax")   # the page uses the Flax module
    out = run_blocks(python_blocks(PAGE.read_text()), tmp_path)
    log = out.stdout + out.stderr
    assert out.returncode == 0 and "ALL BLOCKS RAN" in out.stdout, log[-6000:]
    # what the page says its last block prints: the check stopped the dispatch
    assert "dispatch {'num_invalid': 0, 'num_dropped': " in out.stdout, log[-6000:]


def test_a_broken_block_fails_with_its_line(tmp_path):
    """The check itself: an error planted in the page's second block (the expert weights swapped
    in the gradient's loss) stops the run there, before the third block, and the report names
    the block and the page's line of the call that failed."""
    blocks = python_blocks(PAGE.read_text())[:3]
    line, code = blocks[1]
    call = "moe(x, router, w_gate_up, w_down)"
    assert call in code
    blocks[1] = (line, code.replace(call, "moe(x, router, w_down, w_gate_up)", 1))
    bad = line + code[:code.index(call)].count("\n")
    out = run_blocks(blocks, tmp_path)
    log = out.stdout + out.stderr
    assert out.returncode == 1, log[-6000:]
    assert f"FAILED: block 2 of {PAGE}, which starts at line {line}" in out.stdout, log[-6000:]
    assert "--- block 3" not in out.stdout, log[-6000:]
    assert f'File "{PAGE}", line {bad}' in out.stderr, log[-6000:]
    assert "w_gate_up" in out.stderr, log[-6000:]
