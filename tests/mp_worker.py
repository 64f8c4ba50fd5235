"""Per-process GPU suite: run under
`python -m jax_ep.launch -n N tests/mp_worker.py [--kill-rank r]`.

One JAX process per GPU (NVSHMEM transport). Every check runs the CUDA kernels and the reference
backend inside one shard_map on the same global inputs (made from the same seed in every
process) and compares this process's shards: high-throughput layouts and copies bit-exact,
low-latency rows per (expert, source) exact (FP8 against the NumPy oracle), combines within
float32-accumulation tolerance; random, skewed and masked routing, odd token counts, several
hidden sizes and dtypes, FP8, capacity drops, the LL send / receive split, and back-to-back
calls in a scan; and the fused MoE layer (its first half one kernel, x staged; the second half
unfused in this mode) against the unfused one, both on the CUDA kernels, with the fused rows
bit-exact. Prints "PASS rank r" at the end and exits normally (NVSHMEM finalize and
jax.distributed shutdown run); any failure exits non-zero at once (no collective exit path that
a failed peer could hang).

With JAX_EP_FORCE_REMOTE_PEERS=1 every other process is treated as a remote peer (no load/store
access): the same checks then run the NVSHMEM put / get kernels of nvshmem/remote.h.

--kill-rank r [--kill-op ll|ht]: rank r compiles a low-latency (default) or high-throughput
dispatch, then exits before running it; the others must raise jax_ep.PeerTimeoutError with the
kernel's timeout message, not hang (tests/test_multiprocess.py checks it).
--extra-compile-rank r: rank r first compiles a program with a jax_ep op that the others never
compile; every rank must then fail to compile with the lease ledger's error naming the
disagreement, instead of running ops whose slots and buffers differ between the processes.
These two and --absent-rank run jax_ep's kernels only (no NCCL), so they also run with every
process on one GPU (NVSHMEM with several processes per GPU).
--absent-rank r: rank r never sets up jax_ep (it idles, then exits); the others must raise
within JAX_EP_TIMEOUT_S an error naming process r, instead of waiting in NVSHMEM's set-up.
"""
from __future__ import annotations

import os
import sys
import time
import traceback
import zlib

import numpy as np

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax_ep  # noqa: E402
from helpers import split_ranks  # noqa: E402
from test_gpu import (_assert_ht_equal, _assert_ll_equal, _ht_body, _ll_body,  # noqa: E402
                      _routing)

RANK = None
# Every process computes the reference for all ranks itself (virtual ranks: jax.vmap over the
# EP axis on its own GPU), instead of in the shared shard_map whose collectives are NCCL's:
# NCCL refuses several processes on one GPU (tests/test_multiprocess.py sets it then).
LOCAL_REFERENCE = os.environ.get("JAX_EP_MP_LOCAL_REFERENCE") == "1"


def option(name, default=None):
    """The value after `name` on the command line, or default when it is absent."""
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def seed(*key):
    """The same seed in every process (hash() of a str is salted per process)."""
    return zlib.crc32(repr(key).encode())


def put(mesh, arr, spec):
    """Global array from the same host value on every process (each takes its own shards)."""
    arr = np.asarray(arr)
    return jax.make_array_from_callback(arr.shape, NamedSharding(mesh, spec), lambda i: arr[i])


def local(tree):
    """This process's shard of every output (one device per process)."""
    def one(a):
        shards = a.addressable_shards
        assert len(shards) == 1
        return np.asarray(shards[0].data)
    return jax.tree.map(one, tree)


def reference_shard(body, R, args, ep_dim=0):
    """This rank's outputs of `body` (a per-rank body on the reference backend) with every rank
    computed here as a virtual rank: global inputs split along ep_dim, no collective between
    the processes."""
    ranks = jax.tree.map(lambda a: split_ranks(a, R, ep_dim), args)  # on this process's GPU
    out = jax.jit(jax.vmap(body, axis_name="ep", axis_size=R))(*ranks)
    return jax.tree.map(lambda a: np.asarray(a[RANK]), out)


def both_backends(make_body, mesh, args, spec=P("ep")):
    """(cuda, reference) outputs of this process's rank: one shard_map running both, or with
    LOCAL_REFERENCE the CUDA backend in the shard_map and the reference in this process."""
    put_args = jax.tree.map(lambda a: put(mesh, a, spec), args)
    if not LOCAL_REFERENCE:
        f = jax.jit(jax.shard_map(make_body(("cuda", "reference")), mesh=mesh, in_specs=spec,
                                  out_specs=spec, check_vma=False))
        return local(f(*put_args))
    f = jax.jit(jax.shard_map(make_body(("cuda",)), mesh=mesh, in_specs=spec, out_specs=spec,
                              check_vma=False))
    return (local(f(*put_args))[0],
            reference_shard(make_body(("reference",)), mesh.devices.size, args)[0])


