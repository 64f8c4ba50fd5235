"""A complete MoE layer trained with jax_ep inside shard_map.

Router -> top-k -> jax_ep.dispatch -> per-expert MLP (grouped matmul over the received rows)
-> jax_ep.combine, in a training step with gradients and an optax optimizer. Runs unchanged on
CPU (fake devices) and on GPUs:

    python examples/moe_layer.py                 # CPU: 4 fake devices, reference backend
    python examples/moe_layer.py --steps 50      # on a GPU node: all local GPUs, CUDA kernels
"""
from __future__ import annotations

import argparse
import os
import sys
import time

_p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
_p.add_argument("--steps", type=int, default=30)
_p.add_argument("--tokens", type=int, default=64, help="tokens per device")
_p.add_argument("--hidden", type=int, default=64)
_p.add_argument("--ffn", type=int, default=128)
_p.add_argument("--experts-per-device", type=int, default=2)
_p.add_argument("--topk", type=int, default=2)
_p.add_argument("--cpu-devices", type=int, default=4, help="fake CPU devices when no GPU")
_p.add_argument("--backend", default="auto", choices=["auto", "reference", "cuda"])
args = _p.parse_args()
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={args.cpu_devices}")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jax_ep  # noqa: E402

devices = jax.devices()
R = len(devices)
mesh = Mesh(np.array(devices), ("ep",))
E = R * args.experts_per_device
L = args.experts_per_device
T, H, F, K = args.tokens, args.hidden, args.ffn, args.topk


def init_params(key):
    k1, k2, k3, k4 = jax.random.split(key, 4)
    return {
        "router": jax.random.normal(k1, (H, E)) / np.sqrt(H),
        # expert weights: global [E, ...], sharded over ep (each rank holds its L experts)
        "w_in": jax.random.normal(k2, (E, H, F)) / np.sqrt(H),
        "w_out": jax.random.normal(k3, (E, F, H)) / np.sqrt(F),
        "proj": jax.random.normal(k4, (H, H)) / np.sqrt(H),
    }


def moe_layer(params, x):
    """Per shard: x [T, H] tokens of this rank; params['w_in'] [L, H, F] local experts."""
    logits = x @ params["router"]
    weights, topk_idx = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), K)
    res = jax_ep.dispatch(x, topk_idx.astype(jnp.int32), weights.astype(jnp.float32),
                          num_experts=E, axis_name="ep", backend=args.backend)
    # Expand each received row into one row per (row, local expert slot), sort by expert and
    # run a grouped matmul (ragged_dot) over the L local experts.
    C = res.recv_x.shape[0]
    slot_expert = res.recv_topk_idx.reshape(-1)                        # [C*K], -1 = not here
    order = jnp.argsort(jnp.where(slot_expert < 0, L, slot_expert), stable=True)
    rows = jnp.repeat(res.recv_x, K, axis=0)[order]                    # [C*K, H]
    group_sizes = jnp.sum(slot_expert[:, None] == jnp.arange(L)[None, :], axis=0)
    h = jax.nn.gelu(jax.lax.ragged_dot(rows, params["w_in"], group_sizes.astype(jnp.int32)))
    y = jax.lax.ragged_dot(h, params["w_out"], group_sizes.astype(jnp.int32))
    w_sorted = res.recv_topk_weights.reshape(-1)[order]                 # 0 for unused slots
    y = y * w_sorted[:, None]
    y_rows = jnp.zeros((C * K, H), y.dtype).at[order].set(y).reshape(C, K, H).sum(axis=1)
    out = jax_ep.combine(y_rows.astype(x.dtype), res.handle, axis_name="ep",
                         backend=args.backend)
    return out @ params["proj"]


def loss_fn(params, x, target):
    def shard(params, x, target):
        y = moe_layer(params, x)
        return jax.lax.pmean(jnp.mean((y - target) ** 2), "ep")

    specs = {"router": P(), "w_in": P("ep"), "w_out": P("ep"), "proj": P()}
    return jax.shard_map(shard, mesh=mesh, in_specs=(specs, P("ep"), P("ep")),
                         out_specs=P())(params, x, target)


opt = optax.adam(3e-3)


@jax.jit
def train_step(params, opt_state, x, target):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, target)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def main():
    key = jax.random.PRNGKey(0)
    params = init_params(key)
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
    params = {k: put(v, P("ep") if k.startswith("w_") else P()) for k, v in params.items()}
    opt_state = opt.init(params)
    kx, kt = jax.random.split(jax.random.PRNGKey(1))
    x = put(jax.random.normal(kx, (R * T, H)), P("ep"))
    target = put(jnp.tanh(x @ jax.random.normal(kt, (H, H)) / np.sqrt(H)), P("ep"))
    print(f"jax_ep MoE layer: {R} devices ({devices[0].platform}), {E} experts ({L} per device), "
          f"top-{K}, {T} tokens/device, hidden {H}, ffn {F}; backend "
          f"{jax_ep.runtime_info()['default_backend'] if args.backend == 'auto' else args.backend}")
    losses, times = [], []
    for step in range(args.steps):
        t0 = time.perf_counter()
        params, opt_state, loss = train_step(params, opt_state, x, target)
        loss = float(loss)
        times.append(time.perf_counter() - t0)
        losses.append(loss)
        if step % max(1, args.steps // 10) == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss:.5f}  {times[-1] * 1e3:8.2f} ms")
    steady = np.median(times[1:]) * 1e3 if len(times) > 1 else times[0] * 1e3
    print(f"loss {losses[0]:.5f} -> {losses[-1]:.5f}; median step time {steady:.2f} ms "
          f"(first step, with compilation, {times[0] * 1e3:.0f} ms)")
    if not losses[-1] < losses[0]:
        print("ERROR: loss did not go down")
        sys.exit(1)


if __name__ == "__main__":
    main()
