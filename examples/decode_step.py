"""Decode steps of an MoE layer with the low-latency ops and their send / receive split.

Each step: router -> top-k -> low_latency_dispatch_send (FP8) -> the shared expert, computed
while the rows travel -> low_latency_dispatch_recv -> routed experts (grouped matmul over the
expert-major rows) -> low_latency_combine. Checked against the same step with the fused ops.
Runs on CPU (fake devices, reference backend) and on GPUs (CUDA kernels):

    python examples/decode_step.py               # CPU: 4 fake devices
    python examples/decode_step.py --steps 100   # on a GPU node: all local GPUs
"""
from __future__ import annotations

import argparse
import os
import time

_p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
_p.add_argument("--steps", type=int, default=8)
_p.add_argument("--tokens", type=int, default=32, help="decode tokens per device (batch)")
_p.add_argument("--hidden", type=int, default=256, help="a multiple of 128 (FP8 groups)")
_p.add_argument("--ffn", type=int, default=256)
_p.add_argument("--experts-per-device", type=int, default=4)
_p.add_argument("--topk", type=int, default=4)
_p.add_argument("--cpu-devices", type=int, default=4, help="fake CPU devices when no GPU")
args = _p.parse_args()
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={args.cpu_devices}")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

import jax_ep  # noqa: E402

mesh = Mesh(np.array(jax.devices()), ("ep",))
R, T, H, F, K = len(jax.devices()), args.tokens, args.hidden, args.ffn, args.topk
L = args.experts_per_device
E = R * L
key = jax.random.key(0)
k1, k2, k3, k4, k5 = jax.random.split(key, 5)
params = {  # scaled so activations stay O(1) whatever the sizes
    "router": jax.random.normal(k1, (H, E), jnp.float32) / H ** 0.5,
    "shared": (jax.random.normal(k2, (H, H)) / H ** 0.5).astype(jnp.bfloat16),
    "w_in": (jax.random.normal(k3, (E, H, F)) / H ** 0.5).astype(jnp.bfloat16),  # by expert
    "w_out": (jax.random.normal(k4, (E, F, H)) / F ** 0.5).astype(jnp.bfloat16),
}
MOE = dict(num_experts=E, max_tokens_per_rank=T)


def experts(rows, scales, w_in, w_out):
    """Routed experts on the expert-major rows [L, R*T, H] (dequantised FP8)."""
    x = jax_ep.dequantize_fp8(rows, scales).astype(jnp.bfloat16)
    h = jax.nn.gelu(jnp.einsum("lth,lhf->ltf", x, w_in))
    return jnp.einsum("ltf,lfh->lth", h, w_out).astype(jnp.bfloat16)


def rms_norm(x):
    x = x.astype(jnp.float32)
    return (x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)).astype(jnp.bfloat16)


def step(x, p, split):
    x = rms_norm(x)
    logits = x.astype(jnp.float32) @ p["router"]
    w, idx = jax.lax.top_k(jax.nn.softmax(logits), K)
    idx = idx.astype(jnp.int32)
    if split:
        pending = jax_ep.low_latency_dispatch_send(x, idx, **MOE)  # returns at once
        shared = x @ p["shared"]                                  # overlaps the transfer
        res = jax_ep.low_latency_dispatch_recv(pending)
    else:
        res = jax_ep.low_latency_dispatch(x, idx, **MOE)
        shared = x @ p["shared"]
    y = experts(*res.recv_x, p["w_in"], p["w_out"])
    routed = jax_ep.low_latency_combine(y, idx, w, res.handle)
    return (x + shared + routed).astype(jnp.bfloat16)


def decode(split):
    def per_shard(x, p):
        def body(x, _):
            return step(x, p, split), None
        return jax.lax.scan(body, x, None, length=args.steps)[0]

    specs = {"router": P(), "shared": P(), "w_in": P("ep"), "w_out": P("ep")}
    # checked: a peer that stops raises jax_ep.PeerTimeoutError instead of NaN tokens
    return jax_ep.checked(jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=(P("ep"), specs),
                                                out_specs=P("ep"))))


x0 = jax.random.normal(k5, (R * T, H), jnp.bfloat16)
outs = {}
for split in (True, False):
    f = decode(split)
    f(x0, params).block_until_ready()
    t0 = time.perf_counter()
    outs[split] = np.asarray(f(x0, params), np.float32)
    print(f"{'split' if split else 'fused'}: {args.steps} decode steps on {R} devices "
          f"({jax.default_backend()}), {(time.perf_counter() - t0) / args.steps * 1e6:.0f} us "
          f"per step")
assert np.isfinite(outs[True]).all() and np.isfinite(outs[False]).all(), "non-finite output"
np.testing.assert_allclose(outs[True], outs[False], rtol=2e-2, atol=2e-2)
print("split == fused: OK; mean |x| =", float(np.abs(outs[True]).mean()))
