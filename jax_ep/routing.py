"""Routers: which experts each token goes to, with what weight, and the statistics that keep the
experts' load balanced. Pure JAX (any backend, inside or outside `shard_map`); the outputs feed
`dispatch` / `low_latency_dispatch` directly: `topk_idx` int32, `topk_weights` float32.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_ep import _checks


def _logits(name, logits):
    _checks.expect_rank(name, logits, 2, "[T, E]")
    _checks.expect_dtype(name, logits, _checks.FLOAT_DTYPES)
    return logits.astype(jnp.float32)


def _k(k, E):
    k = _checks.static_int("k", k, 1)
    if k > E:
        raise ValueError(f"k={k} is more than the number of experts E={E}")
    return k


def softmax_topk(logits, k, *, renormalize=True):
    """Softmax router (Mixtral, Qwen-MoE): the k experts of highest probability.

    Args:
      logits: `[T, E]` router logits (float32 / bfloat16 / float16; computed in float32).
      k: experts per token.
      renormalize: scale the k probabilities to sum to 1 (Mixtral; Qwen's `norm_topk_prob`).
        False keeps the softmax probabilities over all E experts.

    Returns:
      `(topk_weights [T, k] float32, topk_idx [T, k] int32)`, highest first. Equal
      probabilities go to the lowest expert index first (`torch.topk` promises no order among
      ties, so with tied logits, frequent in bfloat16, a PyTorch model may choose other
      experts).
    """
    x = _logits("logits", logits)
    k = _k(k, x.shape[1])
    _checks.flag("renormalize", renormalize)
    probs = jax.nn.softmax(x, axis=-1)
    w, idx = jax.lax.top_k(probs, k)
    if renormalize:
        w = w / jnp.sum(w, axis=-1, keepdims=True)
    return w, idx.astype(jnp.int32)


def grouped_topk(logits, k, *, n_groups, topk_groups, bias=None, scaling_factor=1.0,
                 renormalize=True):
    """DeepSeek-V3 router: sigmoid scores, group-limited selection, a bias that steers the
    selection but not the weights.

    The E experts form `n_groups` groups of equal size. A group's score is the sum of its two
    highest selection scores (`sigmoid(logits) + bias`); the tokens' experts are the k of
    highest selection score within its `topk_groups` best groups. The weights are the chosen
    experts' sigmoid scores without the bias, divided by their sum when `renormalize`, times
    `scaling_factor`.

    Args:
      logits: `[T, E]` router logits (computed in float32).
      k: experts per token.
      n_groups: expert groups (E % n_groups == 0, at least 2 experts each).
      topk_groups: groups a token may choose from (1 <= topk_groups <= n_groups).
      bias: `[E]` float, the load-balancing bias (DeepSeek's `e_score_correction_bias`), or
        None. It carries no gradient into the weights.
      scaling_factor: the weights' factor (DeepSeek-V3: `routed_scaling_factor`, 2.5).
      renormalize: divide the k scores by their sum before scaling.

    Returns:
      `(topk_weights [T, k] float32, topk_idx [T, k] int32)`, by selection score, highest first;
      ties (of experts and of groups) go to the lowest index first.
    """
    x = _logits("logits", logits)
    T, E = x.shape
    k = _k(k, E)
    n_groups = _checks.static_int("n_groups", n_groups, 1)
    topk_groups = _checks.static_int("topk_groups", topk_groups, 1)
    _checks.flag("renormalize", renormalize)
    if E % n_groups or E // n_groups < 2:
        raise ValueError(f"n_groups={n_groups}: E={E} experts must split into groups of equal "
                         "size, at least 2 each")
    if topk_groups > n_groups:
        raise ValueError(f"topk_groups={topk_groups} is more than n_groups={n_groups}")
    if k > topk_groups * (E // n_groups):
        raise ValueError(f"k={k} is more than the {topk_groups * (E // n_groups)} experts of "
                         f"the topk_groups={topk_groups} groups a token may choose from")
    scores = jax.nn.sigmoid(x)
    sel = scores
    if bias is not None:
        _checks.expect_rank("bias", bias, 1, "[E]")
        _checks.expect_dtype("bias", bias, _checks.FLOAT_DTYPES)
        if bias.shape[0] != E:
            raise ValueError(f"bias: has {bias.shape[0]} entries, expected E={E}")
        sel = scores + jax.lax.stop_gradient(bias.astype(jnp.float32))[None, :]
    per_group = sel.reshape(T, n_groups, E // n_groups)
    group_score = jnp.sum(jax.lax.top_k(per_group, 2)[0], axis=-1)            # [T, n_groups]
    _, best = jax.lax.top_k(group_score, topk_groups)                           # [T, topk_groups]
    allowed = jnp.zeros((T, n_groups), bool).at[jnp.arange(T)[:, None], best].set(True)
    allowed = jnp.repeat(allowed, E // n_groups, axis=1)                       # [T, E]
    _, idx = jax.lax.top_k(jnp.where(allowed, jax.lax.stop_gradient(sel), -jnp.inf), k)
    w = jnp.take_along_axis(scores, idx, axis=1)
    if renormalize:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    return w * jnp.float32(scaling_factor), idx.astype(jnp.int32)


def expert_counts(topk_idx, num_experts, *, axis_name=None):
    """Tokens routed to each expert: `[E]` int32 (slots of -1 or out of range count nowhere).

    With axis_name (inside shard_map), summed over that axis: the global load.
    """
    _checks.topk("topk_idx", topk_idx)
    E = _checks.static_int("num_experts", num_experts, 1)
    idx = topk_idx.reshape(-1)
    valid = (idx >= 0) & (idx < E)
    counts = jnp.zeros((E,), jnp.int32).at[jnp.where(valid, idx, 0)].add(valid.astype(jnp.int32))
    return jax.lax.psum(counts, axis_name) if axis_name is not None else counts


def update_expert_load(load, topk_idx, *, axis_name=None):
    """Cumulative expert-load statistics across steps: `load [E]` plus this step's counts.

    `load` is an int32 (or float32) array of E, zeros at the start, carried by the training or
    serving loop (a `scan` carry, or a variable of the model); the result steers a routing bias
    (DeepSeek-V3) or is reported. With axis_name, the step's counts are summed over that axis.
    """
    _checks.expect_rank("load", load, 1, "[E]")
    counts = expert_counts(topk_idx, load.shape[0], axis_name=axis_name)
    return load + counts.astype(load.dtype)


def load_balance_loss(logits, topk_idx, *, axis_name=None):
    """Auxiliary load-balance loss of a softmax router (Switch Transformer, Mixtral):
    `E * sum_e f_e * P_e`, with `f_e` the fraction of routed slots that chose expert e and `P_e`
    the mean router probability of e. 1 for a perfectly even router; differentiable in logits.

    With axis_name (inside shard_map), f and P are averaged over that axis too.
    """
    x = _logits("logits", logits)
    T, E = x.shape
    _checks.topk("topk_idx", topk_idx, T)
    probs = jax.nn.softmax(x, axis=-1)
    counts = expert_counts(topk_idx, E).astype(jnp.float32)
    slots = jnp.float32(T * topk_idx.shape[1])
    p_sum = jnp.sum(probs, axis=0)
    tokens = jnp.float32(T)
    if axis_name is not None:
        counts = jax.lax.psum(counts, axis_name)
        slots = jax.lax.psum(slots, axis_name)
        p_sum = jax.lax.psum(p_sum, axis_name)
        tokens = jax.lax.psum(tokens, axis_name)
    f = counts / jnp.maximum(slots, 1.0)
    P = p_sum / jnp.maximum(tokens, 1.0)
    return E * jnp.sum(jax.lax.stop_gradient(f) * P)
