"""Lazy Adam on an embedding table row-sharded over D devices: each shard updates its rows.

A table of ``N`` rows whose sharding splits the rows over ``D`` devices (spec
``P(axes, None, ...)``, ``N`` divisible by ``D``) holds rows ``[d N/D, (d+1) N/D)`` on
device ``d``. Left to XLA's partitioner, a gather from and a scatter into such a table
make every device process all ``k`` ids of the step (masking the rows it does not own).
Here, inside ``shard_map``:

1. the ``k`` ids (merged and sorted once, as the one-device path does) and their gradient
   rows reach every device (replicated; an all-gather of ``k (4 + 4 dim)`` bytes when the
   batch arrives sharded);
2. device ``d`` finds its rows, a contiguous run of the sorted ids (two binary searches),
   and runs Adam on them only, ``cap = 2 k / D`` rows at a time (more rounds when one
   shard owns more than ``cap`` rows; the numbers never depend on ``cap``), gathering and
   scattering its own moments;
3. the rows' updates go back to their slot of one ``(k, dim)`` array, zero elsewhere, and
   a ``psum`` over the table's axes hands the whole array to every device (an all-reduce
   of ``4 k dim`` bytes: each slot is written by one device, so the sum is exact);
4. :func:`scatter_add` adds them to the table, each device keeping the ids in its row range
   (no communication).

Per step and device: about ``k / D`` rows of the table and moments read and written, no
``(N, dim)`` array.

Quantized moments (:class:`adamkit._quant.QuantizedArray`, blocks within rows) are split
by their codes and scales, which lead with the table's rows: step 2 gathers a row's codes
and scales, dequantizes, steps, requantizes and scatters them back, the 4-bit dither keyed
on the rows' global ids (``id * D + column``), so the codes are those of one device.

Where the split comes from: on meshes with Explicit axes it is part of the arrays' type
(``jax.typeof``), and a concrete array carries it. Inside a ``jit`` over Auto axes a
traced array shows its mesh but not how it is split, so the optimizer records each
table's split at ``init``, from the params (a :class:`RowSplits`, a pytree node without
leaves, in the state's tree structure: orbax, ``ak.state_dict`` and ``jax.tree.map`` see
no new array, ``optax.tree.map_params`` no params tree, and ``jit`` keys its cache on
it). The step trusts a record only for traced moments of the recorded number of rows on
the recorded mesh; params abstract or traced at ``init`` leave no record, and XLA's
partitioning then stays (same numbers, every device sees every id).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from adamkit import _adam, _quant
from adamkit._dtypes import compute_dtype
from adamkit._sparse_types import RowSparse, _explicit_sharding, safe_ids
from adamkit._tree import is_tracer, leaf_names


class RowLayout(NamedTuple):
  """How a table's rows are split: over ``axes`` of ``mesh``, ``num_shards`` blocks."""
  mesh: Any
  axes: Any  # the first entry of the table's PartitionSpec: a name or a tuple of names
  num_shards: int


def row_layout(x: Any) -> RowLayout | None:
  """The row split of ``x`` when it is known here and spans several devices, else ``None``:
  known for a concrete array, an array typed on a mesh with Explicit axes, or a
  ``jax.ShapeDtypeStruct`` that carries a sharding."""
  sharding = _explicit_sharding(x)
  if sharding is None and (isinstance(x, jax.ShapeDtypeStruct) or (
      isinstance(x, jax.Array) and not is_tracer(x))):
    sharding = x.sharding
  if not isinstance(sharding, NamedSharding) or x.ndim < 1:
    return None
  spec = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
  if spec[0] is None or any(s is not None for s in spec[1:]):
    return None
  axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
  num_shards = math.prod(sharding.mesh.shape[a] for a in axes)
  if num_shards < 2 or x.shape[0] % num_shards:
    return None
  return RowLayout(sharding.mesh, spec[0], num_shards)


