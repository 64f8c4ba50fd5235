"""A complete MoE layer trained with jax_ep inside shard_map.

Router (jax_ep.routing.softmax_topk) -> jax_ep.moe_ffn (dispatch, grouped GEMMs of the local
experts with a silu-gated activation, combine) under jax.checkpoint with jax_ep.remat_policy,
plus the auxiliary load-balance loss, in a training step with an optax optimizer. Runs
unchanged on CPU (fake devices) and on GPUs:

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
_p.add_argument("--ffn", type=int, default=128, help="intermediate size I of each expert")
_p.add_argument("--experts-per-device", type=int, default=2)
_p.add_argument("--topk", type=int, default=2)
_p.add_argument("--cpu-devices", type=int, default=4, help="fake CPU devices when no GPU")
_p.add_argument("--backend", default="auto", choices=["auto", "reference", "cuda"])
_p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                help="compute dtype (auto: bfloat16 on GPUs, where the grouped GEMMs run, "
                     "float32 on CPUs)")
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
if args.dtype == "auto":
    DTYPE = jnp.dtype(jnp.bfloat16 if devices[0].platform == "gpu" else jnp.float32)
else:
    DTYPE = jnp.dtype(args.dtype)
AUX = 1e-2   # weight of the load-balance loss


def init_params(key):
    k1, k2, k3, k4 = jax.random.split(key, 4)
    return {   # float32 master weights; the layer computes in DTYPE
        "router": jax.random.normal(k1, (H, E)) / np.sqrt(H),
        # expert weights: global [E, ...], sharded over ep (each rank holds its L experts)
        "w_gate_up": jax.random.normal(k2, (E, H, 2 * F)) / np.sqrt(H),
        "w_down": jax.random.normal(k3, (E, F, H)) / np.sqrt(F),
        "proj": jax.random.normal(k4, (H, H)) / np.sqrt(H),
    }


def moe_layer(params, x):
    """Per shard: x [T, H] tokens of this rank; params['w_gate_up'] [L, H, 2F] local experts.
    Returns the layer's output and the load-balance loss."""
    logits = x @ params["router"]
    weights, topk_idx = jax_ep.routing.softmax_topk(logits, K)
    aux = jax_ep.routing.load_balance_loss(logits, topk_idx, axis_name="ep")
    out = jax_ep.moe_ffn(x.astype(DTYPE), topk_idx, weights, params["w_gate_up"].astype(DTYPE),
                         params["w_down"].astype(DTYPE), num_experts=E, axis_name="ep",
                         backend=args.backend)
    return out.astype(jnp.float32) @ params["proj"], aux


def loss_fn(params, x, target):
    def shard(params, x, target):
        # Recompute the experts in the backward pass, never the communication.
        y, aux = jax.checkpoint(moe_layer, policy=jax_ep.remat_policy)(params, x)
        return jax.lax.pmean(jnp.mean((y - target) ** 2), "ep") + AUX * aux

    specs = {"router": P(), "w_gate_up": P("ep"), "w_down": P("ep"), "proj": P()}
    return jax.shard_map(shard, mesh=mesh, in_specs=(specs, P("ep"), P("ep")),
                         out_specs=P())(params, x, target)


opt = optax.adam(3e-3)


def _train_step(params, opt_state, x, target):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, target)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


# jax_ep.checked: if a peer stops, the step raises jax_ep.PeerTimeoutError instead of returning
# the NaN results of the op whose wait gave up (and check=True failures raise CheckError).
train_step = jax_ep.checked(jax.jit(_train_step))


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
          f"top-{K}, {T} tokens/device, hidden {H}, ffn {F}, {DTYPE.name}; backend "
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
