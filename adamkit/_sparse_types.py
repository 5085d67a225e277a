"""The row-sparse gradient type.

Kept free of other adamkit imports (but the dependency-free ``_dtypes``) so that the core
chain links (``_links``, ``_validate``) can recognise a :class:`RowSparse` leaf without an
import cycle.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

from adamkit._dtypes import compute_dtype
from adamkit._tree import is_tracer


def check_ids(indices: Any, num_rows: int, *, indices_name: str = "indices",
              table_name: str = "the table") -> jax.Array:
  """Validates 1-D integer row ids; returns them as a JAX array (int32 when they fit).

  Concrete (non-traced) ids are range-checked here, on the host, *before* any cast, so an
  int64 id past int32 cannot wrap onto a valid row.
  """
  if not hasattr(indices, "dtype"):
    indices = np.asarray(indices)
  if not (jnp.issubdtype(indices.dtype, jnp.integer)
          and not jnp.issubdtype(indices.dtype, jnp.bool_)):
    raise TypeError(
        f"`{indices_name}` must be an integer array (int32 or int64) of row ids, got dtype "
        f"{indices.dtype}.")
  if np.ndim(indices) != 1:
    raise ValueError(
        f"`{indices_name}` must be 1-D, shape (k,), got shape {np.shape(indices)}.")
  if not is_tracer(indices):
    host = np.asarray(indices)
    bad = np.flatnonzero((host < 0) | (host >= num_rows))
    if bad.size:
      pos = int(bad[0])
      raise ValueError(
          f"`{indices_name}` holds row id {int(host[pos])} (position {pos}), outside "
          f"{table_name} of {num_rows} rows: ids must lie in [0, {num_rows}). Inside jit "
          "such ids are dropped; see adamkit.check_row_ids for a checkify check.")
    if host.dtype != np.int32 and num_rows <= np.iinfo(np.int32).max:
      indices = host.astype(np.int32)
  return jnp.asarray(indices)


def check_row_args(indices: Any, values: Any, num_rows: int, *, indices_name: str = "indices",
                   values_name: str = "values", row_shape: tuple | None = None,
                   table_name: str = "the table"):
  """Validates one row-sparse gradient; returns ``(indices, values)`` as JAX arrays."""
  if not hasattr(values, "dtype"):
    values = np.asarray(values, dtype=np.float32)
  indices = check_ids(indices, num_rows, indices_name=indices_name, table_name=table_name)
  if not jnp.issubdtype(values.dtype, jnp.floating):
    raise TypeError(f"`{values_name}` must be a floating-point array, got dtype {values.dtype}.")
  k = indices.shape[0]
  if np.ndim(values) < 1 or np.shape(values)[0] != k:
    raise ValueError(
        f"`{values_name}` must have shape (k, *row_shape) with k = len({indices_name}) = {k}, "
        f"got shape {np.shape(values)}.")
  if row_shape is not None and tuple(np.shape(values)[1:]) != tuple(row_shape):
    raise ValueError(
        f"`{values_name}` rows have shape {tuple(np.shape(values)[1:])} but the rows of "
        f"{table_name} have shape {tuple(row_shape)}: expected `{values_name}` of shape "
        f"({k}, *{tuple(row_shape)}).")
  return indices, jnp.asarray(values)


def _check_num_rows(num_rows: Any) -> int:
  if isinstance(num_rows, (bool, np.bool_)) or not isinstance(num_rows, numbers.Integral):
    raise TypeError(f"`num_rows` must be a Python int >= 0 (a static table size), got "
                    f"{num_rows!r} ({type(num_rows).__name__}).")
  if num_rows < 0:
    raise ValueError(f"`num_rows` must be >= 0, got {num_rows}.")
  return int(num_rows)


def safe_ids(indices: jax.Array, num_rows: int) -> jax.Array:
  """Maps every id outside ``[0, num_rows)`` to ``num_rows``.

  JAX wraps negative indices Python-style, so ``-1`` would reach the last row; after this
  every bad id is one past the end, which ``mode="drop"`` scatters ignore and
  ``mode="fill"`` gathers read as zero. Ids too narrow to hold ``num_rows`` (int8 ids of a
  300-row table) widen to int32 first.
  """
  if num_rows > jnp.iinfo(indices.dtype).max:
    indices = indices.astype(jnp.int32 if num_rows <= np.iinfo(np.int32).max else jnp.int64)
  valid = (indices >= 0) & (indices < num_rows)
  return jnp.where(valid, indices, jnp.asarray(num_rows, indices.dtype))


# ------------------------------------------------------------- the protected id leaf
#
# A RowSparse's ids must be a pytree leaf (they cross jit), so every jax.tree.map and optax
# transform visits them. Held as plain integers they would silently follow arithmetic
# meant for the values (``x * 3`` moves id 2 to row 6, ``g1 + g2`` adds ids). They are
# therefore held in an extended dtype, ``key<adamkit.RowSparse.indices -- ...>``, built with
# JAX's public PRNG-implementation API: JAX refuses every arithmetic, comparison and cast on
# it (``multiply does not accept dtypes key<adamkit.RowSparse.indices -- ...>, int32``) while
# reshaping, slicing, concatenation, ``where``, ``zeros_like``, ``isnan`` and
# ``isfinite`` work (so ``optax.zero_nans`` and ``optax.apply_if_finite`` pass the ids
# through), and jit, vmap, scan, device_put and shardings carry it. The integers are its
# key data (one uint32 word per 32-bit id, two per 64-bit id), bit-cast; no copy under jit.

# The dtype's name is what JAX prints when it refuses an operation, so it says what to do.
_ID_TAG = ("adamkit.RowSparse.indices -- transform the values instead: "
           "ak.sparse_adam(grad_clip=, loss_scale=), ak.multi_steps, RowSparse.with_values")


def _not_a_key(*args, **kwargs):
  raise TypeError("An adamkit.RowSparse.indices array holds row ids, not a random key: "
                  "read RowSparse.indices for the integers.")


@functools.cache
def _id_impl(words: int):
  impl = jax.extend.random.define_prng_impl(
      key_shape=(words,), seed=_not_a_key, split=_not_a_key, random_bits=_not_a_key,
      fold_in=_not_a_key, name=f"adamkit_row_ids_{32 * words}", tag=_ID_TAG)
  dtype = jax.random.wrap_key_data(np.zeros((0, words), np.uint32), impl=impl).dtype
  return impl, dtype


def _id_words(dtype) -> int | None:
  """1 or 2 if ``dtype`` is adamkit's 32- or 64-bit id dtype, else ``None``."""
  if not jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    return None
  for words in (1, 2):
    if dtype == _id_impl(words)[1]:
      return words
  return None