def same_layout(*xs: Any) -> RowLayout | None:
  """The common row layout of ``xs`` (a table and its moments), or ``None``."""
  layouts = [row_layout(x) for x in xs]
  return layouts[0] if layouts[0] is not None and all(t == layouts[0] for t in layouts) else None


@dataclasses.dataclass(frozen=True)
class RowSplit:
  """A table's row split recorded at ``init``, for the steps traced where it is not known
  (``jit`` over Auto axes). A pytree node without children, the split its static data:
  it adds no leaf to a state, and a state with another split is another ``jit`` key."""
  layout: RowLayout
  num_rows: int  # the table's rows: a moment of another size (a slice of it) is not split so

  def __repr__(self) -> str:
    return f"RowSplit({self.num_rows} rows over {self.layout.axes!r}, {self.layout.num_shards} shards)"


jax.tree_util.register_pytree_with_keys(
    RowSplit, lambda r: ((), (r.layout, r.num_rows)), lambda aux, _: RowSplit(*aux),
    flatten_func=lambda r: ((), (r.layout, r.num_rows)))


@dataclasses.dataclass(frozen=True)
class RowSplits:
  """The splits recorded at ``init`` for a state's row-sharded tables (the state's
  ``row_splits``): ``((leaf name, RowSplit), ...)``, sorted by name. A pytree node
  without children, the record its static data: no leaf for orbax or ``ak.state_dict``,
  and not shaped like the params, so ``optax.tree.map_params`` finds no params tree here
  (the record of params without a row-sharded table, or of its placeholder params, is
  empty: the same node). Keyed by name, so parameter groups (each initialized on its own
  leaves) share one record: their union."""
  splits: tuple = ()

  def __repr__(self) -> str:
    return f"RowSplits({dict(self.splits)!r})" if self.splits else "RowSplits()"

  @classmethod
  def union(cls, records) -> RowSplits:
    """One record of the tables of every record in ``records``."""
    return cls(tuple(sorted({k: v for r in records for k, v in r.splits}.items(),
                            key=lambda kv: kv[0])))


jax.tree_util.register_pytree_with_keys(
    RowSplits, lambda r: ((), r.splits), lambda aux, _: RowSplits(aux),
    flatten_func=lambda r: ((), r.splits))


def is_split(x: Any) -> bool:
  """A recorded split: a :class:`RowSplit`, or a :class:`RowSplits` holding one."""
  return isinstance(x, RowSplit) or (isinstance(x, RowSplits) and bool(x.splits))


def record(p: Any) -> RowSplit | None:
  """The split of param ``p`` to record at ``init`` (see :class:`RowSplit`), or ``None``
  where it is unknown (a traced param, or one without a sharding) or not a row split."""
  layout = row_layout(p)
  return None if layout is None else RowSplit(layout, p.shape[0])


def record_all(params: Any) -> RowSplits:
  """The :class:`RowSplits` of ``params``' row-sharded tables."""
  found = ((name, record(p)) for name, p in zip(leaf_names(params), jax.tree.leaves(params)))
  return RowSplits(tuple(sorted(((n, s) for n, s in found if s is not None),
                                key=lambda kv: kv[0])))


def recorded(state: Any, names: list[str]) -> list:
  """The splits ``state.row_splits`` recorded for the moments' leaves ``names``, ``None``
  where none was: also for a state made other than by ``init``."""
  splits = getattr(state, "row_splits", None)
  found = dict(splits.splits) if isinstance(splits, RowSplits) else {}
  return [found.get(n) for n in names]


def forget(tree: Any) -> Any:
  """``tree`` with every recorded split dropped: its steps keep XLA's partitioning where
  the split is not known at trace time."""
  return jax.tree.map(lambda x: RowSplits() if isinstance(x, RowSplits) else x, tree,
                      is_leaf=lambda x: isinstance(x, RowSplits))


