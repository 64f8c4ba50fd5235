"""The memory XLA plans for moe_ffn's step (forward + backward, gradients reduced as made, as
benchmarks/bench_layer.py's "step") and for its expert compute, compiled for R H200s without a
GPU (deviceless): a CUDA topology from XLA's H200 target config, jax_ep's CUDA lowering with no
device runtime behind it (nothing runs). Needs jax[cuda13] (0.10.2 here) and the target config
(xla/backends/gpu/target_config/specs/h200.txtpb of XLA; for jax 0.10.2 without its
collective_memory_granularity line, which that version's proto lacks):

  JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 python docs/results/2026-11-29-deviceless-step-plan.py \
      REPO SPEC R
XLA does not autotune without a device, so the plans may differ slightly from a GPU's."""
import os
import sys

import jax
import jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_ep
from jax_ep import runtime

sys.path.insert(0, os.path.join(sys.argv[1], "benchmarks"))
from bench_layer import expert_compute, step_bytes, with_backward  # noqa: E402
from harness import scan_fn  # noqa: E402

runtime.cuda_backend_available = lambda: True       # the targets are CUDA's
runtime.ensure_peer_runtime = lambda *a, **k: None  # no device to map peers on
R = int(sys.argv[3])
T, H, I, L, K = 4096, 7168, 2048, 32, 8
E = R * L
topo = topologies.get_topology_desc(platform="cuda", topology_name="",
                                    target_config=open(sys.argv[2]).read(),
                                    topology=f"1x1x{R}")
mesh = Mesh(topo.devices[:R], ("ep",))


def S(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P("ep")))


x, idx, w = S((R * T, H), jnp.bfloat16), S((R * T, K), jnp.int32), S((R * T, K), jnp.float32)
wgu, wd = S((E, H, 2 * I), jnp.bfloat16), S((E, I, H), jnp.bfloat16)
layer = scan_fn(mesh, with_backward(
    lambda *a: jax_ep.moe_ffn(*a, num_experts=E, backend="cuda"), (0, 2, 3, 4)), 1)
floor = scan_fn(mesh, with_backward(
    lambda *a: expert_compute(*a, backend="cuda"), (0, 2, 3)), 1)
got = step_bytes(layer.lower(x, idx, w, wgu, wd).compile())[0]
want = step_bytes(floor.lower(S((R * T * K, H), jnp.bfloat16), w, wgu, wd).compile())[0]
print(f"R={R} moe_ffn step {got} bytes, expert compute {want}, ratio {got / want:.4f}")
