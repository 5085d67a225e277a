"""Argument checks shared by every adamkit transform.

All checks run when an optimizer is *built* (or, for tree checks, when ``init`` /
``update`` are traced), never inside the compiled step. Values that are JAX tracers
(for example hyperparameters injected by ``optax.inject_hyperparams`` inside ``jit``)
cannot be inspected and are let through; their concrete value was checked when the
optimizer was first built outside the trace.
"""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from adamkit._sparse_types import is_row_sparse
from adamkit._tree import is_tracer as _is_tracer
from adamkit._tree import path_name


def _concrete_scalar(name: str, value: Any) -> float | None:
  """Returns ``value`` as a Python float, ``None`` for a tracer; rejects non-numbers."""
  if isinstance(value, bool) or value is None:
    raise TypeError(f"`{name}` must be a real number, got {value!r} ({type(value).__name__}).")
  if isinstance(value, numbers.Real):
    return float(value)
  if isinstance(value, (jax.Array, np.ndarray, np.generic)):
    if np.ndim(value) != 0:
      raise ValueError(f"`{name}` must be a scalar, got an array of shape {np.shape(value)}.")
    if not jnp.issubdtype(value.dtype, jnp.floating) and not jnp.issubdtype(
        value.dtype, jnp.integer):
      raise TypeError(f"`{name}` must be a real number, got dtype {value.dtype}.")
    if _is_tracer(value):
      return None
    return float(value)
  raise TypeError(f"`{name}` must be a real number, got {type(value).__name__}.")


def check_open_unit(name: str, value: Any) -> None:
  """``value`` must lie in the open interval (0, 1) (betas)."""
  v = _concrete_scalar(name, value)
  if v is not None and not 0.0 < v < 1.0:
    raise ValueError(f"`{name}` must be in the open range (0.0, 1.0), got {v}.")


def check_positive(name: str, value: Any) -> None:
  """``value`` must be a finite number > 0 (eps, loss_scale, clip norms)."""
  v = _concrete_scalar(name, value)
  if v is not None and not (v > 0.0 and np.isfinite(v)):
    raise ValueError(f"`{name}` must be a finite number > 0, got {v}.")


def check_non_negative(name: str, value: Any) -> None:
  """``value`` must be a finite number >= 0 (learning rate, weight decay)."""
  v = _concrete_scalar(name, value)
  if v is not None and not (v >= 0.0 and np.isfinite(v)):
    raise ValueError(f"`{name}` must be a finite number >= 0, got {v}.")


def check_bool(name: str, value: Any) -> None:
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"`{name}` must be a bool, got {value!r} ({type(value).__name__}).")


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
  if value not in choices:
    raise ValueError(f"`{name}` must be one of {choices}, got {value!r}.")


def check_float_params(params: Any, what: str = "params") -> None:
  """Rejects integer, boolean and complex parameter leaves with the leaf's name."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    dtype = getattr(leaf, "dtype", None)
    if dtype is None:
      dtype = np.result_type(leaf)
    if not jnp.issubdtype(dtype, jnp.floating):
      raise TypeError(
          f"adamkit optimizes floating-point parameters only; {what} leaf "
          f"'{path_name(path) or '<root>'}' has dtype {dtype}. Keep integer or boolean "
          "arrays out of the optimized tree (e.g. with optax.masked or optax.partition "
          "and optax.set_to_zero).")


def check_matching_trees(updates: Any, reference: Any, *, what: str = "params") -> None:
  """Raises a ValueError if ``updates`` and ``reference`` differ in structure or shapes."""
  if reference is None:
    return
  # A RowSparse gradient stands for its whole table: one leaf of shape (num_rows, ...).
  u_def = jax.tree.structure(updates, is_leaf=is_row_sparse)
  r_def = jax.tree.structure(reference)
  if u_def != r_def:
    raise ValueError(
        f"The gradient tree does not match the {what} tree.\n"
        f"  gradients: {u_def}\n  {what}: {r_def}")
  flat = jax.tree_util.tree_flatten_with_path(updates, is_leaf=is_row_sparse)[0]
  for (path, u), r in zip(flat, jax.tree.leaves(reference)):
    if np.shape(u) != np.shape(r):
      raise ValueError(
          f"Gradient '{path_name(path) or '<root>'}' has shape {np.shape(u)} but the "
          f"matching {what} leaf has shape {np.shape(r)}.")


def check_dense_grads(updates: Any, optimizer: str) -> None:
  """Raises a TypeError naming the first :class:`adamkit.RowSparse` leaf: ``optimizer``
  takes dense gradients only."""
  flat = jax.tree_util.tree_flatten_with_path(updates, is_leaf=is_row_sparse)[0]
  for path, leaf in flat:
    if is_row_sparse(leaf):
      raise TypeError(
          f"{optimizer} takes dense gradients, but '{path_name(path) or '<root>'}' is a "
          "RowSparse. Use ak.sparse_adam (lazy=False is MindSpore nn.Adam's FusedSparseAdam, "
          "lazy=True its FusedSparseLazyAdam) or ak.fused_adam (for AdamW: ak.sparse_adamw or "
          "ak.fused_adamw), or densify with `g.todense()`.")
