"""python -m jax_ep.launch on CPU: N processes under jax.distributed, exit status, settings."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import os, sys
    import jax
    jax.distributed.initialize()          # already done by the launcher: must return at once
    import jax_ep
    info = jax_ep.runtime_info()
    print(f"rank {jax.process_index()} of {jax.process_count()}: {info['process_mode']}; "
          f"nvls {os.environ.get('NVSHMEM_DISABLE_NVLS')}; args {sys.argv[1:]}", flush=True)
    if "--fail-rank" in sys.argv and jax.process_index() == int(sys.argv[-1]):
        sys.exit(7)
""")


def _run(tmp_path, n, *args):
    script = tmp_path / "child.py"
    script.write_text(SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    env.pop("NVSHMEM_DISABLE_NVLS", None)
    return subprocess.run([sys.executable, "-m", "jax_ep.launch", "-n", str(n), "--grace", "30",
                           str(script), *args], env=env, capture_output=True, text=True,
                          timeout=240, cwd=str(tmp_path))


def test_launch_starts_n_processes(tmp_path):
    p = _run(tmp_path, 3, "a", "b")
    assert p.returncode == 0, p.stdout + p.stderr
    for r in range(3):
        assert f"rank {r} of 3: 3 processes (reference backend); nvls 1; args ['a', 'b']" in \
            p.stdout, p.stdout + p.stderr


def test_launch_returns_a_failing_child_status(tmp_path):
    p = _run(tmp_path, 2, "--fail-rank", "1")
    assert p.returncode == 7, p.stdout + p.stderr
