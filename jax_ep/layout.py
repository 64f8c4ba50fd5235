"""get_dispatch_layout: the local layout count (DeepEP's get_dispatch_layout), no communication."""
from __future__ import annotations

import jax.numpy as jnp

from jax_ep import _checks, _ffi, reference as ref


def get_dispatch_layout(topk_idx, *, num_experts, num_ranks, backend="auto"):
    """-> (tokens_per_rank [R], tokens_per_expert [E], is_token_in_rank [T, R] bool, num_invalid).

    Runs anywhere (no collective); `backend='cuda'` uses the CUDA layout kernel.
    """
    _checks.expect_rank("topk_idx", topk_idx, 2, "[T, K]")
    _checks.expect_dtype("topk_idx", topk_idx, (jnp.int32, jnp.int64))
    R = _checks.static_int("num_ranks", num_ranks, 1)
    _checks.layout_ranks(R)
    _checks.experts_per_rank(num_experts, R)
    if _checks.resolve_backend(backend) == "reference":
        return ref.layout_counts(topk_idx, num_experts=num_experts, num_ranks=R)
    T = topk_idx.shape[0]
    return tuple(_ffi.call("jax_ep_layout", [_checks.int32_ids(topk_idx, num_experts)],
                           [((R,), jnp.int32), ((num_experts,), jnp.int32), ((T, R), jnp.bool_),
                            ((), jnp.int32)],
                           num_experts=num_experts, num_ranks=R))
