"""Start N local JAX processes, one GPU each, under jax.distributed.

    python -m jax_ep.launch -n 4 script.py [args ...]
    python -m jax_ep.launch -n 4 tests/mp_worker.py

Each child sees every GPU (NVSHMEM maps its peers' memory over NVLink) but JAX uses only its own
(`local_device_ids`), and `jax.distributed.initialize` has already run when the script starts
(a later call to it from the script returns at once). The coordinator listens on 127.0.0.1: for
several hosts use your cluster launcher instead (docs/multiprocess.md). Options:

  -n N            processes (default: number of GPUs)
  --gpus 0,1,..   CUDA ordinals for the ranks (default 0..N-1)
  --port P        coordinator port (default: a free one)
  --grace S       after a child fails, seconds the others get to fail or finish on their own
                  before they are killed (default JAX_EP_TIMEOUT_S + 60)

Environment set for the children (unless already set): NCCL_NVLS_ENABLE=0,
NVSHMEM_DISABLE_NVLS=1 (no NVLink multicast), XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 (room for the
NVSHMEM symmetric heap). Exit status: the first non-zero child status, else 0.
"""
from __future__ import annotations

import os
import runpy
import signal
import socket
import subprocess
import sys
import time

from jax_ep import runtime

_CHILD_ENV = "JAX_EP_LAUNCH_CHILD"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _num_gpus() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        return max(1, sum(1 for line in out.stdout.splitlines() if line.startswith("GPU ")))
    except (OSError, subprocess.SubprocessError):
        return 1


def _parse(argv):
    n = None
    gpus = None
    port = None
    grace = runtime.timeout_ns() / 1e9 + 60
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in ("-h", "--help"):
            print(__doc__)
            sys.exit(0)
        if a == "-n":
            n = int(argv[i + 1])
        elif a == "--gpus":
            gpus = [int(v) for v in argv[i + 1].split(",")]
        elif a == "--port":
            port = int(argv[i + 1])
        elif a == "--grace":
            grace = float(argv[i + 1])
        else:
            break
        i += 2
    rest = argv[i:]
    if not rest:
        sys.exit("usage: python -m jax_ep.launch [-n N] [--gpus 0,1] script.py [args] | -m module")
    n = n or (len(gpus) if gpus else _num_gpus())
    gpus = gpus or list(range(n))
    if len(gpus) != n:
        sys.exit(f"jax_ep.launch: -n {n} but --gpus names {len(gpus)} GPUs")
    return n, gpus, port or _free_port(), grace, rest


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if os.environ.get(_CHILD_ENV):
        return _child(argv)
    n, gpus, port, grace, rest = _parse(argv)
    procs = []
    for rank in range(n):
        env = dict(os.environ)
        for k, v in (("NCCL_NVLS_ENABLE", "0"), ("NVSHMEM_DISABLE_NVLS", "1"),
                     ("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")):
            env.setdefault(k, v)
        env.update({_CHILD_ENV: "1", "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
                    "JAX_EP_NUM_PROCESSES": str(n), "JAX_EP_PROCESS_ID": str(rank),
                    "JAX_LOCAL_DEVICE_IDS": str(gpus[rank])})
        procs.append(subprocess.Popen([sys.executable, "-m", "jax_ep.launch"] + rest, env=env))
    status = 0
    failed_at = None
    while True:
        codes = [p.poll() for p in procs]
        for c in codes:
            if c not in (None, 0) and status == 0:
                status = c
                failed_at = time.monotonic()
        if all(c is not None for c in codes):
            break
        if failed_at is not None and time.monotonic() - failed_at > grace:
            for p in procs:
                if p.poll() is None:
                    print(f"jax_ep.launch: killing pid {p.pid} ({grace:.0f} s after a failure)",
                          file=sys.stderr, flush=True)
                    p.send_signal(signal.SIGKILL)
        time.sleep(0.2)
    return status


def _child(rest) -> int:
    import jax
    from jax._src import distributed

    jax.distributed.initialize(
        coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
        num_processes=int(os.environ["JAX_EP_NUM_PROCESSES"]),
        process_id=int(os.environ["JAX_EP_PROCESS_ID"]),
        local_device_ids=[int(os.environ["JAX_LOCAL_DEVICE_IDS"])])
    original = jax.distributed.initialize

    def initialize(*args, **kwargs):  # the script's own call: already done by the launcher
        if distributed.global_state.client is not None:
            return None
        return original(*args, **kwargs)

    jax.distributed.initialize = initialize
    if rest[0] == "-m":
        sys.argv = rest[1:]
        runpy.run_module(rest[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = rest
        sys.path.insert(0, os.path.dirname(os.path.abspath(rest[0])))
        runpy.run_path(rest[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
