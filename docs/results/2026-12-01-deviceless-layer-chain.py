"""Compile moe_ffn's R = 1 forward (standard shapes) for an H200 without a GPU and list the
ENTRY-level launches of the compiled HLO (fusions, custom calls, sorts, copies). Needs
jax[cuda13] and XLA's H200 target config (xla/backends/gpu/target_config/specs/h200.txtpb, for
jax 0.10.2 without its rate tables and collective_memory_granularity):

  JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 python docs/results/2026-12-01-deviceless-layer-chain.py \\
      OUT.hlo SPEC"""
import collections
import re
import sys

import jax
import jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_ep
from jax_ep import runtime

FREE = ("parameter", "constant", "tuple", "get-tuple-element", "bitcast", "opt-barrier")
runtime.cuda_backend_available = lambda: True
runtime.ensure_peer_runtime = lambda *a, **k: None
_real = runtime.extension()


class _Ext:
    """The extension, with the positions kernels' sizes where its build predates them."""
    max_position_experts = 1024
    position_slice_pairs = 2048

    def __getattr__(self, n):
        return getattr(_real, n)


if not hasattr(_real, "position_slice_pairs"):
    _e = _Ext()
    runtime.extension = lambda: _e
topo = topologies.get_topology_desc(platform="cuda", topology_name="",
                                    target_config=open(sys.argv[2]).read(), topology="1x1x1")
mesh = Mesh(topo.devices[:1], ("ep",))
T, H, I, L, K = 4096, 7168, 2048, 32, 8


def S(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P("ep")))


def layer(x, idx, w, wgu, wd):
    return jax_ep.moe_ffn(x, idx, w, wgu, wd, num_experts=L, backend="cuda")


f = jax.jit(jax.shard_map(layer, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
hlo = f.lower(S((T, H), jnp.bfloat16), S((T, K), jnp.int32), S((T, K), jnp.float32),
              S((L, H, 2 * I), jnp.bfloat16), S((L, I, H), jnp.bfloat16)).compile().as_text()
with open(sys.argv[1], "w") as out:
    out.write(hlo)
body = hlo[hlo.index("\nENTRY"):]
body = body[body.index("{\n") + 2:body.index("\n}")]
ops = collections.Counter()
for line in body.splitlines():
    m = re.match(r"\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*.*?\s([a-z][\w\-]*)\(", line)
    if not m or m.group(2) in FREE:
        continue
    tgt = re.search(r'custom_call_target="([^"]+)"', line)
    ops[m.group(2) + (":" + tgt.group(1) if tgt else "")] += 1
print(sum(ops.values()), "launch-level instructions in ENTRY")
for k, v in sorted(ops.items(), key=lambda kv: -kv[1]):
    print(f"  {v:3d} {k}")
