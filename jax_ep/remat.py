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

_SaveOnlyTheseNames = type(jax.checkpoint_policies.save_only_these_names())


class RematPolicy(_SaveOnlyTheseNames):
    """jax_ep.remat_policy: save the communication, recompute the rest.

    Use it as `jax.checkpoint(f, policy=jax_ep.remat_policy)` (or `jax.remat`, or Flax's
    `nn.remat(..., policy=jax_ep.remat_policy)`). The outputs of `jax_ep.dispatch` and
    `jax_ep.low_latency_dispatch` (named "jax_ep.dispatch") and of `jax_ep.combine` and
    `jax_ep.low_latency_combine` (named "jax_ep.combine") are saved for the backward pass;
    everything else in f (expert GEMMs, activations, routers) is recomputed from them, so the
    backward pass never runs a dispatch or combine again beyond the ops' own transposes. (The
    fused `moe_ffn`'s activation comes out of its dispatch kernel: it is saved with it.)

    It is `jax.checkpoint_policies.save_only_these_names("jax_ep.dispatch", "jax_ep.combine")`
    (an instance of a subclass of that policy's type, for this text). To save names of your
    own as well, build `jax.checkpoint_policies.save_only_these_names(jax_ep.remat.DISPATCH,
    jax_ep.remat.COMBINE, *your_names)`.
    """


# Save the communication ops' outputs, recompute everything else.
remat_policy = RematPolicy(frozenset((DISPATCH, COMBINE)))


def named(tree, name):
    """Every array leaf of tree tagged with `name` for the remat policies."""
    return jax.tree_util.tree_map(lambda a: checkpoint_name(a, name), tree)