def ht_check(mesh, x, idx, w, E, capacity=None, atol=2e-2, spec=None):
    cu, rf = both_backends(lambda b: _ht_body(E, capacity, backends=b), mesh, (x, idx, w),
                           spec or P("ep"))
    _assert_ht_equal(cu, rf, atol)
    return cu


def ll_check(mesh, x, idx, w, E, M, use_fp8, round_scale, split):
    R = mesh.devices.size
    L = E // R
    T = x.shape[0] // R
    cu, rf = both_backends(
        lambda b: _ll_body(E, M, use_fp8, round_scale, split, backends=b), mesh, (x, idx, w))
    _assert_ll_equal(cu, rf, x, T, M, use_fp8, round_scale, 1, L)


def scan_check(mesh, kind, steps=200):
    R = mesh.devices.size
    rng = np.random.default_rng(5)
    T, M, H, K, E = 16, 16, 256, 4, 4 * R
    xs = rng.standard_normal((steps, R * T, H)).astype(np.float32)
    idx = np.stack([_routing("masked", rng, R, T, K, E) for _ in range(steps)])
    w = rng.random((steps, R * T, K)).astype(np.float32)

    def run(be):
        def body(xs, idx, w):
            def step(c, inp):
                x, i, wi = inp
                x = x.astype(jnp.bfloat16)
                if kind == "ht":
                    r = jax_ep.dispatch(x, i, num_experts=E, backend=be)
                    out = jax_ep.combine(r.recv_x, r.handle, backend=be)
                    return c, (out, r.handle.recv_src)
                if kind == "ll_split" and be == "cuda":
                    r = jax_ep.low_latency_dispatch_recv(jax_ep.low_latency_dispatch_send(
                        x, i, num_experts=E, max_tokens_per_rank=M, use_fp8=False, backend=be))
                    out = jax_ep.low_latency_combine_recv(jax_ep.low_latency_combine_send(
                        r.recv_x, i, wi, r.handle, backend=be))
                else:
                    r = jax_ep.low_latency_dispatch(x, i, num_experts=E, max_tokens_per_rank=M,
                                                    use_fp8=False, backend=be)
                    out = jax_ep.low_latency_combine(r.recv_x, i, wi, r.handle, backend=be)
                return c, (out, r.recv_count)
            return jax.lax.scan(step, 0, (xs, idx, w))[1]
        spec = P(None, "ep")
        if be == "reference" and LOCAL_REFERENCE:
            return reference_shard(body, R, (xs, idx, w), ep_dim=1)
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
        return local(f(put(mesh, xs, spec), put(mesh, idx, spec), put(mesh, w, spec)))

    oc, sc = run("cuda")
    orf, srf = run("reference")
    np.testing.assert_array_equal(sc, srf)
    np.testing.assert_allclose(np.asarray(oc, np.float32), np.asarray(orf, np.float32),
                               rtol=2e-2, atol=5e-2)


def fused_check(mesh, kind):
    """moe_ffn(fused=True) against fused=False, and the fused dispatch + grouped GEMM's rows and
    h against dispatch(layout="expert") + grouped_matmul, all on the CUDA backend."""
    from jax_ep.fused import dispatch_matmul
    R = mesh.devices.size
    rng = np.random.default_rng(seed(R, kind, "fused"))
    T, H, I, K, E = 40, 512, 128, 4, 4 * R
    A = jax_ep.runtime.extension().fused_block_rows
    bf16 = jnp.bfloat16
    x = np.asarray(jnp.asarray(rng.standard_normal((R * T, H)), bf16))
    idx = _routing(kind, rng, R, T, K, E)
    w = rng.random((R * T, K)).astype(np.float32)
    wgu = np.asarray(jnp.asarray(rng.standard_normal((E, H, 2 * I)) / np.sqrt(H), bf16))
    wd = np.asarray(jnp.asarray(rng.standard_normal((E, I, H)) / np.sqrt(I), bf16))

    # Several processes on one GPU (LOCAL_REFERENCE) have no NCCL, and a layer whose first pass
    # may overflow exchanges its pair counts by an XLA all_gather: there the layer takes the
    # worst-case capacity (one pass, no exchange)
    L = E // R
    cap = R * T * min(K, L) + L * (A - 1) if LOCAL_REFERENCE else None

    def body(x, idx, w, wgu, wd):
        res, h = dispatch_matmul(x, idx, w, wgu, num_experts=E, backend="cuda")
        u = jax_ep.dispatch(x, idx, w, num_experts=E, layout="expert", expert_alignment=A,
                            backend="cuda")
        hu = jax_ep.grouped_matmul(u.recv_x, wgu, u.expert_sizes, backend="cuda")
        yf = jax_ep.moe_ffn(x, idx, w, wgu, wd, num_experts=E, fused=True, capacity=cap,
                            backend="cuda")
        yu = jax_ep.moe_ffn(x, idx, w, wgu, wd, num_experts=E, fused=False, capacity=cap,
                            backend="cuda")
        return res.recv_x, h, u.recv_x, hu, yf, yu, res.recv_count[None]

    spec = P("ep")
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
    xe, h, xu, hu, yf, yu, count = local(f(*(put(mesh, a, spec)
                                             for a in (x, idx, w, wgu, wd))))
    rows = slice(0, int(np.asarray(count)[0]))   # (past the last segment: not written)

    def rel(a, b):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)

    np.testing.assert_array_equal(np.asarray(xe)[rows].view(np.uint16),
                                  np.asarray(xu)[rows].view(np.uint16))
    assert rel(np.asarray(h)[rows], np.asarray(hu)[rows]) < 1e-2, rel(np.asarray(h)[rows],
                                                                      np.asarray(hu)[rows])
    assert rel(yf, yu) < 2e-2, rel(yf, yu)
    assert np.any(np.asarray(yu, np.float32)), "an all-zero layer output checks nothing"


