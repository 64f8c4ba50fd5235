"""Rematerialisation without replaying the communication.

The outputs of the communication ops carry names (`jax.ad_checkpoint.checkpoint_name`):
everything `dispatch` / `low_latency_dispatch` deliver is named `DISPATCH`, the outputs of
`combine` / `low_latency_combine` `COMBINE`. Under `jax.checkpoint(f, policy=remat_policy)` the
backward pass recomputes the rest of f (the expert GEMMs, activations, routers) from those saved
values and never runs a dispatch or combine again; only the ops' own transposes (a combine for a
dispatch, a dispatch for a combine) run in the backward, as without checkpointing.
"""
from __future__ import annotations

import jax
from jax.ad_checkpoint import checkpoint_name

DISPATCH = "jax_ep.dispatch"
COMBINE = "jax_ep.combine"

# Save the communication ops' outputs, recompute everything else.
remat_policy = jax.checkpoint_policies.save_only_these_names(DISPATCH, COMBINE)


def named(tree, name):
    """Every array leaf of tree tagged with `name` for the remat policies."""
    return jax.tree_util.tree_map(lambda a: checkpoint_name(a, name), tree)
