"""Mixed precision: float32 master weights for low-precision params, float32 hyperparameters.

* :func:`master_weights` (Paddle ``multi_precision=True``): bf16/fp16 params keep a float32
  copy in the optimizer state; the inner optimizer sees float32 gradients and the float32
  copy, and the params follow the copy.
* :func:`inject_hyperparams`: ``optax.inject_hyperparams`` with the hyperparameters kept in
  float32 whatever the params' dtype (optax casts them to the params' dtype, and bf16 rounds
  ``b2 = 0.999`` to ``1.0``: Adam's second moment then never forgets).
* Low-precision moments are options of the primitives: ``scale_by_adam(mu_dtype=...,
  nu_dtype=...)`` and the named optimizers that wrap it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from adamkit import _validate
from adamkit._fused import FusedStep
from adamkit._sparse_types import RowSparse, gather_rows, map_values, safe_ids, scatter_rows


class MasterWeightsState(NamedTuple):
  master: optax.Params  # float32 copy of each low-precision leaf; float32/64 leaves: None
  inner: optax.OptState  # the wrapped optimizer's state, built on the float32 tree


def _is_low(leaf) -> bool:
  return leaf is not None and jnp.finfo(leaf.dtype).bits < 32


def master_weights(tx: optax.GradientTransformation, *,
                   master_dtype: Any = jnp.float32) -> optax.GradientTransformation:
  r"""Keeps a float32 master copy of low-precision params and updates it in float32.

  For each leaf with fewer than 32 bits (bf16, fp16):

  .. math::

    \hat w &\leftarrow \text{master copy (float32) of } w \\
    u, s &\leftarrow \mathrm{tx.update}(\mathrm{f32}(g), s, \hat w) \\
    \hat w &\leftarrow \hat w + u \\
    \Delta &= \mathrm{f32}(\mathrm{cast}(\hat w)) - \mathrm{f32}(w) \quad\text{returned, in the
      param's dtype}

  so ``optax.apply_updates(params, updates)`` gives the master cast to the param's dtype
  (exactly whenever a weight changes by less than a factor of two in one step, the ordinary
  case; otherwise within one unit in the last place of the low-precision type). float32 and
  float64 leaves pass straight through to ``tx``. The inner state is built on the float32
  tree, so Adam's moments are float32 unless ``tx`` asks otherwise (``mu_dtype``).

  .. warning::
    Paddle's ``multi_precision`` writes the cast master into the param in place; under the
    optax protocol the params move by the returned updates instead, and the master copy in
    the state is the source of truth: a param overwritten outside the optimizer is ignored
    (the master is re-read from the params only at ``init``).

  A :class:`adamkit.FusedStep` (``ak.fused_adam(...)``; Paddle ``multi_precision`` with
  ``use_multi_tensor``) gives a ``FusedStep`` again: its ``update`` is the above, and its
  ``step(params, state, grads=grads) -> (params, state)`` runs the fused step on the float32
  tree and writes each low-precision param as its new master, cast (Paddle's rule).

  Args:
    tx: any optax transformation (e.g. ``ak.adam(...)``), or a fused step.
    master_dtype: dtype of the master copy (float32).

  Returns:
    An ``optax.GradientTransformation`` with state :class:`MasterWeightsState` (a
    :class:`adamkit.FusedStep` when ``tx`` is one).

  Examples:
    >>> import jax.numpy as jnp, optax, adamkit as ak
    >>> tx = ak.master_weights(ak.adam(1e-4))
    >>> params = {"w": jnp.ones(2, jnp.bfloat16)}
    >>> state = tx.init(params)
    >>> for _ in range(10):  # 1e-4 steps vanish in bf16 (spacing 2**-7 at 1.0) ...
    ...   updates, state = tx.update({"w": jnp.ones(2, jnp.bfloat16)}, state, params)
    ...   params = optax.apply_updates(params, updates)
    >>> print(f"{float(state.master['w'][0]):.4f}")  # ... but add up in the float32 master
    0.9990
    >>> params["w"]  # 1 - 1e-3 rounds back to 1.0 in bf16
    Array([1, 1], dtype=bfloat16)

  References:
    Micikevicius et al., "Mixed Precision Training", ICLR 2018. Reproduces PaddlePaddle
    ``optimizer.Adam(multi_precision=True)``.
  """
  _validate.check_dtype("master_dtype", master_dtype)
  master_dtype = jnp.dtype(master_dtype)

  def to_master(p):
    return p.astype(master_dtype) if _is_low(p) else None

  def full(master, params):
    return jax.tree.map(lambda m, p: p if m is None else m, master, params,
                        is_leaf=lambda x: x is None)

  def init_fn(params):
    _validate.check_float_params(params)
    master = jax.tree.map(to_master, params)
    return MasterWeightsState(master=master, inner=tx.init(full(master, params)))

  def update_fn(updates, state, params=None, **extra):
    if params is None:
      raise ValueError("master_weights needs `params`: call `update(grads, state, params)`.")
    _validate.check_matching_trees(updates, params)
    full_params = full(state.master, params)
    to32 = lambda x: x.astype(master_dtype)  # noqa: E731
    grads32 = jax.tree.map(lambda m, g: g if m is None else map_values(to32, g), state.master,
                           updates, is_leaf=lambda x: x is None)
    inner_upd, inner = tx.update(grads32, state.inner, full_params, **extra)

    none = lambda x: x is None  # noqa: E731

    def advance(u, m):
      if m is None:
        return None
      if isinstance(u, RowSparse):  # lazy sparse step: only the touched rows of the master
        return scatter_rows(m, safe_ids(u.indices, u.num_rows), u.values, add=True)
      return (m + u.astype(master_dtype)).astype(master_dtype)

    def delta(new_master, p, u):
      if new_master is None:
        return u
      if isinstance(u, RowSparse):  # a RowSparse update of the same rows, O(k)
        ids = safe_ids(u.indices, u.num_rows)
        rows = gather_rows(new_master, ids)
        d = rows.astype(p.dtype).astype(master_dtype) - gather_rows(p, ids).astype(master_dtype)
        return u.with_values(d.astype(p.dtype))
      d = new_master.astype(p.dtype).astype(master_dtype) - p.astype(master_dtype)
      return d.astype(p.dtype)

    master = jax.tree.map(lambda m, u: advance(u, m), state.master, inner_upd, is_leaf=none)
    new_updates = jax.tree.map(delta, master, params, inner_upd, is_leaf=none)
    return new_updates, MasterWeightsState(master=master, inner=inner)

  if not isinstance(tx, FusedStep):
    return optax.GradientTransformationExtraArgs(init_fn, update_fn)

  def step_fn(params, state, grads):
    """Paddle ``multi_precision`` with ``use_multi_tensor``: the fused step on the float32
    tree, then each low-precision param is its new master, cast (a whole-table cast for a
    row-sparse leaf: rows the step did not touch cast back to the same bits)."""
    _validate.check_matching_trees(grads, params)
    to32 = lambda x: x.astype(master_dtype)  # noqa: E731
    grads32 = jax.tree.map(lambda m, g: g if m is None else map_values(to32, g), state.master,
                           grads, is_leaf=lambda x: x is None)
    full_new, inner = tx.step(full(state.master, params), state.inner, grads=grads32)
    none = lambda x: x is None  # noqa: E731
    master = jax.tree.map(lambda m, n: None if m is None else n, state.master, full_new,
                          is_leaf=none)

    new_params = jax.tree.map(lambda m, p, new: new if m is None else m.astype(p.dtype),
                              master, params, full_new, is_leaf=none)
    return new_params, MasterWeightsState(master=master, inner=inner)

  return FusedStep(init_fn, step_fn, update_fn)


def inject_hyperparams(inner_factory: Callable[..., optax.GradientTransformation],
                       static_args: str | tuple[str, ...] = (), *,
                       hyperparam_dtype: Any = jnp.float32
                       ) -> Callable[..., optax.GradientTransformation]:
  r"""``optax.inject_hyperparams`` with float32 hyperparameters by default.

  .. math::

    \theta_t = \mathrm{f32}(h(t)) \quad\text{for every numeric or scheduled hyperparameter}

  optax stores injected hyperparameters in the params' dtype when ``hyperparam_dtype`` is
  not given: with bf16 params, ``b2=0.999`` becomes ``1.0`` and ``eps=1e-8`` stays but
  ``b1=0.9`` becomes ``0.8984375``. adamkit's transforms compute bias corrections and
  moment decays in float32, so the hyperparameters must reach them in float32 too.

  .. warning::
    Differs from ``optax.inject_hyperparams`` only in the default of ``hyperparam_dtype``.

  Args:
    inner_factory: a function returning a transformation, e.g. ``ak.adam``.
    static_args: names of arguments that are not hyperparameters (strings, bools).
    hyperparam_dtype: dtype of the injected values (float32).

  Returns:
    The wrapped factory; its state has a ``hyperparams`` dict, as optax's.

  Examples:
    >>> import jax.numpy as jnp, adamkit as ak
    >>> tx = ak.inject_hyperparams(ak.adam, static_args=("eps_mode",))(
    ...     learning_rate=1e-3, b2=0.999, eps_mode="corrected")
    >>> state = tx.init({"w": jnp.ones(3, jnp.bfloat16)})
    >>> state.hyperparams["b2"]
    Array(0.999, dtype=float32)
  """
  return optax.inject_hyperparams(inner_factory, static_args=static_args,
                                  hyperparam_dtype=jnp.dtype(hyperparam_dtype))
