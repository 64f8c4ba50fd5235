"""A Flax NNX MoE layer over an expert-parallel mesh: `jax_ep.flax.MoE`.

Needs Flax (the `[flax]` extra): `pip install "jax_ep[flax]"`, then `from jax_ep.flax import MoE`.
The module holds the router, the experts (their first axis sharded over the EP axis of the
mesh) and the cumulative expert load, and runs its own `shard_map`: call it on global arrays
from ordinary (jitted) model code.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

try:
    from flax import nnx
except ImportError as e:  # pragma: no cover - exercised only without flax
    raise ImportError("jax_ep.flax needs Flax: pip install 'jax_ep[flax]' (or flax>=0.12)") from e

from jax_ep import _checks, routing
from jax_ep.moe import MODES, moe_ffn

__all__ = ["MoE", "ExpertLoad", "RouterBias", "ROUTERS"]

ROUTERS = ("softmax", "deepseek")


class ExpertLoad(nnx.Variable):
    """Tokens routed to each expert `[E]` int32, summed over every call (and every token of the
    mesh) since the module was made or the statistic was last reset
    (`model.expert_load[...] = 0`): what a load-balancing rule reads. Not trained. int32 holds
    2**31 - 1 per expert: reset it after each balancing update in long runs."""


class RouterBias(nnx.Variable):
    """The DeepSeek-V3 router's load-balancing bias `[E]` float32: it steers the selection
    but not the weights, and no gradient reaches it (update it from `ExpertLoad`)."""


class MoE(nnx.Module):
    """Router, then `jax_ep.moe_ffn` over the experts sharded on `mesh`'s EP axis.

    `y = MoE(...)(x)` for `x [..., H]`: the tokens (all leading axes, flattened) are split over
    all axes of the mesh, the experts over `axis_name` (replicated over the others). Each call
    adds the step's expert counts to `expert_load` and sows the auxiliary load-balance loss
    (softmax router) as `nnx.Intermediate` "load_balance_loss": read it with
    `y, inter = nnx.capture(model, nnx.Intermediate)(x)`, `inter["load_balance_loss"][0]`.

    A Hugging Face MoE block (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3) loads unchanged:
    `router = gate.weight.T`, `w_gate_up = experts.gate_up_proj.transpose(0, 2, 1)` (its
    `[E, 2I, H]` gate rows first become the first I columns here), `w_down =
    experts.down_proj.transpose(0, 2, 1)`, `router_bias = gate.e_score_correction_bias`, with
    `renormalize = norm_topk_prob` and, for DeepSeek-V3, `n_groups = n_group`,
    `topk_groups = topk_group`, `scaling_factor = routed_scaling_factor`. Shared experts are not
    part of this module.

    When a wait of the layer's communication gives up (a peer stopped for `JAX_EP_TIMEOUT_S`),
    `y` is NaN (docs/API.md#timeouts): wrap the jitted training step in `jax_ep.checked` so that
    it raises `jax_ep.PeerTimeoutError` instead of applying that update.

    Args:
      hidden: H.
      intermediate: I, each expert's gated-FFN width (`w_gate_up [E, H, 2I]`, `w_down [E, I, H]`).
      num_experts: E, a multiple of the EP axis size.
      top_k: experts per token.
      mesh: the `jax.sharding.Mesh`; `axis_name` must be one of its axes.
      axis_name: the EP axis.
      router: "softmax" (`routing.softmax_topk`: Mixtral, Qwen-MoE) or "deepseek"
        (`routing.grouped_topk` with `n_groups`, `topk_groups`, `scaling_factor` and the
        `router_bias` variable: DeepSeek-V3).
      renormalize: scale the top-k weights to sum to 1 (before `scaling_factor`), for either
        router: the `norm_topk_prob` of Hugging Face's configs (Qwen2-MoE and Qwen3-MoE
        default to False, DeepSeek-V3 uses True; Mixtral always renormalizes).
      mode, capacity, max_tokens_per_rank, backend, check: as for `moe_ffn`
        (max_tokens_per_rank defaults to the tokens per device).
      dtype: the compute dtype of the experts (bfloat16 runs the grouped-GEMM kernels on GPUs;
        bfloat16 only in low-latency mode).
      param_dtype: the parameters' dtype.
      rngs: `nnx.Rngs` for the initialisation.
    """

    def __init__(self, hidden, intermediate, num_experts, top_k, *, mesh, axis_name="ep",
                 router="softmax", n_groups=1, topk_groups=1, scaling_factor=1.0,
                 renormalize=True, mode="high_throughput", capacity=None, max_tokens_per_rank=None,
                 dtype=jnp.bfloat16, param_dtype=jnp.float32, backend="auto", check=None,
                 rngs):
        H = _checks.static_int("hidden", hidden, 1)
        I = _checks.static_int("intermediate", intermediate, 1)
        E = _checks.static_int("num_experts", num_experts, 1)
        K = _checks.static_int("top_k", top_k, 1)
        if axis_name not in mesh.axis_names:
            raise ValueError(f"axis_name={axis_name!r} is not an axis of the mesh "
                             f"{tuple(mesh.axis_names)}")
        R = mesh.shape[axis_name]
        if E % R:
            raise ValueError(f"num_experts={E} must be a multiple of the {axis_name!r} axis "
                             f"size {R}")
        if router not in ROUTERS:
            raise ValueError(f"router={router!r}; expected one of {ROUTERS}")
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}; expected one of {MODES}")
        self.renormalize = _checks.flag("renormalize", renormalize)
        if jnp.dtype(dtype) not in [jnp.dtype(d) for d in _checks.FLOAT_DTYPES]:
            raise TypeError(f"dtype={jnp.dtype(dtype).name} is not supported; expected one of "
                            "float32, bfloat16, float16")
        if mode == "low_latency" and jnp.dtype(dtype) != jnp.bfloat16:
            raise TypeError(f"dtype={jnp.dtype(dtype).name}: mode='low_latency' computes in "
                            "bfloat16 (the low-latency ops take bfloat16); pass "
                            "dtype=jnp.bfloat16")
        self.hidden, self.intermediate, self.num_experts, self.top_k = H, I, E, K
        self.mesh, self.axis_name, self.router_kind = mesh, axis_name, router
        self.n_groups, self.topk_groups, self.scaling_factor = n_groups, topk_groups, \
            scaling_factor
        self.mode, self.capacity, self.max_tokens_per_rank = mode, capacity, max_tokens_per_rank
        self.dtype, self.backend = jnp.dtype(dtype), backend
        self.check = _checks.flag("check", check, allow_none=True)

        def put(a, spec):
            return jax.device_put(a, NamedSharding(mesh, spec))
        experts = P(axis_name, None, None)
        k1, k2, k3 = jax.random.split(rngs.params(), 3)
        self.router = nnx.Param(put(
            jax.random.normal(k1, (H, E), param_dtype) / jnp.sqrt(H).astype(param_dtype), P()))
        self.w_gate_up = nnx.Param(put(
            jax.random.normal(k2, (E, H, 2 * I), param_dtype) /
            jnp.sqrt(H).astype(param_dtype), experts))
        self.w_down = nnx.Param(put(
            jax.random.normal(k3, (E, I, H), param_dtype) / jnp.sqrt(I).astype(param_dtype),
            experts))
        self.expert_load = ExpertLoad(put(jnp.zeros((E,), jnp.int32), P()))
        self.router_bias = RouterBias(put(jnp.zeros((E,), jnp.float32), P()))

    def _route(self, logits, bias):
        if self.router_kind == "softmax":
            return routing.softmax_topk(logits, self.top_k, renormalize=self.renormalize)
        return routing.grouped_topk(logits, self.top_k, n_groups=self.n_groups,
                                    topk_groups=self.topk_groups, bias=bias,
                                    scaling_factor=self.scaling_factor,
                                    renormalize=self.renormalize)

    def __call__(self, x):
        if x.ndim < 2 or x.shape[-1] != self.hidden:
            raise ValueError(f"x: shape {x.shape}, expected [..., H={self.hidden}]")
        lead = x.shape[:-1]
        xt = x.reshape(-1, self.hidden)
        axes = tuple(self.mesh.axis_names)
        shards = self.mesh.size
        if xt.shape[0] % shards:
            raise ValueError(f"x: {xt.shape[0]} tokens cannot be split over the {shards} "
                             f"devices of the mesh (a multiple of {shards} is needed)")
        E, ep = self.num_experts, self.axis_name

        def shard(x, router, bias, wgu, wd):
            logits = x.astype(jnp.float32) @ router.astype(jnp.float32)
            weights, idx = self._route(logits, bias)
            aux = (routing.load_balance_loss(logits, idx, axis_name=axes)
                   if self.router_kind == "softmax" else jnp.zeros((), jnp.float32))
            counts = routing.expert_counts(idx, E, axis_name=axes)
            y = moe_ffn(x.astype(self.dtype), idx, weights, wgu.astype(self.dtype),
                        wd.astype(self.dtype), num_experts=E, axis_name=ep, mode=self.mode,
                        capacity=self.capacity, max_tokens_per_rank=self.max_tokens_per_rank,
                        backend=self.backend, check=self.check)
            return y, aux, counts

        tokens, experts = P(axes), P(ep)
        y, aux, counts = jax.shard_map(
            shard, mesh=self.mesh, in_specs=(tokens, P(), P(), experts, experts),
            out_specs=(tokens, P(), P()), check_vma=False)(
                xt, self.router[...], self.router_bias[...], self.w_gate_up[...],
                self.w_down[...])
        self.expert_load[...] = self.expert_load[...] + counts
        if self.router_kind == "softmax":
            self.sow(nnx.Intermediate, "load_balance_loss", aux)
        return y.reshape(lead + (self.hidden,))
