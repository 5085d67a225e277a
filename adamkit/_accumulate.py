"""Gradient accumulation over micro-steps, for dense and row-sparse gradients: ``multi_steps``.

``optax.MultiSteps`` accumulates into ``zeros_like(params)`` and maps over
``(updates, accumulator)`` leaf by leaf. A :class:`adamkit.RowSparse` gradient is two
leaves (ids and values) where that accumulator has one dense ``(N, D)`` table, so optax
refuses it with JAX's pytree structure error before any adamkit code runs; and even a
working variant of that design would hold a dense ``(N, D)`` buffer per table. Here a
sparse table's accumulator is itself a ``RowSparse`` of ``k * n`` slots (``k``
micro-steps of ``n`` ids each): micro-step ``j`` writes its ids and values into slots
``[j n, (j + 1) n)``, and the ``k``-th hands the whole buffer to the inner optimizer as
one gradient, whose own merge adds up the duplicates.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from adamkit import _validate
from adamkit._sparse_types import RowSparse, is_row_sparse, safe_ids
from adamkit._tree import leaf_names, path_name


class MultiStepsTransformation(optax.GradientTransformationExtraArgs):
  """What :func:`adamkit.multi_steps` returns: an ``optax.GradientTransformationExtraArgs`` with
  ``optax.MultiSteps``'s ``has_updated`` and ``gradient_transformation``."""

  __slots__ = ()

  def has_updated(self, state: optax.MultiStepsState) -> jax.Array:
    """Whether the last ``update`` was a gradient step (the inner optimizer ran)."""
    return jnp.logical_and(state.mini_step == 0, state.gradient_step > 0)

  def gradient_transformation(self) -> MultiStepsTransformation:
    """Itself (it already is one); for code written for ``optax.MultiSteps``."""
    return self


def _check_ids_per_step(ids_per_step: Any) -> dict[str, int]:
  if ids_per_step is None:
    return {}
  if not isinstance(ids_per_step, Mapping):
    raise TypeError("`ids_per_step` must be a dict from a table's leaf name (as in "
                    "ak.state_dict, e.g. 'emb' or 'encoder.emb') to the number of row ids its "
                    f"RowSparse gradient holds per micro-step, got {type(ids_per_step).__name__}.")
  out = {}
  for name, n in ids_per_step.items():
    if not isinstance(name, str):
      raise TypeError(f"`ids_per_step` keys must be leaf names (str), got {name!r}.")
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)):
      raise TypeError(f"`ids_per_step[{name!r}]` must be an int >= 1, got {n!r}.")
    if n < 1:
      raise ValueError(f"`ids_per_step[{name!r}]` must be >= 1, got {n}.")
    out[name] = int(n)
  return out


def _is_nnx_variable(x: Any) -> bool:
  """A Flax NNX ``Variable`` (duck-typed: adamkit does not import flax)."""
  return type(x).__module__.startswith("flax.") and hasattr(x, "get_value")


def _id_dtype(num_rows: int):
  return jnp.int32 if num_rows <= np.iinfo(np.int32).max else jnp.int64


def _no_rows(num_rows: int, size: int, row_shape: tuple, dtype) -> RowSparse:
  """``size`` slots that address no row (the id ``num_rows``, which adamkit drops) and hold
  zeros: an empty accumulator, or an update that moves nothing.

  The ids are plain integers, as in the accumulator state (an optimizer state holds no
  ``key<adamkit.RowSparse.indices>`` leaf, so orbax saves it); a gradient or update handed
  on is rebuilt with :meth:`RowSparse.of`."""
  ids = jnp.full((size,), num_rows, _id_dtype(num_rows))
  return RowSparse.tree_unflatten(num_rows, (ids, jnp.zeros((size, *row_shape), dtype)))


def _zeros_like_update(shapes: Any) -> Any:
  """Zeros shaped like an ``eval_shape`` of updates; a RowSparse update moves no row."""
  def zero(s):
    if isinstance(s, RowSparse):
      r = _no_rows(s.num_rows, s.indices.shape[0], s.values.shape[1:], s.values.dtype)
      return RowSparse.of(r.indices, r.values, r.num_rows)
    return jnp.zeros(s.shape, s.dtype)

  return jax.tree.map(zero, shapes, is_leaf=is_row_sparse)


