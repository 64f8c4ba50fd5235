"""A small Flax NNX transformer block with jax_ep's MoE layer, trained a few steps.

LayerNorm -> causal self-attention -> residual -> LayerNorm -> jax_ep.flax.MoE -> residual, fit
to a fixed random teacher with optax's Adam and the router's load-balance loss. The MoE layer
runs its own shard_map: the tokens are split over every device of a (dp, ep) mesh, the experts
over ep. Runs unchanged on CPU (fake devices, reference backend) and on GPUs (CUDA kernels):

    pip install ".[flax]" && python examples/flax_moe_block.py
"""
from __future__ import annotations

import argparse
import os
import sys
import time

_p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
_p.add_argument("--steps", type=int, default=40)
_p.add_argument("--batch", type=int, default=8, help="sequences (a multiple of the devices)")
_p.add_argument("--seq", type=int, default=16)
_p.add_argument("--hidden", type=int, default=64)
_p.add_argument("--ffn", type=int, default=64, help="intermediate size of each expert")
_p.add_argument("--experts-per-device", type=int, default=2)
_p.add_argument("--topk", type=int, default=2)
_p.add_argument("--cpu-devices", type=int, default=4, help="fake CPU devices when no GPU")
args = _p.parse_args()
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={args.cpu_devices}")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import jax_ep  # noqa: E402
from jax_ep.flax import MoE  # noqa: E402

devices = jax.devices()
n = len(devices)
dp = 2 if n % 2 == 0 and n >= 4 else 1
mesh = Mesh(np.array(devices).reshape(dp, n // dp), ("dp", "ep"))
E = mesh.shape["ep"] * args.experts_per_device
H = args.hidden
on_gpu = devices[0].platform == "gpu"
AUX = 1e-2   # weight of the load-balance loss


class Block(nnx.Module):
    def __init__(self, rngs):
        self.ln1 = nnx.LayerNorm(H, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=4, in_features=H, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(H, rngs=rngs)
        self.moe = MoE(H, args.ffn, E, args.topk, mesh=mesh, axis_name="ep",
                       dtype=jnp.bfloat16 if on_gpu else jnp.float32, rngs=rngs)

    def __call__(self, x):                                    # x [B, S, H]
        mask = nnx.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.moe(self.ln2(x)).astype(x.dtype)


def main():
    model = Block(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)
    kx, kt = jax.random.split(jax.random.PRNGKey(1))
    x = jax.random.normal(kx, (args.batch, args.seq, H))
    teacher = jax.random.normal(kt, (H, H)) / np.sqrt(H)
    target = x + jnp.tanh(jnp.cumsum(x, axis=1) / np.sqrt(args.seq) @ teacher)

    @nnx.jit
    def step(model, opt, x, target):
        def loss_fn(model):
            y, inter = nnx.capture(model, nnx.Intermediate)(x)
            mse = jnp.mean((y - target) ** 2)
            return mse + AUX * inter["moe"]["load_balance_loss"][0], mse
        (_, mse), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        opt.update(model, grads)
        return mse

    # If a peer stops, the step raises jax_ep.PeerTimeoutError instead of returning the NaN
    # results of the op whose wait gave up.
    step = jax_ep.checked(step)

    print(f"jax_ep Flax MoE block: {n} devices ({devices[0].platform}), mesh "
          f"{dict(mesh.shape)}, {E} experts, top-{args.topk}, {args.batch}x{args.seq} tokens, "
          f"hidden {H}; backend {jax_ep.runtime_info()['default_backend']}")
    losses, times = [], []
    for i in range(args.steps):
        t0 = time.perf_counter()
        losses.append(float(step(model, opt, x, target)))
        times.append(time.perf_counter() - t0)
        if i % max(1, args.steps // 8) == 0 or i == args.steps - 1:
            print(f"step {i:4d}  mse {losses[-1]:.5f}  {times[-1] * 1e3:8.2f} ms")
    load = np.asarray(model.moe.expert_load[...])
    print(f"tokens per expert over all steps: {load.tolist()} (total {load.sum()} = steps x "
          f"tokens x top-k = {args.steps * args.batch * args.seq * args.topk})")
    print(f"mse {losses[0]:.5f} -> {losses[-1]:.5f}; median step time "
          f"{np.median(times[1:]) * 1e3:.2f} ms")
    if not losses[-1] < losses[0]:
        print("ERROR: loss did not go down")
        sys.exit(1)


if __name__ == "__main__":
    main()