def main():
    global RANK
    kill = option("--kill-rank")
    jax.distributed.initialize()  # no-op under jax_ep.launch; SLURM etc. otherwise
    RANK = jax.process_index()
    R = jax.process_count()
    devs = jax.devices()
    assert len(devs) == R and len(jax.local_devices()) == 1, "one GPU per process expected"
    mesh = Mesh(np.array(devs), ("ep",))
    if option("--absent-rank") is not None:
        if RANK == int(option("--absent-rank")):
            print(f"rank {RANK}: never setting up jax_ep (--absent-rank)", flush=True)
            time.sleep(float(os.environ["JAX_EP_TIMEOUT_S"]) + 20)
            os._exit(0)
        t0 = time.time()
        try:
            jax_ep.initialize()
        except RuntimeError as e:
            print(f"rank {RANK}: set-up raised after {time.time() - t0:.1f} s: {e}", flush=True)
            os._exit(5)
        print(f"rank {RANK}: set-up finished without the absent rank (unexpected)", flush=True)
        os._exit(4)
    jax_ep.initialize()
    info = jax_ep.runtime_info()
    print(f"rank {RANK}: {info['process_mode']}; self-test {info.get('nvshmem_self_test')}; "
          f"remote PEs {info.get('nvshmem_remote_pes')}", flush=True)
    if os.environ.get("JAX_EP_FORCE_REMOTE_PEERS") == "1":  # the NVSHMEM put/get path
        assert info["nvshmem_remote_pes"] == [q for q in range(R) if q != RANK], info

    def small_dispatch(T=8, H=256, op="ll"):
        """One low-latency (op "ll") or high-throughput ("ht") dispatch and its global inputs.
        Our kernels only: a reference-backend collective (NCCL) would wait for a dead process
        in its own setup, which has no timeout of ours, and refuses two processes on one GPU."""
        rng = np.random.default_rng(0)
        x = np.asarray(jnp.asarray(rng.standard_normal((R * T, H)), jnp.bfloat16))
        idx = _routing("random", rng, R, T, 2, 2 * R)

        def body(x, i):
            if op == "ht":
                return jax_ep.dispatch(x, i, num_experts=2 * R).recv_x
            return jax_ep.low_latency_dispatch(x, i, num_experts=2 * R,
                                               max_tokens_per_rank=T).recv_count
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"),
                                  check_vma=False))
        return f, (put(mesh, x, P("ep")), put(mesh, idx, P("ep")))

    if option("--extra-compile-rank") is not None:
        t0 = time.time()
        try:
            # e.g. a cost analysis of another program, on this process only
            if RANK == int(option("--extra-compile-rank")):
                g, gargs = small_dispatch(T=16, H=512)
                g.lower(*gargs).compile()
            f, args = small_dispatch()
            f.lower(*args).compile()
        except Exception as e:  # noqa: BLE001
            sys.stdout.flush()  # one write, so that the other process's lines never split it
            os.write(1, f"rank {RANK}: compile raised after {time.time() - t0:.1f} s: "
                        f"{type(e).__name__}: {e}\n".encode())
            time.sleep(3)  # the peer may still be reading this process's ledger
            os._exit(5)
        print(f"rank {RANK}: compiled without a disagreement (unexpected)", flush=True)
        os._exit(4)
    if kill is not None:
        f, args = small_dispatch(op=option("--kill-op", "ll"))
        f = f.lower(*args).compile()  # every process compiles the op (the ledger agrees)
        if RANK == int(kill):
            print(f"rank {RANK}: exiting after the compile, before the first op (--kill-rank)",
                  flush=True)
            time.sleep(2)  # the peer's compile may still be reading this process's ledger
            os._exit(3)
        t0 = time.time()
        try:  # the wait for the dead rank gives up: PeerTimeoutError, the context still usable
            jax_ep.checked(lambda: local(f(*args)))()
        except jax_ep.PeerTimeoutError as e:
            print(f"rank {RANK}: PeerTimeoutError after {time.time() - t0:.1f} s (op {e.op}, "
                  f"peer {e.peer}): {e}", flush=True)
            jnp.arange(3).sum().block_until_ready()
            os._exit(5)
        print(f"rank {RANK}: op finished after {time.time() - t0:.1f} s without the dead rank "
              "(unexpected)", flush=True)
        os._exit(4)

    t0 = time.time()
    checks = 0
    failures = []

    def attempt(name, fn, *args, **kw):
        try:
            out = fn(*args, **kw)
            print(f"rank {RANK}: ok   {name}", flush=True)
            return out
        except AssertionError as e:  # a mismatch: report and go on (same program everywhere)
            failures.append(name)
            print(f"rank {RANK}: FAIL {name}: {str(e)[:600]}", flush=True)
    only = os.environ.get("JAX_EP_MP_ONLY", "ht,ll,scan,fused").split(",")
    for kind in ("random", "skewed", "masked"):
        for T, H, dtype in [(64, 2048, np.float32), (33, 4096, np.float32), (1, 7168, None),
                            (77, 7168, None)]:
            rng = np.random.default_rng(seed(R, kind, T, H))
            E, K = 8 * R, 4
            x = rng.standard_normal((R * T, H)).astype(np.float32)
            xin = x if dtype is np.float32 else jnp.asarray(x, jnp.bfloat16)
            if "ht" in only:
                attempt(f"ht {kind} T={T} H={H}", ht_check, mesh, np.asarray(xin),
                        _routing(kind, rng, R, T, K, E),
                        rng.random((R * T, K)).astype(np.float32), E,
                        atol=1e-5 if dtype is np.float32 else 2e-2)
            checks += 1
    rng = np.random.default_rng(R)
    T, H, K, E = 96, 2048, 8, 16 * R
    xq, xs = jax_ep.quantize_fp8(jnp.asarray(rng.standard_normal((R * T, H)), jnp.float32))
    idx = _routing("masked", rng, R, T, K, E)
    w = rng.random((R * T, K)).astype(np.float32)
    if "ht" in only:
        attempt("ht fp8", ht_check, mesh, (np.asarray(xq), np.asarray(xs)), idx, w, E)
        attempt("ht fp8 capacity", ht_check, mesh, (np.asarray(xq), np.asarray(xs)), idx, w, E,
                capacity=T // 2)
    checks += 2

    for kind in ("random", "skewed", "masked"):
        for T, M, use_fp8, round_scale, split in [(128, 128, True, False, False),
                                                  (1, 16, True, True, False),
                                                  (57, 64, False, False, False),
                                                  (100, 128, True, False, True),
                                                  (33, 40, False, False, True)]:
            rng = np.random.default_rng(seed(R, kind, T, M, use_fp8))
            H, K, E = 2048, 8, 8 * R
            x = np.asarray(jnp.asarray(rng.standard_normal((R * T, H)) * 3, jnp.bfloat16))
            if "ll" in only:
                attempt(f"ll {kind} T={T} M={M} fp8={use_fp8} split={split}", ll_check, mesh,
                        x, _routing(kind, rng, R, T, K, E),
                        rng.random((R * T, K)).astype(np.float32), E, M, use_fp8, round_scale,
                        split)
            checks += 1
    for kind in ("random", "masked"):
        if "fused" in only and jax_ep.runtime.extension().gemm_built():
            attempt(f"fused layer {kind}", fused_check, mesh, kind)
            checks += 1
    for kind in ("ht", "ll", "ll_split"):
        if "scan" in only or f"scan_{kind}" in only:
            attempt(f"scan of 200 back-to-back {kind}", scan_check, mesh, kind)
            checks += 1
    if failures:
        raise AssertionError(f"{len(failures)} of {checks} checks failed: {failures}")
    info = jax_ep.runtime_info()
    print(f"PASS rank {RANK}: {checks} checks in {time.time() - t0:.1f} s; arena used "
          f"{info.get('symmetric_arena_used')} of {info.get('symmetric_arena_bytes')} bytes",
          flush=True)


if __name__ == "__main__":
    try:
        main()
    except BaseException:  # noqa: BLE001 - report and leave at once (see the docstring)
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    # Success: a normal exit, so NVSHMEM's finalize and jax.distributed's shutdown run (teardown).
