"""Row-sparse gradients of a loss that looks rows up in embedding tables.

``jax.grad`` of ``table[ids]`` is a dense ``(N, D)`` array, mostly zeros. Here the rows
are gathered *outside* the differentiated function and the loss is differentiated with
respect to them, so the table's gradient is a :class:`adamkit.RowSparse` of ``k`` rows and
no ``(N, D)`` array is ever made.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from adamkit import _validate
from adamkit._sparse_types import RowSparse, check_ids, gather_rows, safe_ids


@jax.tree_util.register_pytree_node_class
class GatheredRows:
  """Stands for a table inside :func:`value_and_sparse_grad`: the rows already looked up.

  Only :func:`lookup` with the ids given to ``value_and_sparse_grad`` may read it; any
  other use of the table (a tied output layer, a norm over the whole table) fails loudly.
  """

  __slots__ = ("rows", "num_rows", "ids_shape")

  def __init__(self, rows, num_rows: int, ids_shape: tuple[int, ...]):
    self.rows = rows  # (prod(ids_shape), *row_shape)
    self.num_rows = num_rows
    self.ids_shape = ids_shape

  def tree_flatten(self):
    return (self.rows,), (self.num_rows, self.ids_shape)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(children[0], *aux)

  @property
  def shape(self):
    return (self.num_rows, *self.rows.shape[1:])

  @property
  def dtype(self):
    return self.rows.dtype

  def _refuse(self, *args, **kwargs):
    raise TypeError(
        "value_and_sparse_grad: a table named in `ids` was read other than through "
        "ak.lookup (Flax's nnx.Embed reads `self.embedding[...]`). Look it up with "
        "`ak.lookup(self.embedding, ids)` inside the module; see docs/nnx.md.")

  __getitem__ = __array__ = __jax_array__ = _refuse

  def __repr__(self):
    return f"GatheredRows(num_rows={self.num_rows}, ids_shape={self.ids_shape})"


def lookup(table: Any, ids: Any) -> jax.Array:
  """Embedding lookup ``table[ids]``, shape ``ids.shape + table.shape[1:]``.

  Use it in a loss given to :func:`value_and_sparse_grad`; it is also an ordinary lookup
  (differentiable by ``jax.grad``, which then gives a dense gradient). Ids outside
  ``[0, N)`` read zeros, consistently with adamkit's scatters, which drop them.

  Args:
    table: an ``(N, *row_shape)`` array, a Flax NNX variable holding one (``nnx.Param``;
      write ``ak.lookup(self.embedding, ids)`` in a module), or the stand-in
      ``value_and_sparse_grad`` passes.
    ids: integer ids of any shape.

  Returns:
    The looked-up rows.
  """
  ids = jnp.asarray(ids)
  if hasattr(table, "get_value") and not isinstance(table, jax.Array):  # an nnx.Variable
    table = table.get_value()
  if isinstance(table, GatheredRows):
    if tuple(ids.shape) != table.ids_shape:
      raise ValueError(
          f"lookup() got ids of shape {tuple(ids.shape)} but value_and_sparse_grad gathered "
          f"rows for ids of shape {table.ids_shape}: look a table up once, with the ids "
          "passed to value_and_sparse_grad.")
    return table.rows.reshape(ids.shape + table.rows.shape[1:])
  if np.ndim(table) < 1:
    raise ValueError(f"lookup() needs a table of at least 1 dimension, got shape "
                     f"{np.shape(table)}.")
  return gather_rows(table, safe_ids(ids, table.shape[0]))


def value_and_sparse_grad(fun: Callable[..., Any], *, has_aux: bool = False) -> Callable:
  r"""Like ``jax.value_and_grad(fun)``, with :class:`adamkit.RowSparse` table gradients.

  ``fun(params, *args)`` must read each table named in ``ids`` once, through
  :func:`lookup`. The returned function ``(params, ids, *args) -> (value, grads)`` gathers
  ``r = table[ids]`` first, differentiates ``fun`` with respect to ``r`` and the other
  params, and returns for that table :math:`\mathrm{RowSparse}(\mathrm{ids},
  \partial f / \partial r, N)`: cost ``O(k D)``, never ``O(N D)``.

  Args:
    fun: the loss, ``fun(params, *args) -> scalar`` (or ``(scalar, aux)``).
    has_aux: as in ``jax.value_and_grad``.

  Returns:
    A function ``(params, ids, *args, **kwargs) -> (value, grads)`` where ``ids`` maps the
    dotted path of each table leaf (``"embed"``, ``"tower.items"``) to its integer ids of
    any shape (flattened into the ``RowSparse``; duplicates are fine). Outside jit an id
    outside ``[0, N)`` raises ``ValueError``.

  Examples:
    >>> import jax, jax.numpy as jnp, adamkit as ak
    >>> params = {"embed": jnp.zeros((1_000_000, 8)), "w": jnp.ones(8)}  # 1M-row table
    >>> def loss(params, ids):
    ...   x = ak.lookup(params["embed"], ids)          # (batch, 8)
    ...   return jnp.mean((x @ params["w"] - 1.0) ** 2)
    >>> ids = jnp.array([5, 999_999, 5])
    >>> grad_fn = jax.jit(ak.value_and_sparse_grad(loss))
    >>> value, grads = grad_fn(params, {"embed": ids}, ids)
    >>> grads["embed"]
    RowSparse(num_rows=1000000, k=3, row_shape=(8,), dtype=float32)
    >>> tx = ak.sparse_adam(0.01)
    >>> updates, _ = tx.update(grads, tx.init(params), params)
    >>> new = ak.apply_updates(params, updates)
    >>> new["embed"][jnp.array([4, 5]), 0]
    Array([0.  , 0.01], dtype=float32)
  """

  def wrapped(params, ids: Mapping[str, Any], *args, **kwargs):
    if not isinstance(ids, Mapping):
      raise TypeError("`ids` must map the dotted path of each table leaf to its ids, e.g. "
                      f"{{'embed': batch_ids}}; got {type(ids).__name__}.")
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    names = [_validate.path_name(path) for path, _ in flat]
    unknown = sorted(set(ids) - set(names))
    if unknown:
      raise ValueError(f"`ids` names {unknown}, which are not leaves of params; leaves are "
                       f"{names}.")
    stand_in, flat_ids = [], {}
    for name, (_, leaf) in zip(names, flat):
      if name not in ids:
        stand_in.append(leaf)
        continue
      if np.ndim(leaf) < 1:
        raise ValueError(f"Table '{name}' must have at least 1 dimension, got shape "
                         f"{np.shape(leaf)}.")
      i = ids[name] if hasattr(ids[name], "dtype") else np.asarray(ids[name])
      flat_ids[name] = check_ids(i.reshape(-1), leaf.shape[0], indices_name=f"ids[{name!r}]",
                                 table_name=f"table '{name}'")
      rows = lookup(leaf, flat_ids[name])
      stand_in.append(GatheredRows(rows, leaf.shape[0], tuple(np.shape(i))))
    value, grads = jax.value_and_grad(fun, has_aux=has_aux)(
        treedef.unflatten(stand_in), *args, **kwargs)
    out = []
    for name, g in zip(names, treedef.flatten_up_to(grads)):
      if name in flat_ids:
        g = RowSparse.of(flat_ids[name], g.rows, g.num_rows)
      out.append(g)
    return value, treedef.unflatten(out)

  return wrapped


def sparse_grad(fun: Callable[..., Any], *, has_aux: bool = False) -> Callable:
  """:func:`value_and_sparse_grad` without the value: ``(params, ids, *args) -> grads``
  (``(grads, aux)`` with ``has_aux``)."""
  vg = value_and_sparse_grad(fun, has_aux=has_aux)

  def wrapped(params, ids, *args, **kwargs):
    value, grads = vg(params, ids, *args, **kwargs)
    return (grads, value[1]) if has_aux else grads

  return wrapped
