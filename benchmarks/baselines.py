"""What a JAX user has without jax_ep: MoE dispatch / combine with lax.all_to_all (padded to a
capacity factor) and with lax.ragged_all_to_all. Per shard, inside shard_map; routing sort
included. Each token goes once to each rank that holds one of its experts (as jax_ep does).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def _dest_rows(topk_idx, R, L):
    """Token-in-rank mask [T, R] and the (rank, token) pairs sorted by rank."""
    T = topk_idx.shape[0]
    dest = jnp.where(topk_idx >= 0, topk_idx // L, -1)
    in_rank = jnp.any(dest[:, :, None] == jnp.arange(R)[None, None, :], axis=1)   # [T, R]
    key = jnp.where(in_rank.T, jnp.arange(R)[:, None], R).reshape(-1)            # [R*T]
    order = jnp.argsort(key, stable=True)
    return in_rank, key[order], order % T


def all_to_all_dispatch(x, topk_idx, *, num_experts, axis_name, capacity):
    """Padded all_to_all: [R, capacity, H] per rank pair (tokens past capacity dropped)."""
    R = lax.axis_size(axis_name)
    L = num_experts // R
    in_rank, rank_sorted, tok_sorted = _dest_rows(topk_idx, R, L)
    counts = jnp.sum(in_rank, axis=0)
    starts = jnp.cumsum(counts) - counts
    pos = jnp.arange(rank_sorted.shape[0]) - starts[jnp.minimum(rank_sorted, R - 1)]
    ok = (rank_sorted < R) & (pos < capacity)
    buf = jnp.zeros((R, capacity) + x.shape[1:], x.dtype).at[
        jnp.where(ok, rank_sorted, R), jnp.where(ok, pos, 0)].set(x[tok_sorted], mode="drop")
    recv = lax.all_to_all(buf, axis_name, 0, 0, tiled=True)
    return recv, (ok, rank_sorted, pos, tok_sorted)


def all_to_all_combine(y, layout, *, axis_name, num_tokens):
    ok, rank_sorted, pos, tok_sorted = layout
    R = y.shape[0]
    back = lax.all_to_all(y, axis_name, 0, 0, tiled=True)
    rows = back[jnp.where(ok, rank_sorted, 0), jnp.where(ok, pos, 0)]
    rows = jnp.where(ok[:, None], rows, 0).astype(jnp.float32)
    out = jnp.zeros((num_tokens,) + y.shape[2:], jnp.float32).at[tok_sorted].add(rows)
    del R
    return out.astype(y.dtype)


def ragged_dispatch(x, topk_idx, *, num_experts, axis_name):
    """lax.ragged_all_to_all into a worst-case [R * T, H] receive buffer."""
    R = lax.axis_size(axis_name)
    T = x.shape[0]
    L = num_experts // R
    in_rank, rank_sorted, tok_sorted = _dest_rows(topk_idx, R, L)
    send_sizes = jnp.sum(in_rank, axis=0).astype(jnp.int32)                      # [R]
    input_offsets = (jnp.cumsum(send_sizes) - send_sizes).astype(jnp.int32)
    recv_sizes = lax.all_to_all(send_sizes, axis_name, 0, 0, tiled=True)          # from each s
    # where my block lands on rank q: after the blocks of ranks s < me on q
    all_sizes = lax.all_gather(send_sizes, axis_name)                             # [R(s), R(q)]
    me = lax.axis_index(axis_name)
    output_offsets = jnp.sum(jnp.where(jnp.arange(R)[:, None] < me, all_sizes, 0),
                             axis=0).astype(jnp.int32)
    operand = x[tok_sorted[: R * T]]
    out = jnp.zeros((R * T,) + x.shape[1:], x.dtype)
    recv = lax.ragged_all_to_all(operand, out, input_offsets, send_sizes, output_offsets,
                                 recv_sizes, axis_name=axis_name)
    return recv, recv_sizes


def _act(h):
    I = h.shape[-1] // 2
    h = h.astype(jnp.float32)
    return jax.nn.silu(h[..., :I]) * h[..., I:]


def ragged_dot_moe(x, topk_idx, topk_weights, w_gate_up, w_down):
    """One rank's MoE FFN as JAX users write it today (MaxText's GPU path without the
    communication): the (token, slot) pairs sorted by expert, lax.ragged_dot twice, unsorted,
    weighted sum per token. Slots of -1 are sorted last and get weight 0."""
    T, K = topk_idx.shape
    L = w_gate_up.shape[0]
    flat = jnp.where(topk_idx >= 0, topk_idx, L).reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.zeros((L + 1,), jnp.int32).at[flat].add(1)[:L]
    xs = x[order // K]
    h = lax.ragged_dot(xs, w_gate_up, sizes, preferred_element_type=jnp.float32)
    y = lax.ragged_dot(_act(h).astype(x.dtype), w_down, sizes,
                       preferred_element_type=jnp.float32)
    wk = jnp.where(flat < L, topk_weights.reshape(-1), 0).astype(jnp.float32)[order]
    out = jnp.zeros((T, x.shape[1]), jnp.float32).at[order // K].add(y * wk[:, None])
    return out.astype(x.dtype)


def capacity_einsum_moe(x, topk_idx, topk_weights, w_gate_up, w_down, capacity_factor=1.25):
    """One rank's MoE FFN with a fixed capacity per expert (the all_to_all + padded batched
    einsum pattern, without the communication): [L, C, H] buffers, pairs past C dropped."""
    T, K = topk_idx.shape
    L, H = w_gate_up.shape[0], x.shape[1]
    C = int(-(-T * K * capacity_factor // L))
    flat = topk_idx.reshape(-1)
    onehot = (flat[:, None] == jnp.arange(L)[None, :]).astype(jnp.int32)        # [T*K, L]
    pos = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=1)            # [T*K]
    keep = (flat >= 0) & (pos < C)
    e = jnp.where(keep, flat, L)                                                # L: dropped
    buf = jnp.zeros((L + 1, C, H), x.dtype).at[e, jnp.where(keep, pos, 0)].set(
        jnp.repeat(x, K, axis=0), mode="drop")[:L]
    h = jnp.einsum("lch,lhf->lcf", buf, w_gate_up, preferred_element_type=jnp.float32)
    y = jnp.einsum("lci,lih->lch", _act(h).astype(x.dtype), w_down,
                   preferred_element_type=jnp.float32)
    got = y[jnp.minimum(e, L - 1), jnp.where(keep, pos, 0)]                     # [T*K, H]
    wk = jnp.where(keep, topk_weights.reshape(-1), 0).astype(jnp.float32)
    return jnp.sum((got * wk[:, None]).reshape(T, K, H), axis=1).astype(x.dtype)