def step_layout(split: RowSplit | None, *xs: Any) -> RowLayout | None:
  """The layout to route a step on ``xs`` (a table's moments) with: theirs where it is
  known here (concrete arrays, Explicit axes), else the recorded ``split`` when ``xs`` are
  traced on Auto axes of its mesh with its number of rows; ``None``: XLA's partitioning."""
  if not all(is_tracer(x) and _explicit_sharding(x) is None for x in xs):
    return same_layout(*xs)
  if split is None or any(x.shape[0] != split.num_rows for x in xs):
    return None
  # A state moved to other devices since init (one device, another mesh) shows it here.
  if any(getattr(jax.typeof(x).sharding, "mesh", None) != split.layout.mesh.abstract_mesh
         for x in xs):
    return None
  return split.layout


def _rows_spec(layout: RowLayout, ndim: int) -> PartitionSpec:
  return PartitionSpec(layout.axes, *([None] * (ndim - 1)))


def _replicated(x: jax.Array, layout: RowLayout) -> jax.Array:
  """``x`` replicated over the layout's mesh where its sharding is part of its type
  (Explicit axes); elsewhere ``shard_map``'s ``in_specs`` replicate it."""
  if _explicit_sharding(x) is None:
    return x
  return jax.sharding.reshard(x, NamedSharding(layout.mesh, PartitionSpec()))


def _sorted_rows(g: RowSparse, merge: bool) -> tuple[jax.Array, jax.Array]:
  """Distinct (``merge``) or given ids in ascending order with their rows; bad ids, mapped
  to ``num_rows``, sort last."""
  if merge:
    g = g.coalesce()  # sorted distinct ids first, padding (num_rows) last
    return g.indices, g.values
  ids = safe_ids(g.indices, g.num_rows)
  order = jnp.argsort(ids)
  return ids[order], g.values[order]


def _gather(x, local):
  """Rows ``local`` of a shard's moment (``n_local``: a zero fill), as stored or, for a
  quantized moment, dequantized from the rows' codes and scales (float32)."""
  take = lambda a: a.at[local].get(mode="fill", fill_value=0)  # noqa: E731
  return _quant.dequantize(_quant.take_rows(x, take)) if _quant.is_qarray(x) else take(x)


def _scatter(x, local, ids, rows, step):
  """A shard's moment with ``rows`` written at ``local`` (``n_local``: dropped). A quantized
  moment requantizes them as the one-device step does, the 4-bit dither keyed on ``step``
  and the positions of the rows' global ``ids``: the same codes on any number of shards."""
  put = lambda a, r: a.at[local].set(r.astype(a.dtype), mode="drop")  # noqa: E731
  if not _quant.is_qarray(x):
    return put(x, rows)
  pos = _quant.row_positions(ids, rows.shape) if _quant.stochastic(x.fmt) else None
  return _quant.put_rows(x, put, _quant.quantize(rows, x.fmt, step=step, pos=pos))


def _with_rows(x, n: int):
  """``x`` seen as a table of ``n`` rows: a quantized moment's static shape follows its
  codes and scales into and out of ``shard_map`` (a plain array's shape is its own)."""
  return dataclasses.replace(x, shape=(n, *x.shape[1:])) if _quant.is_qarray(x) else x


