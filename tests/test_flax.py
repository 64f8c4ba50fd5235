"""jax_ep.flax.MoE (Flax NNX) against a dense MoE written here with the module's own
parameters: forward, gradients, both routers, the expert-load statistics, the sown
load-balance loss, and argument errors. Flax comes with the [flax] and [examples] extras."""
from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

nnx = pytest.importorskip("flax.nnx")

import jax_ep  # noqa: E402
from jax_ep.flax import MoE  # noqa: E402

H, I, K = 32, 24, 2


def _dense(x, idx, w, wgu, wd):
    """Every token through each of its top-k experts: x [N, H] -> [N, H] float32."""
    out = jnp.zeros(x.shape, jnp.float32)
    for k in range(idx.shape[1]):
        e = jnp.maximum(idx[:, k], 0)
        h = jnp.einsum("nh,nhf->nf", x, wgu[e])
        y = jnp.einsum("nf,nfh->nh", jax.nn.silu(h[:, :I]) * h[:, I:], wd[e])
        out = out + jnp.where(idx[:, k:k + 1] >= 0, w[:, k:k + 1] * y, 0.0)
    return out


def _dense_layer(x, router, wgu, wd, bias=None, router_kind="softmax"):
    xt = x.reshape(-1, H)
    logits = xt @ router
    if router_kind == "softmax":
        w, idx = jax_ep.routing.softmax_topk(logits, K)
    else:
        w, idx = jax_ep.routing.grouped_topk(logits, K, n_groups=4, topk_groups=2, bias=bias,
                                             scaling_factor=2.5)
    return _dense(xt, idx, w, wgu, wd).reshape(x.shape), idx, logits


def _module(mesh, E, **kw):
    return MoE(H, I, E, K, mesh=mesh, dtype=jnp.float32, backend="reference",
               rngs=nnx.Rngs(0), **kw)


@pytest.mark.parametrize("mesh_name", ["ep4", "dp_ep"])
def test_forward_load_and_aux_loss_match_dense(meshes, mesh_name):
    mesh = meshes[mesh_name]
    E = 2 * mesh.shape["ep"]
    m = _module(mesh, E)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 16, H)), jnp.float32)
    call = nnx.jit(nnx.capture(lambda m, x: m(x), nnx.Intermediate))
    y, inter = call(m, x)
    want, idx, logits = _dense_layer(x, m.router[...], m.w_gate_up[...], m.w_down[...])
    assert y.shape == x.shape
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=2e-5, atol=2e-5)
    counts = np.bincount(np.asarray(idx).reshape(-1), minlength=E)
    np.testing.assert_array_equal(np.asarray(m.expert_load[...]), counts)
    aux = inter["load_balance_loss"][0]
    np.testing.assert_allclose(float(aux), float(jax_ep.routing.load_balance_loss(logits, idx)),
                               rtol=1e-6)
    call(m, x)     # the statistics accumulate over calls
    np.testing.assert_array_equal(np.asarray(m.expert_load[...]), 2 * counts)


def test_gradients_match_dense(mesh_dp_ep):
    E = 4
    m = _module(mesh_dp_ep, E)
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((32, H)), jnp.float32)
    proj = jnp.asarray(rng.standard_normal((32, H)), jnp.float32)

    @nnx.jit
    def grads(m, x):
        def loss(m, x):   # the sown load-balance loss is part of it, as in training
            y, inter = nnx.capture(m, nnx.Intermediate)(x)
            return jnp.sum(y * proj) + 0.1 * inter["load_balance_loss"][0]
        return nnx.grad(loss, argnums=(0, 1))(m, x)
    gm, gx = grads(m, x)
    params = (m.router[...], m.w_gate_up[...], m.w_down[...])

    def dense_loss(x, r, a, b):
        y, idx, logits = _dense_layer(x, r, a, b)
        return jnp.sum(y * proj) + 0.1 * jax_ep.routing.load_balance_loss(logits, idx)
    want = jax.grad(dense_loss, argnums=(0, 1, 2, 3))(x, *params)
    got = (gx, gm["router"][...], gm["w_gate_up"][...], gm["w_down"][...])
    for name, a, b in zip(("x", "router", "w_gate_up", "w_down"), got, want):
        a, b = np.asarray(a), np.asarray(b)
        assert np.linalg.norm(a - b) <= 1e-4 * max(np.linalg.norm(b), 1e-30), name
    assert "expert_load" not in gm and "router_bias" not in gm     # not trained