def multi_steps(tx: optax.GradientTransformation,
                every_k_schedule: int | Callable[[jax.Array], jax.Array], *,
                ids_per_step: Mapping[str, int] | None = None, use_grad_mean: bool = True,
                should_skip_update_fn: Callable | None = None,
                accumulator_dtype: Any = jnp.float32) -> MultiStepsTransformation:
  r"""``optax.MultiSteps`` that also accumulates :class:`adamkit.RowSparse` gradients sparsely.

  Over the ``k`` micro-steps of one gradient step the gradients :math:`g_1, \dots, g_k`
  are accumulated; the ``k``-th micro-step hands their mean (or sum) to ``tx``:

  .. math::

    \bar g = \frac{1}{k} \sum_{j=1}^{k} g_j, \qquad
    (u, s) = \mathtt{tx.update}(\bar g, s) \text{ at micro-step } k, \qquad
    u = 0 \text{ (} s \text{ unchanged) at micro-steps } 1, \dots, k - 1.

  A dense leaf is accumulated as ``optax.MultiSteps`` does (a running mean in
  ``accumulator_dtype``, same numbers). A ``RowSparse`` leaf of ``n`` ids per micro-step
  is kept as a ``RowSparse`` of ``k n`` slots: micro-step ``j`` stores its ids and values
  in slots ``[(j-1) n, j n)``, and :math:`\bar g` is that buffer with its values divided
  by ``k``: the concatenation of the micro-steps' ids and values, whose duplicates ``tx``
  (``ak.sparse_adam``) merges as for any batch. Memory ``O(k n D)`` per table, never the
  ``(N, D)`` table gradient; the same shapes every micro-step, so a jitted step compiles
  once. On a micro-step that does not emit, the update of a sparse leaf is a ``RowSparse``
  that moves no row.

  Args:
    tx: the optimizer run once per gradient step (e.g. ``ak.sparse_adam(...)``).
    every_k_schedule: ``k``, the micro-steps per gradient step: an int, or (dense
      gradients only) a function of the gradient step, as in ``optax.MultiSteps``.
    ids_per_step: for each table whose gradient is a ``RowSparse``, its leaf name (as in
      :func:`adamkit.state_dict`: ``"emb"``, ``"encoder.emb"``) and the number ``n`` of ids
      its gradient holds per micro-step (a micro-step may hold fewer; the rest of its slots
      stay empty). Needed at ``init``, which sees only the params.
    use_grad_mean: pass the mean of the ``k`` gradients (default) or their sum.
    should_skip_update_fn: as in ``optax.MultiSteps``: ``fn(updates, gradient_step,
      params) -> (skip, skip_state)``; a skipped micro-step leaves the state as it was. A
      ``RowSparse`` leaf reaches it as the values of its merged rows (so
      ``optax.skip_large_updates`` sees the norm of the dense equivalent).
    accumulator_dtype: the dtype of the accumulated values (float32, as optax).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` (a subclass with
    ``has_updated(state)``) whose state is an ``optax.MultiStepsState``; its ``acc_grads``
    holds a ``RowSparse`` buffer for each table named in ``ids_per_step``.

  Raises:
    TypeError: a ``RowSparse`` gradient for a leaf not in ``ids_per_step`` (or a dense one
      for a leaf in it), a schedule function with ``ids_per_step``, wrong argument types.
    ValueError: a name of ``ids_per_step`` that is no leaf of the params, a micro-step
      gradient with more ids than ``ids_per_step`` allows, ``k < 1``.

  .. warning::
    How this differs from ``optax.MultiSteps``: it takes ``RowSparse`` gradients (optax's
    refuses them, "pytree structure error ... RowSparse"); ``tx`` runs only at the
    ``k``-th micro-step (``lax.cond``), where optax runs it every micro-step and keeps the
    result only then, so a non-finite inner update on another micro-step no longer turns
    the zero update into NaN; for a sparse leaf the mean divides the summed values by
    ``k`` once (optax's running mean rounds differently, by about one float32 ulp per
    micro-step). Inside :func:`adamkit.offload` a sparse accumulator cannot work
    (the offload renumbers the rows per micro-step): put the offload inside,
    ``ak.multi_steps(ak.offload(ak.sparse_adam(...), mode="state"), k, ...)``.

  Examples:
    >>> from functools import partial
    >>> import jax, jax.numpy as jnp, adamkit as ak
    >>> params = {"emb": jnp.zeros((1_000, 2)), "w": jnp.ones(2)}
    >>> tx = ak.multi_steps(ak.sparse_adam(0.1), 2, ids_per_step={"emb": 2})
    >>> state = tx.init(params)
    >>> @partial(jax.jit, donate_argnums=(0, 1))  # table, moments, buffer in place
    ... def step(params, state, grads):
    ...   updates, state = tx.update(grads, state, params)
    ...   return ak.apply_updates(params, updates), state
    >>> for ids in ([3, 7], [7, 9]):
    ...   grads = {"emb": ak.RowSparse(jnp.array(ids), jnp.ones((2, 2)), 1_000),
    ...            "w": jnp.ones(2)}
    ...   params, state = step(params, state, grads)
    ...   print(bool(tx.has_updated(state)), jnp.flatnonzero(params["emb"][:, 0]))
    False []
    True [3 7 9]

  References:
    ``optax.MultiSteps`` (its interface and dense numbers); the sparse buffer is adamkit's.
  """
  if not isinstance(tx, optax.GradientTransformation):
    raise TypeError(f"`tx` must be an optax GradientTransformation, got {type(tx).__name__}.")
  sparse_n = _check_ids_per_step(ids_per_step)
  if callable(every_k_schedule):
    if sparse_n:
      raise TypeError("`every_k_schedule` must be an int with `ids_per_step`: a sparse "
                      "accumulator has k * n slots, fixed when the state is built.")
    schedule = every_k_schedule
  else:
    if isinstance(every_k_schedule, (bool, np.bool_)) or not isinstance(
        every_k_schedule, (int, np.integer)):
      raise TypeError("`every_k_schedule` must be an int >= 1 or a function of the gradient "
                      f"step, got {every_k_schedule!r}.")
    if every_k_schedule < 1:
      raise ValueError(f"`every_k_schedule` must be >= 1, got {every_k_schedule}.")
    k_static = int(every_k_schedule)
    schedule = lambda step: jnp.asarray(k_static, jnp.int32)  # noqa: E731
  _validate.check_bool("use_grad_mean", use_grad_mean)
  _validate.check_dtype("accumulator_dtype", accumulator_dtype)
  acc_dtype = jnp.dtype(accumulator_dtype)
  inner = optax.with_extra_args_support(tx)

  def sparse_slots(names):
    """For each leaf: ``n`` if it accumulates row-sparse gradients, else ``None``."""
    unknown = sorted(set(sparse_n) - set(names))
    if unknown:
      raise ValueError(f"`ids_per_step` names {unknown}, which are not leaves of the params "
                       f"(leaves: {names}).")
    return [sparse_n.get(name) for name in names]

  def skip_view(updates):
    """What ``should_skip_update_fn`` sees: a RowSparse leaf as its merged rows' values."""
    return jax.tree.map(lambda g: g.coalesce().values if isinstance(g, RowSparse) else g,
                        updates, is_leaf=is_row_sparse)

  def init_fn(params):
    # A table wrapped in a Flax NNX variable gets its buffer in place of the variable:
    # nnx.Optimizer keeps one array per state variable, a RowSparse holds two.
    flat, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_nnx_variable)
    slots = sparse_slots([path_name(path) or "<root>" for path, _ in flat])
    leaves = [jnp.asarray(jax.tree.leaves(p)[0]) if _is_nnx_variable(p) else p for _, p in flat]
    acc = [jax.tree.map(lambda x: jnp.zeros_like(x, dtype=acc_dtype), p) if n is None
           else _no_rows(x.shape[0], k_static * n, x.shape[1:], acc_dtype)
           for (_, p), x, n in zip(flat, leaves, slots)]
    gradient_step = jnp.zeros([], jnp.int32)
    skip_state = ()
    if should_skip_update_fn is not None:
      probe = [jnp.zeros_like(x) if n is None else jnp.zeros((n, *x.shape[1:]), x.dtype)
               for x, n in zip(leaves, slots)]
      _, skip_state = should_skip_update_fn(treedef.unflatten(probe), gradient_step, params)
    return optax.MultiStepsState(
        mini_step=jnp.zeros([], jnp.int32), gradient_step=gradient_step,
        inner_opt_state=inner.init(params), acc_grads=treedef.unflatten(acc),
        skip_state=skip_state)

  def accumulate(name, g, acc, mini_step):
    """The accumulator after this micro-step's gradient ``g``."""
    if isinstance(acc, RowSparse):
      if not isinstance(g, RowSparse):
        raise TypeError(f"Leaf '{name}' is named in `ids_per_step` but got a dense gradient "
                        f"of shape {np.shape(g)}: pass its gradient as an ak.RowSparse.")
      if g.num_rows != acc.num_rows:
        raise TypeError(
            f"RowSparse gradient of '{name}' addresses {g.num_rows} rows, but its table has "
            f"{acc.num_rows}. Inside ak.offload(mode='state') the rows are renumbered each "
            "micro-step: put ak.multi_steps outside, ak.multi_steps(ak.offload(tx, "
            "mode='state'), k, ids_per_step=...).")
      n = acc.indices.shape[0] // k_static
      got = g.indices.shape[0]
      if got > n:
        raise ValueError(f"RowSparse gradient of '{name}' holds {got} ids, more than "
                         f"ids_per_step[{name!r}] = {n}.")
      pad = _no_rows(acc.num_rows, n - got, acc.values.shape[1:], acc.dtype)
      ids = jnp.concatenate([safe_ids(g.indices, g.num_rows).astype(acc.indices.dtype),
                             pad.indices])
      values = jnp.concatenate([g.values.astype(acc.dtype), pad.values])
      start = mini_step * n
      return acc.tree_unflatten(acc.num_rows, (
          jax.lax.dynamic_update_slice(acc.indices, ids, (start,)),
          jax.lax.dynamic_update_slice(acc.values, values, (start, *(0,) * (values.ndim - 1)))))
    if isinstance(g, RowSparse):
      raise TypeError(
          f"RowSparse gradient of '{name}' ({g.indices.shape[0]} ids): ak.multi_steps "
          f"accumulates it sparsely when told its size, ids_per_step={{{name!r}: "
          f"{g.indices.shape[0]}}}.")
    g = jnp.asarray(g).astype(acc.dtype)
    if use_grad_mean:  # optax's running (Welford) mean, the same numbers
      return acc + (g - acc) / (mini_step + 1).astype(acc.dtype)
    return acc + g

  def finish(acc, g, k):
    """The gradient handed to ``tx``: the mean (or sum) in the gradient's dtype."""
    if isinstance(acc, RowSparse):
      values = acc.values / k.astype(acc.dtype) if use_grad_mean else acc.values
      return RowSparse.of(acc.indices, values.astype(g.dtype), acc.num_rows)
    return acc.astype(jnp.asarray(g).dtype)

  def reset(acc):
    if isinstance(acc, RowSparse):
      return _no_rows(acc.num_rows, acc.indices.shape[0], acc.values.shape[1:], acc.dtype)
    return jnp.zeros_like(acc)

  def update_fn(updates, state, params=None, **extra):
    k = jnp.asarray(schedule(state.gradient_step), jnp.int32)
    treedef = jax.tree.structure(state.acc_grads, is_leaf=is_row_sparse)
    names = leaf_names(jax.tree.map(lambda _: 0, state.acc_grads, is_leaf=is_row_sparse))
    accs = treedef.flatten_up_to(state.acc_grads)
    try:
      grads = treedef.flatten_up_to(updates)
    except (ValueError, TypeError) as e:
      raise TypeError(f"ak.multi_steps: the gradient tree does not match the params "
                      f"({e}).") from None

    def do_update(state):
      new_acc = [accumulate(*a, state.mini_step) for a in zip(names, grads, accs)]
      emit = state.mini_step == k - 1

      def run_inner():
        mean = treedef.unflatten([finish(a, g, k) for a, g in zip(new_acc, grads)])
        return inner.update(mean, state.inner_opt_state, params, **extra)

      def hold():
        return _zeros_like_update(jax.eval_shape(run_inner)[0]), state.inner_opt_state

      new_updates, inner_state = jax.lax.cond(emit, run_inner, hold)
      kept = [jax.tree.map(lambda r, a: jnp.where(emit, r, a), reset(a), a) for a in new_acc]
      return new_updates, optax.MultiStepsState(
          mini_step=jnp.where(emit, 0, optax.safe_increment(state.mini_step)),
          gradient_step=jnp.where(emit, optax.safe_increment(state.gradient_step),
                                  state.gradient_step),
          inner_opt_state=inner_state, acc_grads=treedef.unflatten(kept),
          skip_state=state.skip_state)

    if should_skip_update_fn is None:
      return do_update(state)
    skip, skip_state = should_skip_update_fn(skip_view(updates), state.gradient_step, params)
    if (jnp.result_type(skip), jnp.shape(skip)) != (jnp.bool_, ()):
      raise ValueError("`should_skip_update_fn` must return a boolean scalar first, got "
                       f"dtype {jnp.result_type(skip)} and shape {jnp.shape(skip)}.")
    state = state._replace(skip_state=skip_state)

    def skip_update(state):
      shapes = jax.eval_shape(do_update, state)[0]
      return _zeros_like_update(shapes), state

    return jax.lax.cond(skip, skip_update, do_update, state)

  return MultiStepsTransformation(init_fn, update_fn)