def lazy_rows(g: RowSparse, m, v, layout: RowLayout, *, merge: bool, b1, b2, eps, bc1, bc2,
              eps_mode: str, nesterov: bool, step=None):
  """:func:`adamkit._ops.lazy_rows` for row-sharded ``m, v``: each device updates the
  rows it owns. ``m, v``: arrays, or :class:`adamkit._quant.QuantizedArray` whose codes
  and scales lead with the table's rows (blocks within rows), split like them; ``step``
  keys the 4-bit first moment's dither. Returns ``(ids, u_rows, m, v)``: sorted ids
  (padding ``num_rows``) and their updates, replicated; ``m, v`` keep their sharding."""
  # Every device sees every id: a batch sharded over the mesh is all-gathered here.
  g = RowSparse.of(_replicated(g.indices, layout), _replicated(g.values, layout),
                   g.num_rows)
  ids, values = _sorted_rows(g, merge)
  k = ids.shape[0]
  dt = compute_dtype(values)
  if k == 0:
    return ids, values.astype(dt), m, v
  cap = max(1, min(k, -(-2 * k // layout.num_shards)))
  axes = layout.axes if isinstance(layout.axes, tuple) else (layout.axes,)
  num_rows = m.shape[0]
  counts = () if step is None else (step,)  # None: the 4-bit dither's error stays quantize's

  def per_device(ids, values, m, v, b1, b2, eps, bc1, bc2, *counts):
    step = counts[0] if counts else None
    n_local = num_rows // layout.num_shards
    m, v = _with_rows(m, n_local), _with_rows(v, n_local)
    start = jax.lax.axis_index(axes) * n_local
    # This device's rows: the run [lo, hi) of the sorted ids.
    lo = jnp.searchsorted(ids, start.astype(ids.dtype))
    hi = jnp.searchsorted(ids, (start + n_local).astype(ids.dtype))

    def one_round(r, carry):
      u, m, v = carry
      first = lo + r * cap
      at = jnp.minimum(first, k - cap)  # where dynamic_slice would clamp it anyway
      pos = at + jnp.arange(cap)
      mine = (pos >= first) & (pos < hi)
      rows = jax.lax.dynamic_slice_in_dim(ids, at, cap)
      local = jnp.where(mine, rows - start, n_local)
      g_rows = jax.lax.dynamic_slice_in_dim(values, at, cap).astype(dt)
      u_rows, m_rows, v_rows = _adam.adam_direction(
          g_rows, _gather(m, local).astype(dt), _gather(v, local).astype(dt),
          b1=b1, b2=b2, eps=eps, bc1=bc1, bc2=bc2, eps_mode=eps_mode, nesterov=nesterov)
      m = _scatter(m, local, rows, m_rows, step)
      v = _scatter(v, local, rows, v_rows, step)
      u = u.at[jnp.where(mine, pos, k)].set(u_rows, mode="drop")
      return u, m, v

    # Varying over the table's axes (each device fills its own slots), as the loop needs.
    u = jax.lax.pcast(jnp.zeros(values.shape, dt), axes, to="varying")
    # Usually one round; more only when this shard owns more than cap rows. A loop (not a
    # cond between sizes) keeps m and v updated in place.
    u, m, v = jax.lax.fori_loop(0, (hi - lo + cap - 1) // cap, one_round, (u, m, v))
    # each slot written by one device: the sum is exact
    return jax.lax.psum(u, axes), _with_rows(m, num_rows), _with_rows(v, num_rows)

  rows = PartitionSpec(layout.axes)  # the leading axis of every array of m and v
  rep = PartitionSpec()
  step_fn = jax.shard_map(per_device, mesh=layout.mesh,
                          in_specs=(rep, rep, rows, rows) + (rep,) * (5 + len(counts)),
                          out_specs=(rep, rows, rows))
  u, m, v = step_fn(ids, values, m, v, b1, b2, eps, bc1, bc2, *counts)
  return ids, u, m, v


def scatter_add(table: jax.Array, ids: jax.Array, rows: jax.Array, layout: RowLayout):
  """``table[ids] += rows`` (safe ids: ``num_rows`` is dropped), each device adding the
  ids in its own row range to its block (no communication)."""

  def per_device(table, ids, rows):
    n_local = table.shape[0]
    local = ids - jax.lax.axis_index(layout.axes) * n_local
    local = jnp.where((local >= 0) & (local < n_local), local, n_local)
    return table.at[local].add(rows.astype(table.dtype), mode="drop")

  ids, rows = _replicated(ids, layout), _replicated(rows, layout)
  spec = _rows_spec(layout, table.ndim)
  rep = PartitionSpec()
  return jax.shard_map(per_device, mesh=layout.mesh, in_specs=(spec, rep, rep),
                       out_specs=spec)(table, ids, rows)