def test_deepseek_router_with_bias(mesh4):
    E = 8
    m = _module(mesh4, E, router="deepseek", n_groups=4, topk_groups=2, scaling_factor=2.5)
    bias = jnp.asarray(np.linspace(-0.5, 0.5, E), jnp.float32)
    m.router_bias[...] = bias
    x = jnp.asarray(np.random.default_rng(2).standard_normal((16, H)), jnp.float32)
    y = nnx.jit(lambda m, x: m(x))(m, x)
    want, idx, _ = _dense_layer(x, m.router[...], m.w_gate_up[...], m.w_down[...], bias,
                                "deepseek")
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(np.asarray(m.expert_load[...]),
                                  np.bincount(np.asarray(idx).reshape(-1), minlength=E))


# Hugging Face MoE blocks, their config fields as the models name them (scaled down).
HF_BLOCKS = {
    "mixtral": dict(router="softmax", num_experts=8, num_experts_per_tok=2,
                    norm_topk_prob=True),
    "qwen_moe": dict(router="softmax", num_experts=16, num_experts_per_tok=4,
                     norm_topk_prob=False),
    "deepseek_v3": dict(router="deepseek", num_experts=16, num_experts_per_tok=4,
                        norm_topk_prob=True, n_group=4, topk_group=2,
                        routed_scaling_factor=2.5),
    "deepseek_v3_unnormalized": dict(router="deepseek", num_experts=16, num_experts_per_tok=4,
                                     norm_topk_prob=False, n_group=4, topk_group=2,
                                     routed_scaling_factor=2.5),
}


