"""GPU suite: call-site leases (csrc/runtime/lease.h, docs/design.md#call-site-leases).

Every communication call site of a compiled program owns its workspace slot and buffers while
the program lives, and gives them back when it is destroyed. Checked here:
- one program with 130 low-latency call sites (65 unrolled layers, a dispatch and a combine
  each, with varying M, K and H; every layer's dispatch send issued before any receive, so all
  65 are in flight at once) and two high-throughput call sites, exact against the reference;
- 100 programs compiled, run and dropped in one process: results against the reference each
  time, and the device memory after them bounded.
Marked `gpu`; R ranks are R GPUs, or R virtual ranks on one GPU.
"""
from __future__ import annotations

import gc

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jax_ep
from helpers import gpu_ranks as _ranks, poison_gpu_memory as _poison

pytestmark = pytest.mark.gpu

R = 4
E = 16  # 4 experts per rank
NUM_LAYERS = 65
# (T, M, K, H, use_fp8) of layer i: no two layers alike (JAX lowers alike call sites once, and
# such call sites share one lease, which the epochs make safe: they never run at once)
LAYERS = [(9 + (7 * i) % 24, 33 + i, 1 + i % 4, 128 * (1 + i % 8), i % 2 == 1)
          for i in range(NUM_LAYERS)]


def _routing(rng, T, K):
    """[R*T, K]: random distinct experts with about a third of the slots -1."""
    idx = np.stack([rng.permutation(E)[:K] for _ in range(R * T)]).astype(np.int32)
    idx[rng.random(idx.shape) < 0.3] = -1
    return jnp.asarray(idx)


def _expert_output(rx, recv_src):
    """Expert outputs that depend only on (source row, local expert, column), exact in bf16."""
    if isinstance(rx, tuple):
        rx = rx[0]
    src = recv_src[:, :, None]
    col = jnp.arange(rx.shape[-1])[None, None, :]
    lid = jnp.arange(rx.shape[0])[:, None, None]
    return (((src * 31 + lid * 7 + col) % 13 - 6) / 4).astype(jnp.bfloat16)


def _layers_body(backend):
    def body(*args):
        xs, idxs, ws = args[:NUM_LAYERS], args[NUM_LAYERS:2 * NUM_LAYERS], args[2 * NUM_LAYERS:-2]
        hx, hidx = args[-2:]
        outs = []
        if backend == "cuda":  # every dispatch send first: 65 sends in flight at once
            pend = [jax_ep.low_latency_dispatch_send(
                xs[i], idxs[i], num_experts=E, max_tokens_per_rank=LAYERS[i][1],
                use_fp8=LAYERS[i][4], backend="cuda") for i in range(NUM_LAYERS)]
            res = [jax_ep.low_latency_dispatch_recv(p) for p in pend]
        else:
            res = [jax_ep.low_latency_dispatch(
                xs[i], idxs[i], num_experts=E, max_tokens_per_rank=LAYERS[i][1],
                use_fp8=LAYERS[i][4], backend="reference") for i in range(NUM_LAYERS)]
        for i, r in enumerate(res):
            y = _expert_output(r.recv_x, r.handle.recv_src)
            outs.append((r.recv_count, jax_ep.low_latency_combine(
                y, idxs[i], ws[i], r.handle, backend=backend)))
        d = jax_ep.dispatch(hx, hidx, num_experts=E, backend=backend)
        outs.append((d.handle.recv_src, jax_ep.combine(d.recv_x, d.handle, backend=backend)))
        return outs
    return body


def test_130_low_latency_call_sites_and_two_high_throughput_in_one_program():
    ext = jax_ep.runtime.extension()
    rng = np.random.default_rng(5)
    xs, idxs, ws = [], [], []
    for i in range(NUM_LAYERS):
        T, M, K, H, fp8 = LAYERS[i]
        xs.append(jnp.asarray(rng.standard_normal((R * T, H)), jnp.bfloat16))
        idxs.append(_routing(rng, T, K))
        ws.append(jnp.asarray(rng.random((R * T, K)), jnp.float32))
    hx = jnp.asarray(rng.standard_normal((R * 40, 256)), jnp.bfloat16)
    hidx = _routing(rng, 40, 4)
    args = xs + idxs + ws + [hx, hidx]
    before = ext.lease_stats()
    cuda = _ranks(_layers_body("cuda"), R)
    _poison()
    got = jax.device_get(cuda(*args))
    during = ext.lease_stats()
    # 130 low-latency call sites (the halves of a split dispatch share one) and the
    # high-throughput dispatch, gather and combine: each its own lease and slot
    assert before["free_push_slots"] - during["free_push_slots"] >= 2 * NUM_LAYERS, (before, during)
    assert before["free_pull_slots"] - during["free_pull_slots"] >= 2, (before, during)
    want = jax.device_get(_ranks(_layers_body("reference"), R)(*args))
    for i in range(NUM_LAYERS + 1):
        what = f"layer {i}" if i < NUM_LAYERS else "high-throughput"
        if i < NUM_LAYERS:
            np.testing.assert_array_equal(got[i][0], want[i][0], err_msg=f"{what}: recv_count")
        else:
            np.testing.assert_array_equal(got[i][0], want[i][0], err_msg=f"{what}: recv_src")
        np.testing.assert_allclose(np.asarray(got[i][1], np.float32),
                                   np.asarray(want[i][1], np.float32), rtol=2e-2, atol=2e-2,
                                   err_msg=f"{what}: combine")