def wrap_ids(ids: Any) -> jax.Array:
  """Integer row ids as the protected ``key<adamkit.RowSparse.indices>`` leaf."""
  if _id_words(getattr(ids, "dtype", np.int32)) is not None:
    return ids
  ids = jnp.asarray(ids)
  if ids.dtype.itemsize < 4:
    ids = ids.astype(jnp.int32)
  words = ids.dtype.itemsize // 4
  bits = jax.lax.bitcast_convert_type(ids, jnp.uint32)
  if words == 1:
    bits = bits[..., None]
  return jax.random.wrap_key_data(bits, impl=_id_impl(words)[0])


def unwrap_ids(leaf: Any) -> Any:
  """The integers of a protected id leaf (int32, or int64 for 64-bit ids); any other leaf
  (plain integer ids, a placeholder JAX passed through the pytree protocol) unchanged."""
  words = _id_words(getattr(leaf, "dtype", np.int32))
  if words is None:
    return leaf
  dtype = jnp.int32 if words == 1 else jnp.int64
  if isinstance(leaf, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct(leaf.shape, dtype, sharding=leaf.sharding)
  bits = jax.random.key_data(leaf)
  if words == 1:
    bits = bits[..., 0]
  return jax.lax.bitcast_convert_type(bits, dtype)


def _explicit_sharding(x: Any):
  """``x``'s sharding when it lives on a mesh with Explicit axes, else ``None``.

  With explicit sharding (the default of ``jax.make_mesh`` since JAX 0.7), a gather from or
  scatter into a row-sharded table must be told its output sharding.
  """
  sharding = getattr(jax.typeof(x), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or jax.sharding.AxisType.Explicit not in getattr(mesh, "axis_types", ()):
    return None
  return sharding


def gather_rows(x: jax.Array, ids: jax.Array) -> jax.Array:
  """``x[ids]`` for safe ids (see :func:`safe_ids`); the id ``N`` reads a row of zeros.

  Under explicit sharding the gathered rows come out replicated.
  """
  if x.shape[0] == 0:  # an empty table: every id is out of range (XLA cannot gather from it)
    return jnp.zeros((ids.shape[0], *x.shape[1:]), x.dtype)
  sharding = _explicit_sharding(x)
  kw = {}
  if sharding is not None:
    kw["out_sharding"] = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
  return x.at[ids].get(mode="fill", fill_value=0, **kw)


def scatter_rows(x: jax.Array, ids: jax.Array, rows: jax.Array, *, add: bool = False):
  """``x[ids] = rows`` (or ``+=`` with ``add``) for safe ids; the id ``N`` is dropped.

  Keeps ``x``'s sharding, so a donated table is updated in place.
  """
  sharding = _explicit_sharding(x)
  kw = {} if sharding is None else {"out_sharding": sharding}
  ref = x.at[ids]
  op = ref.add if add else ref.set
  return op(rows.astype(x.dtype), mode="drop", **kw)


@jax.tree_util.register_pytree_with_keys_class
class RowSparse:
  r"""A row-sparse gradient of an ``(num_rows, *row_shape)`` table.

  Densified, it is :math:`G[i] = \sum_{j:\,\mathrm{indices}_j = i} \mathrm{values}_j`:
  duplicate ids are allowed and add up (MindSpore ``RowTensor``, TensorFlow
  ``IndexedSlices``, a coalesced or uncoalesced ``torch.sparse_coo`` with one sparse dim).

  A pytree whose children are the ids and ``values``; ``num_rows`` is static. adamkit's
  links treat a ``RowSparse`` as one leaf standing for the whole table.

  .. note::
    The ids must be a pytree leaf (they cross ``jit``), so ``jax.tree.map`` and optax's
    gradient transforms visit them. So that no such map can move a gradient to other rows,
    the leaf is not an integer array but a JAX extended dtype,
    ``key<adamkit.RowSparse.indices -- ...>``, on which JAX refuses every arithmetic
    operation (``TypeError``) and cast (``ValueError``) at trace time:
    ``jax.tree.map(lambda x: x * 3, g)``, ``jax.tree.map(jnp.add, g1, g2)``,
    ``optax.scale``, ``optax.clip`` and ``optax.clip_by_global_norm`` before a sparse
    optimizer all raise, and the dtype's name in the message says what to use instead
    (outside ``jit``, a global norm fails earlier, with JAX's ``NotImplementedError:
    Cannot call abstract method real``). Operations that keep the ids (``jit``, ``vmap``,
    ``device_put``, shardings, ``where``, ``zeros_like``, ``isnan``) work, so
    ``optax.zero_nans`` and ``optax.apply_if_finite`` pass a ``RowSparse`` through. Read
    the integer ids as :attr:`indices`; change the values with :meth:`with_values`; add
    two gradients with ``g1 + g2`` (ids and values concatenated); scale, clip, accumulate
    and skip with ``ak.sparse_adam(loss_scale=, grad_clip=, nonfinite=)`` and
    :func:`adamkit.multi_steps` (``optax.MultiSteps`` cannot: its accumulator is a dense
    table, and JAX refuses the pair with a pytree structure error). Unlike MindSpore's
    ``RowTensor.indices``, the leaf is not an integer tensor; :attr:`indices` is.
    Optimizer states that keep a ``RowSparse`` (``ak.multi_steps``'s accumulator) hold
    plain integer ids, so orbax saves them.

  Args:
    indices: int32/int64 row ids, shape ``(k,)``.
    values: one row of gradient per id, shape ``(k, *row_shape)``, floating point.
    num_rows: number of rows of the table, a Python int.

  Raises:
    TypeError: float or boolean ``indices``, non-float ``values``, non-int ``num_rows``.
    ValueError: ``values.shape[0] != len(indices)``; outside jit, an id outside
      ``[0, num_rows)`` (the message names it). Inside jit ids are not checked: such
      rows are dropped by adamkit (see :func:`adamkit.check_row_ids`).

  Examples:
    >>> import jax.numpy as jnp, adamkit as ak
    >>> g = ak.RowSparse(jnp.array([2, 0, 2]), jnp.ones((3, 2)), num_rows=4)
    >>> g.shape
    (4, 2)
    >>> g.todense()[:, 0]
    Array([1., 0., 2., 0.], dtype=float32)
  """

  __slots__ = ("_ids", "_plain", "values", "num_rows")

  def __init__(self, indices: Any, values: Any, num_rows: int):
    if isinstance(indices, (list, tuple)) and any(np.ndim(i) > 0 for i in indices):
      raise TypeError("`indices` must be one 1-D integer array of row ids, got a "
                      f"{type(indices).__name__} of arrays: concatenate them first.")
    num_rows = _check_num_rows(num_rows)
    indices, values = check_row_args(indices, values, num_rows)
    self._ids, self._plain = wrap_ids(indices), indices
    self.values = values
    self.num_rows = num_rows

  @classmethod
  def of(cls, indices: jax.Array, values: jax.Array, num_rows: int) -> RowSparse:
    """A ``RowSparse`` from integer ids and values without any check (works under jit).

    The ids are wrapped in the protected leaf type (see the class docstring); for trusted
    ids built by code, e.g. a custom lookup's gradient.
    """
    obj = object.__new__(cls)
    obj._ids, obj._plain = wrap_ids(indices), indices
    obj.values, obj.num_rows = values, num_rows
    return obj

  @property
  def indices(self) -> jax.Array:
    """The row ids, an int32 (int64 for tables past 2**31 rows) array of shape ``(k,)``."""
    if self._plain is not None:
      return self._plain
    return unwrap_ids(self._ids)

  # -- pytree protocol: no validation, JAX passes placeholders through here.
  def tree_flatten(self):
    return (self._ids, self.values), self.num_rows

  def tree_flatten_with_keys(self):
    # named children: a state holding a RowSparse saves 'emb.indices', not 'emb.0'
    keys = (jax.tree_util.GetAttrKey("indices"), jax.tree_util.GetAttrKey("values"))
    return tuple(zip(keys, (self._ids, self.values))), self.num_rows

  @classmethod
  def tree_unflatten(cls, num_rows, children):
    obj = object.__new__(cls)
    obj._ids, obj.values = children
    obj._plain = None
    obj.num_rows = num_rows
    return obj

  @property
  def shape(self) -> tuple[int, ...]:
    """The dense shape ``(num_rows, *row_shape)``."""
    return (self.num_rows, *self.values.shape[1:])

  @property
  def dtype(self):
    return self.values.dtype

  @property
  def ndim(self) -> int:
    return len(self.shape)

  def with_values(self, values: jax.Array) -> RowSparse:
    """The same ids with new values (no checks, works under jit)."""
    obj = RowSparse.tree_unflatten(self.num_rows, (self._ids, values))
    obj._plain = self._plain
    return obj

  def todense(self, like: jax.Array | None = None) -> jax.Array:
    """The dense ``(num_rows, *row_shape)`` array; duplicates summed, bad ids dropped.

    ``like``: an array of that shape whose sharding the result takes (e.g. the table).
    """
    ids = safe_ids(self.indices, self.num_rows)
    if like is None:
      zeros = jnp.zeros(self.shape, self.values.dtype)
    else:
      zeros = jnp.zeros_like(like, dtype=self.values.dtype)
    return scatter_rows(zeros, ids, self.values, add=True)

  def __add__(self, other: Any) -> Any:
    """``dense + sparse``: the dense array with the rows added (duplicates add up, ids
    outside ``[0, num_rows)`` dropped), so ``optax.apply_updates`` and ``nnx.Optimizer``
    apply a lazy sparse update in ``O(k)``; ``sparse + sparse``: the ids and values
    concatenated (the sum, uncoalesced)."""
    if isinstance(other, RowSparse):
      if other.shape != self.shape:
        raise ValueError(f"Cannot add RowSparse gradients of dense shapes {self.shape} and "
                         f"{other.shape}.")
      ids = jnp.concatenate([self.indices, other.indices.astype(self.indices.dtype)])
      values = jnp.concatenate([self.values, other.values.astype(self.values.dtype)])
      return RowSparse.of(ids, values, self.num_rows)
    if not hasattr(other, "shape") or tuple(other.shape) != self.shape:
      return NotImplemented
    return scatter_rows(jnp.asarray(other), safe_ids(self.indices, self.num_rows), self.values,
                        add=True)

  __radd__ = __add__

  def coalesce(self) -> RowSparse:
    """Merges duplicate ids (values summed) with static shapes, so it works under jit.

    The result has the same length ``k``: sorted unique ids first, then unused slots
    holding the out-of-range id ``num_rows`` with zero values, which adamkit's scatters
    drop. Ids outside ``[0, num_rows)`` end up in those slots too.
    """
    k = self.indices.shape[0]
    if k == 0:
      return self
    ids = safe_ids(self.indices, self.num_rows)
    # A one-operand sort plus a binary search: on XLA:CPU about 3x faster than the
    # two-operand (key, position) sort behind jnp.unique(return_inverse=True).
    srt = jax.lax.sort(ids)
    first = jnp.concatenate([jnp.ones((1,), bool), srt[1:] != srt[:-1]])
    slot = jnp.cumsum(first) - 1
    uniq = jnp.full((k,), self.num_rows, ids.dtype).at[slot].set(srt)  # sorted, fill last
    inverse = jnp.searchsorted(uniq, ids)
    wide = compute_dtype(self.values)
    summed = jax.ops.segment_sum(self.values.astype(wide), inverse, num_segments=k)
    return RowSparse.of(uniq, summed.astype(self.values.dtype), self.num_rows)

  def __repr__(self):
    return (f"RowSparse(num_rows={self.num_rows}, k={self.indices.shape[0]}, "
            f"row_shape={tuple(self.values.shape[1:])}, dtype={self.values.dtype})")


def is_row_sparse(x: Any) -> bool:
  """``is_leaf`` predicate: a :class:`RowSparse` counts as one leaf."""
  return isinstance(x, RowSparse)


def map_values(fn: Callable[[jax.Array], jax.Array], g: Any) -> Any:
  """``fn(g)`` for a dense leaf, ``fn`` applied to the values of a :class:`RowSparse`.

  Right for every element-wise or per-row map ``fn`` with ``fn(0) = 0`` (scaling, the
  learning rate, per-row centralization), given coalesced ids.
  """
  if isinstance(g, RowSparse):
    return g.with_values(fn(g.values))
  return fn(g)
