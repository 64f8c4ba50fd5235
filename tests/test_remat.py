"""jax.checkpoint with jax_ep.remat_policy: the backward pass recomputes the expert math from the
saved outputs of the communication ops and never replays a dispatch or combine."""
from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ep

R, T, H, K, E = 4, 8, 128, 2, 8
COMM = ("all_to_all", "jax_ep_call")  # the reference's collectives; the CUDA custom call


def _ht_layer(x, idx, w, wl):
    r = jax_ep.dispatch(x, idx, w, num_experts=E)
    onehot = jax.nn.one_hot(r.recv_topk_idx, wl.shape[0])
    coef = jnp.einsum("ck,ckl->cl", r.recv_topk_weights, onehot)
    y = jnp.einsum("cl,ch,lhf->cf", coef, jnp.tanh(r.recv_x), wl)
    return jax_ep.combine(y, r.handle)


def _ll_layer(x, idx, w, wl):
    r = jax_ep.low_latency_dispatch(x.astype(jnp.bfloat16), idx, num_experts=E,
                                    max_tokens_per_rank=T, use_fp8=False)
    y = jnp.einsum("lch,lhf->lcf", jnp.tanh(r.recv_x.astype(jnp.float32)), wl)
    return jax_ep.low_latency_combine(y.astype(jnp.bfloat16), idx, w, r.handle).astype(
        jnp.float32)


def _moe_layer(x, idx, w, wl):
    """moe_ffn at its default capacity (extra passes possible: the while loop and custom VJP)."""
    wgu = jnp.concatenate([wl, wl], axis=2)
    return jax_ep.moe_ffn(x, idx, w, wgu, wl, num_experts=E)


def _grad(mesh, layer, remat):
    def loss(x, w, wl, idx):
        f = layer if remat is False else jax.checkpoint(layer, policy=remat)
        out = jax.shard_map(f, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))(x, idx, w, wl)
        return jnp.sum(out ** 2)
    return jax.grad(loss, argnums=(0, 1, 2))


def _count(jaxpr, names):
    text = str(jaxpr)
    return sum(text.count(n) for n in names)


@pytest.mark.parametrize("layer", [_ht_layer, _ll_layer, _moe_layer],
                         ids=["high_throughput", "low_latency", "moe_ffn"])
def test_policy_saves_the_communication(mesh4, layer):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((R * T, H)), jnp.float32)
    idx = jnp.asarray(rng.integers(-1, E, (R * T, K)), jnp.int32)
    w = jnp.asarray(rng.random((R * T, K)), jnp.float32)
    wl = jnp.asarray(rng.standard_normal((R * (E // R), H, H)) / np.sqrt(H), jnp.float32)
    args = (x, w, wl, idx)
    jaxprs = {name: jax.make_jaxpr(_grad(mesh4, layer, remat))(*args)
              for name, remat in (("plain", False), ("checkpoint", None),
                                  ("policy", jax_ep.remat_policy))}
    comm = {k: _count(v, COMM) for k, v in jaxprs.items()}
    dots = {k: _count(v, ("dot_general",)) for k, v in jaxprs.items()}
    # checkpoint alone replays the communication; the policy does not
    assert comm["checkpoint"] > comm["plain"], comm
    assert comm["policy"] == comm["plain"], comm
    # ... and still recomputes the expert math
    assert dots["policy"] > dots["plain"], dots
    grads = {k: jax.jit(_grad(mesh4, layer, r))(*args)
             for k, r in (("plain", False), ("policy", jax_ep.remat_policy))}
    for a, b in zip(grads["plain"], grads["policy"]):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=1e-5, atol=1e-5)
