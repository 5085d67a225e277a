"""Tree helpers shared by every transform: leaf names, multi-output maps, zero moments.

Dependency-free inside adamkit (jax only), so the lowest modules (``_sparse_types``,
``_validate``) can use it without an import cycle.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def is_tracer(x: Any) -> bool:
  """Whether ``x`` is a JAX tracer (a value inside ``jit``/``grad``/``vmap``), whose value
  cannot be inspected."""
  return isinstance(x, jax.core.Tracer)


def path_name(path) -> str:
  """A dotted name for a pytree path: ``{'bn1': {'gamma': x}}`` -> ``'bn1.gamma'``."""
  parts = []
  if path and isinstance(path[-1], jax.tree_util.GetAttrKey) and path[-1].name == "value":
    path = path[:-1]  # Flax NNX variables hold their array in `.value`: name the variable
  for k in path:
    if isinstance(k, jax.tree_util.DictKey):
      parts.append(str(k.key))
    elif isinstance(k, jax.tree_util.GetAttrKey):
      parts.append(k.name)
    elif isinstance(k, jax.tree_util.SequenceKey):
      parts.append(str(k.idx))
    elif isinstance(k, jax.tree_util.FlattenedIndexKey):
      parts.append(str(k.key))
    else:
      parts.append(str(k))
  return ".".join(parts)


def leaf_names(tree: Any) -> list[str]:
  """The :func:`path_name` of each leaf of ``tree``, in ``jax.tree.leaves`` order."""
  return [path_name(p) or "<root>" for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def tree_map_multi(fn, n_out: int, tree, *rest):
  """``jax.tree.map`` for a ``fn`` returning an ``n_out``-tuple: returns ``n_out`` trees."""
  leaves, treedef = jax.tree.flatten(tree)
  others = [treedef.flatten_up_to(r) for r in rest]
  outs = [fn(*args) for args in zip(leaves, *others)]
  return tuple(treedef.unflatten([o[i] for o in outs]) for i in range(n_out))


def zero_moments(params, mu_dtype=None, nu_dtype=None):
  """``(mu, nu)``: two separate zero trees shaped like ``params``, in ``mu_dtype`` /
  ``nu_dtype`` (default: each param's dtype).

  ``zeros_like`` keeps each param's sharding and memory kind, so no moment lands on one
  device first; two trees, because one buffer shared by mu and nu cannot be donated.
  """
  mu = jax.tree.map(lambda p: jnp.zeros_like(p, dtype=mu_dtype), params)
  nu = jax.tree.map(lambda p: jnp.zeros_like(p, dtype=nu_dtype), params)
  return mu, nu


def place_scalars_like(state: Any, params: Any) -> Any:
  """``state`` with its uncommitted 0-d leaves (step counts, learning-rate records) placed
  as a 0-d result of a step over ``params`` would be: on the committed params' device, or
  replicated over their mesh.

  ``jax.jit`` keys its cache on each argument's placement and commitment, and a jitted
  step returns committed arrays when committed params went in; a counter created
  uncommitted by ``jnp.zeros`` would make the second step compile again. Uncommitted or
  abstract params (and tracers, inside ``jit``) leave ``state`` as it is.
  """
  sharding = replicated_like(params)
  if sharding is None:
    return state

  def place(x):
    if isinstance(x, jax.Array) and not is_tracer(x) and x.ndim == 0 and not x.committed:
      return jax.device_put(x, sharding)
    return x

  return jax.tree.map(place, state)


def replicated_like(params: Any, ndim: int = 0) -> jax.sharding.Sharding | None:
  """Where a jitted step over committed ``params`` returns a replicated ``ndim``-d array:
  their device, or replicated over their mesh (one ``None`` per axis, as ``jit`` writes
  it). ``None`` for uncommitted or abstract params (or tracers) and other shardings."""
  placed = [x for x in jax.tree.leaves(params)
            if isinstance(x, jax.Array) and not is_tracer(x) and x.committed]
  if not placed:
    return None
  sharding = placed[0].sharding
  if isinstance(sharding, jax.sharding.NamedSharding):
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*[None] * ndim),
                                      memory_kind=sharding.memory_kind)
  if isinstance(sharding, jax.sharding.SingleDeviceSharding):
    return sharding
  return None


# ------------------------------------------------------------------ Flax NNX variables


def is_variable(x: Any) -> bool:
  """Whether ``x`` is a Flax NNX ``Variable`` (``nnx.Param``, ...), duck-typed: adamkit
  does not import flax."""
  return type(x).__module__.startswith("flax.") and hasattr(x, "get_value")


def unwrap_variables(tree: Any) -> Any:
  """``tree`` with each Flax NNX ``Variable`` replaced by its value, the containers (an
  ``nnx.State``, dicts) kept: ``nnx.split``'s params (a State of ``nnx.Param``),
  ``nnx.Optimizer``'s (a State of arrays) and ``nnx.to_pure_dict``'s all give one form."""
  if not any(is_variable(x) for x in jax.tree.leaves(tree, is_leaf=is_variable)):
    return tree
  return jax.tree.map(lambda x: x.get_value() if is_variable(x) else x, tree, is_leaf=is_variable)


def rewrap_variables(values: Any, like: Any) -> Any:
  """``values`` (a tree of :func:`unwrap_variables` ``(like)``'s structure, any subtree
  at a variable's place) with each of ``like``'s variables around its value again, so
  that updates come back in the gradients' own form."""
  leaves, treedef = jax.tree.flatten(like, is_leaf=is_variable)
  if not any(is_variable(x) for x in leaves):
    return values

  def wrap(var, value):  # a variable's node holds its value as its one child
    return jax.tree.structure(var, is_leaf=lambda x: x is not var).unflatten([value])

  return treedef.unflatten([wrap(x, v) if is_variable(x) else v
                            for x, v in zip(leaves, treedef.flatten_up_to(values))])


def through_variables(init_fn, update_fn):
  """``(init, update)`` of a transform whose state holds params-shaped trees (moments),
  seeing Flax NNX variables' values only: its state is the same whatever form the params
  come in (a State of ``nnx.Param``, of arrays, a pure dict), and its updates come back
  in the gradients' form (variables where the gradients have them)."""

  def init(params):
    return init_fn(unwrap_variables(params))

  def update(updates, state, params=None):
    out, state = update_fn(unwrap_variables(updates), state, unwrap_variables(params))
    return rewrap_variables(out, updates), state

  return init, update
