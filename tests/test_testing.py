"""jax_ep.testing on CPU: virtual ranks (vmap over the EP axis) give what shard_map gives, with
the reference backend; the mode's switch is validated."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ep
from jax_ep import testing


def _body(E):
    def body(x, idx, w):
        r = jax_ep.dispatch(x, idx, w, num_experts=E, backend="reference")
        out = jax_ep.combine(r.recv_x * 2, r.handle, backend="reference")
        ll = jax_ep.low_latency_dispatch(x, idx, num_experts=E, max_tokens_per_rank=x.shape[0],
                                         use_fp8=False, backend="reference")
        o2 = jax_ep.low_latency_combine(ll.recv_x, idx, w, ll.handle, backend="reference")
        return r.recv_x, r.handle.recv_src, out, ll.recv_count, o2
    return body


@pytest.mark.parametrize("R", [2, 4])
def test_virtual_ranks_equal_shard_map(monkeypatch, R):
    T, H, K, E = 7, 16, 2, 2 * R
    rng = np.random.default_rng(R)
    x = jnp.asarray(rng.standard_normal((R, T, H)), jnp.bfloat16)
    idx = jnp.asarray(rng.integers(-1, E, (R, T, K)), jnp.int32)
    w = jnp.asarray(rng.random((R, T, K)), jnp.float32)
    monkeypatch.setenv("JAX_EP_VIRTUAL_RANKS", "0")
    real = testing.run_ranks(_body(E), R)(x, idx, w)
    monkeypatch.setenv("JAX_EP_VIRTUAL_RANKS", "1")
    virtual = testing.run_ranks(_body(E), R)(x, idx, w)
    for a, b in zip(real, virtual):
        assert a.shape == b.shape and a.shape[0] == R
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_virtual_ranks_gradient_inside_equals_global_gradient(monkeypatch):
    """A gradient taken inside the per-rank body is that of the sum over the ranks (what
    jax.grad of the global loss gives through shard_map)."""
    R, T, H, K, E = 4, 5, 8, 2, 8
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((R, T, H)), jnp.float32)
    idx = jnp.asarray(rng.integers(-1, E, (R, T, K)), jnp.int32)

    def fwd(x, i):
        r = jax_ep.dispatch(x, i, num_experts=E, backend="reference")
        return jax_ep.combine(jnp.sin(r.recv_x), r.handle, backend="reference")

    inside = testing.virtual_ranks(
        lambda x, i: jax.grad(lambda x: jnp.sum(fwd(x, i) ** 2))(x), R)(x, idx)
    monkeypatch.setenv("JAX_EP_VIRTUAL_RANKS", "0")
    sm = testing.run_ranks(fwd, R)
    outside = jax.grad(lambda x: jnp.sum(sm(x, idx) ** 2))(x)
    np.testing.assert_allclose(np.asarray(inside), np.asarray(outside), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad", ["yes", "2"])
def test_virtual_ranks_switch_is_checked(monkeypatch, bad):
    monkeypatch.setenv("JAX_EP_VIRTUAL_RANKS", bad)
    with pytest.raises(ValueError, match="JAX_EP_VIRTUAL_RANKS"):
        testing.use_virtual_ranks(2)


def test_virtual_ranks_count_is_checked():
    with pytest.raises(ValueError, match="num_ranks"):
        testing.virtual_ranks(lambda x: x, 9)


def test_cpu_machine_never_picks_virtual_ranks(monkeypatch):
    monkeypatch.delenv("JAX_EP_VIRTUAL_RANKS", raising=False)
    assert testing.use_virtual_ranks(8) is False  # no GPU: shard_map over the CPU devices