def _hf_block(cfg, x, gate_weight, bias, gate_up_proj, down_proj):
    """A Hugging Face MoE block in NumPy float64, as those models compute it: router weight
    [E, H], gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]."""
    x = x.astype(np.float64)
    logits = x @ gate_weight.T
    K = cfg["num_experts_per_tok"]
    if cfg["router"] == "softmax":
        p = np.exp(logits - logits.max(-1, keepdims=True))
        scores = p / p.sum(-1, keepdims=True)
        choice = scores
    else:     # sigmoid scores, group-limited choice steered by e_score_correction_bias
        scores = 1 / (1 + np.exp(-logits))
        sel = scores + bias
        E, G = sel.shape[1], cfg["n_group"]
        group = np.sort(sel.reshape(-1, G, E // G), -1)[..., -2:].sum(-1)
        keep = np.argsort(-group, -1)[:, :cfg["topk_group"]]
        mask = np.zeros_like(group, bool)
        np.put_along_axis(mask, keep, True, -1)
        choice = np.where(np.repeat(mask, E // G, -1), sel, 0.0)
    idx = np.argsort(-choice, -1)[:, :K]
    w = np.take_along_axis(scores, idx, -1)
    if cfg["norm_topk_prob"]:
        w = w / (w.sum(-1, keepdims=True) + (1e-20 if cfg["router"] == "deepseek" else 0))
    w = w * cfg.get("routed_scaling_factor", 1.0)
    out = np.zeros_like(x)
    for n in range(x.shape[0]):
        for k in range(K):
            e = idx[n, k]
            gate, up = np.split(gate_up_proj[e] @ x[n], 2)
            out[n] += w[n, k] * (down_proj[e] @ (gate / (1 + np.exp(-gate)) * up))
    return out


@pytest.mark.parametrize("name", list(HF_BLOCKS))
def test_hugging_face_moe_blocks_load_unchanged(mesh4, name):
    """Weights and router settings of a Hugging Face MoE block, loaded as they are stored (only
    transposed), give the block's output."""
    cfg = HF_BLOCKS[name]
    E = cfg["num_experts"]
    rng = np.random.default_rng(7)
    gate_weight = rng.standard_normal((E, H)) / np.sqrt(H)
    gate_up_proj = rng.standard_normal((E, 2 * I, H)) / np.sqrt(H)
    down_proj = rng.standard_normal((E, H, I)) / np.sqrt(I)
    bias = rng.uniform(-0.05, 0.05, E)
    kw = dict(router=cfg["router"], renormalize=cfg["norm_topk_prob"])
    if cfg["router"] == "deepseek":
        kw.update(n_groups=cfg["n_group"], topk_groups=cfg["topk_group"],
                  scaling_factor=cfg["routed_scaling_factor"])
    m = MoE(H, I, E, cfg["num_experts_per_tok"], mesh=mesh4, dtype=jnp.float32,
            backend="reference", rngs=nnx.Rngs(0), **kw)

    def load(var, value):
        var[...] = jax.device_put(jnp.asarray(value, jnp.float32), var[...].sharding)
    load(m.router, gate_weight.T)
    load(m.w_gate_up, gate_up_proj.transpose(0, 2, 1))
    load(m.w_down, down_proj.transpose(0, 2, 1))
    load(m.router_bias, bias)
    x = rng.standard_normal((32, H)).astype(np.float32)
    y = nnx.jit(lambda m, x: m(x))(m, jnp.asarray(x))
    want = _hf_block(cfg, x, gate_weight.astype(np.float32), bias.astype(np.float32),
                     gate_up_proj.astype(np.float32), down_proj.astype(np.float32))
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-4, atol=1e-4)


def test_low_latency_mode(mesh4):
    """mode="low_latency" in bfloat16 runs without max_tokens_per_rank (the tokens per device)
    and gives the dense layer's output; another dtype is refused when the module is built."""
    E = 8
    m = MoE(H, I, E, K, mesh=mesh4, mode="low_latency", backend="reference", rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(3).standard_normal((16, H)), jnp.float32)
    y = nnx.jit(lambda m, x: m(x))(m, x.astype(jnp.bfloat16))
    assert y.dtype == jnp.bfloat16
    params = [jnp.asarray(a[...], jnp.bfloat16).astype(jnp.float32)
              for a in (m.w_gate_up, m.w_down)]
    want, _, _ = _dense_layer(x.astype(jnp.bfloat16).astype(jnp.float32), m.router[...],
                              *params)
    err = np.linalg.norm(np.asarray(y, np.float32) - want) / np.linalg.norm(want)
    assert err < 3e-2, err
    with pytest.raises(TypeError, match="dtype=float32: mode='low_latency' computes in "
                                        "bfloat16"):
        _module(mesh4, E, mode="low_latency")
    with pytest.raises(TypeError, match="dtype=int32 is not supported"):
        MoE(H, I, E, K, mesh=mesh4, dtype=jnp.int32, rngs=nnx.Rngs(0))


def test_bad_arguments(mesh4):
    with pytest.raises(ValueError, match="num_experts=6 must be a multiple"):
        _module(mesh4, 6)
    with pytest.raises(ValueError, match="axis_name='model'"):
        _module(mesh4, 8, axis_name="model")
    with pytest.raises(ValueError, match="router='top1'"):
        _module(mesh4, 8, router="top1")
    with pytest.raises(TypeError, match="renormalize must be a bool"):
        _module(mesh4, 8, renormalize="no")
    m = _module(mesh4, 8)
    with pytest.raises(ValueError, match=r"x: shape \(8, 16\), expected \[..., H=32\]"):
        m(jnp.zeros((8, 16)))
    with pytest.raises(ValueError, match="x: 6 tokens cannot be split over the 4 devices"):
        m(jnp.zeros((6, H)))
