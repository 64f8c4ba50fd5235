"""Debug: the compiled HLO of a rolled scan over split LL ops, and which variant hangs."""
import os, re, sys
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P
import jax_ep

R = 2
mesh = Mesh(np.array(jax.devices()[:R]), ("ep",))
E, M, T, H, K, steps = 8, 16, 16, 256, 4, int(os.environ.get("STEPS", "20"))
variant = sys.argv[1]


def step_fn(c, inp):
    x, i, ww = inp
    kw = dict(num_experts=E, max_tokens_per_rank=M, use_fp8=False, backend="cuda")
    if variant in ("both", "dispatch"):
        r = jax_ep.low_latency_dispatch_recv(jax_ep.low_latency_dispatch_send(x, i, **kw))
    else:
        r = jax_ep.low_latency_dispatch(x, i, **kw)
    if variant in ("both", "combine"):
        out = jax_ep.low_latency_combine_recv(
            jax_ep.low_latency_combine_send(r.recv_x, i, ww, r.handle, backend="cuda"))
    else:
        out = jax_ep.low_latency_combine(r.recv_x, i, ww, r.handle, backend="cuda")
    return c, (out, r.recv_count)


def body(xs, idx, w):
    return jax.lax.scan(step_fn, 0, (xs, idx, w))[1]


spec = P(None, "ep")
f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
rng = np.random.default_rng(0)
args = (jnp.asarray(rng.standard_normal((steps, R * T, H)), jnp.bfloat16),
        jnp.asarray(rng.integers(0, E, (steps, R * T, K)), jnp.int32),
        jnp.ones((steps, R * T, K), jnp.float32))
comp = f.lower(*args).compile()
txt = comp.as_text()
if variant == "both":
    for line in txt.splitlines():
        if "custom_call_target=\"jax_ep" in line or line.startswith(("%", "ENTRY", "}")) and \
                ("while" in line or "body" in line or "ENTRY" in line):
            print(line.strip()[:260])
out = comp(*args)
jax.block_until_ready(out)
print("variant", variant, "OK")