def _small_program(M, H):
    def body(x, idx, w):
        r = jax_ep.low_latency_dispatch(x, idx, num_experts=E, max_tokens_per_rank=M,
                                        use_fp8=False, backend="cuda")
        y = _expert_output(r.recv_x, r.handle.recv_src)
        return r.recv_count, jax_ep.low_latency_combine(y, idx, w, r.handle, backend="cuda")
    return body


def _reference(x, idx, w, M):
    def body(x, idx, w):
        r = jax_ep.low_latency_dispatch(x, idx, num_experts=E, max_tokens_per_rank=M,
                                        use_fp8=False, backend="reference")
        y = _expert_output(r.recv_x, r.handle.recv_src)
        return r.recv_count, jax_ep.low_latency_combine(y, idx, w, r.handle,
                                                        backend="reference")
    return jax.device_get(_ranks(body, R)(x, idx, w))


def test_dropped_programs_give_their_slots_and_memory_back():
    """100 programs, each with its own receive-buffer size (M = 64 + 8 p rows, H = 2048: about
    4 MiB per rank and call site), compiled, run, checked and dropped. Afterwards the leases,
    slots and buffer bytes are back where they started and the device memory in use has grown
    by less than 64 MiB (the 100 programs' buffers come to about 1.9 GiB)."""
    ext = jax_ep.runtime.extension()
    dev = jax_ep.runtime.current_cuda_device()
    rng = np.random.default_rng(9)
    T, K, H = 20, 4, 2048
    x = jnp.asarray(rng.standard_normal((R * T, H)), jnp.bfloat16)
    idx = _routing(rng, T, K)
    w = jnp.asarray(rng.random((R * T, K)), jnp.float32)
    # The reference results first: only jax_ep's programs run between the two readings of the
    # device memory (over several GPUs the reference's collectives are NCCL's, whose memory is
    # JAX's to keep after their programs are dropped).
    checked = {p: _reference(x, idx, w, 64 + 8 * p) for p in range(0, 100, 10)}
    jax.clear_caches()
    # warm up: the runtime's workspaces and JAX's own state exist before the baseline
    jax.device_get(_ranks(_small_program(32, H), R)(x, idx, w))
    jax.clear_caches()
    gc.collect()
    ext.flush_buffer_frees()
    base_stats = ext.lease_stats()
    base_used = ext.device_memory_used(dev)
    created = base_stats["created"]
    peak_bytes = 0
    for p in range(100):
        M = 64 + 8 * p
        f = _ranks(_small_program(M, H), R)
        got = jax.device_get(f(x, idx, w))
        peak_bytes = max(peak_bytes, ext.lease_buffer_bytes(dev))
        if p in checked:  # the reference now and then (its compilations cost more than ours)
            want = checked[p]
            np.testing.assert_array_equal(got[0], want[0], err_msg=f"program {p}: recv_count")
            np.testing.assert_allclose(np.asarray(got[1], np.float32),
                                       np.asarray(want[1], np.float32), rtol=2e-2, atol=2e-2,
                                       err_msg=f"program {p}: combine")
        del f, got
        jax.clear_caches()
        gc.collect()
    ext.flush_buffer_frees()
    stats = ext.lease_stats()
    used = ext.device_memory_used(dev)
    grown = used - base_used
    print(f"\n100 dropped programs: {stats['created'] - created} leases made, "
          f"live {base_stats['live']} -> {stats['live']}, buffer bytes "
          f"{base_stats['buffer_bytes']} -> {stats['buffer_bytes']} (peak {peak_bytes}), "
          f"device memory in use grew by {grown / 2**20:.1f} MiB")
    assert stats["created"] - created >= 200, stats  # two call sites a program, each compiled
    assert stats["live"] == base_stats["live"], (base_stats, stats)
    assert stats["free_push_slots"] == base_stats["free_push_slots"], (base_stats, stats)
    assert stats["buffer_bytes"] == base_stats["buffer_bytes"], (base_stats, stats)
    assert grown < 64 << 20, f"device memory in use grew by {grown} bytes"
