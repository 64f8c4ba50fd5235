"""get_dispatch_layout: the local layout count (DeepEP's get_dispatch_layout), no communication."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_ep import _checks, _ffi, reference as ref


def get_dispatch_layout(topk_idx: jax.Array, *, num_experts: int, num_ranks: int,
                        backend: str = "auto",
                        ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Where a rank's tokens go, counted locally: DeepEP's `get_dispatch_layout`.

    No communication: it runs anywhere (inside `shard_map` or not) on the ids of one rank, so
    a caller can size buffers or inspect the routing before a `dispatch`. Expert e lives on rank
    e // L, L = num_experts // num_ranks.

    Args:
      topk_idx: `[T, K]` int32 (int64 accepted) expert ids; -1 marks an unused slot, ids
        outside [-1, E) act as -1 and are counted in `num_invalid`.
      num_experts: E, a multiple of num_ranks.
      num_ranks: R, the ranks of the EP group (static; at most 64 with the CUDA extension).
      backend: "auto" (the CUDA layout kernel on GPUs, else the reference), "reference" or
        "cuda".

    Returns:
      `(tokens_per_rank, tokens_per_expert, is_token_in_rank, num_invalid)`:
      `tokens_per_rank` `[R]` int32, the tokens that go to each rank (a token counts once per
      rank, however many of its experts are there); `tokens_per_expert` `[E]` int32 (a token
      naming an expert in several slots counts once); `is_token_in_rank` `[T, R]` bool;
      `num_invalid` `[]` int32, the ids outside [-1, E).
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
