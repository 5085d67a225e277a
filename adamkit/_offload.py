"""Optimizer-state offload to host memory: ``offload`` wraps any transform.

Two modes, both keeping the parameters in device memory:

* ``"compute"`` (MindSpore ``nn.AdamOffload``, DeepSpeed ZeRO-Offload): the state never
  leaves host memory and the update is computed there; gradients go down to the host and
  updates come back up (8 bytes per float32 parameter and step).
* ``"state"`` (JAX's host-offloading guide, MaxText): the state is kept in host memory
  between steps and brought to the device for the update (32 bytes per float32 Adam
  parameter and step: ``mu`` and ``nu`` down and up).

Both modes also take a fused step (:class:`adamkit.FusedStep`), whose ``step`` returns the
new params rather than an update.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from adamkit import (
  _adam,
  _backend,
  _compat,
  _masks,
  _quant,
  _quant_ops,
  _row_sharded,
  _sparse,
  _stream,
  _validate,
)
from adamkit._fused import FlatMoments, FusedStep
from adamkit._sparse_types import (
  RowSparse,
  _explicit_sharding,
  gather_rows,
  is_row_sparse,
  safe_ids,
  scatter_rows,
)
from adamkit._tree import is_tracer

_MODES = ("compute", "state")
_HOST_KINDS = ("pinned_host",)


def _is_small(leaf) -> bool:
  """A 0-d state leaf (step count, learning-rate record): a few bytes that stay in device
  memory. Offloading is for the moments; a scalar in host memory would meet the device
  scalars of an enclosing ``lax.cond`` (``optax.MultiSteps``) with another type."""
  return np.ndim(leaf) == 0


def _spaces(state):
  """Where each leaf of an offloaded state lives between steps: host, scalars device."""
  return jax.tree.map(lambda x: _compat.DEVICE if _is_small(x) else _compat.HOST, state)


def _to_host(state):
  """``state`` put where an offloaded state lives between steps (see :func:`_spaces`)."""
  return jax.device_put(state, _spaces(state))


# ------------------------------------------------------------------ support checks


def _memory_kinds(devices) -> set[str]:
  """The memory kinds every device of ``devices`` that this process drives offers.

  Under ``jax.distributed`` the other processes' devices are not addressable here; each
  process checks its own (all run the same backend).
  """
  kinds = None
  for d in devices:
    if getattr(d, "process_index", jax.process_index()) != jax.process_index():
      continue
    try:
      mine = {m.kind for m in d.addressable_memories()}
    except Exception:  # backends without the memories API
      mine = set()
    kinds = mine if kinds is None else kinds & mine
  return kinds or set()


@functools.cache
def _probe(platform: str, mode: str) -> str | None:
  """Runs a one-element jitted step of ``mode`` once per platform: ``None`` if its results
  land in the right memories, else what went wrong.

  This catches, before any state is built, backends that cannot compile host computation
  and JAX versions whose ``jit`` returns arrays placed in host memory inside the step in
  device memory (which would silently keep the state on the device). The probe runs on
  one of this process's own devices: under ``jax.distributed`` every process probes for
  itself, with no collective (``jax.devices()[0]`` would be process 0's device, which the
  others cannot fetch from).
  """
  # Runs eagerly even when first reached while tracing (an init under jit): concrete
  # arrays and an AOT-compiled call never join the trace.
  try:
    with jax.ensure_compile_time_eval():
      dev = jax.local_devices(backend=platform)[0]
      x = jax.device_put(np.zeros((2,), np.float32),
                         SingleDeviceSharding(dev, memory_kind="pinned_host"))
      if mode == "compute":
        fn = _compat.on_host(lambda a: (a + 1, a + 2), (_compat.DEVICE, _compat.HOST))
      else:
        def fn(a):
          a = jax.device_put(a, _compat.DEVICE)
          return a + 1, jax.device_put(a + 2, _compat.HOST)
      up, down = jax.jit(fn).lower(x).compile()(x)
      got = (up.sharding.memory_kind, down.sharding.memory_kind)
      values = (np.asarray(up).tolist(), np.asarray(down).tolist())
  except Exception as e:  # noqa: BLE001 - any failure means "not here"
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
  if values != ([1.0, 1.0], [2.0, 2.0]):
    return f"a jitted step computed {values} instead of ([1, 1], [2, 2])"
  if got != ("device", "pinned_host"):
    return (f"a jitted step returned its results in {got} memory instead of ('device', "
            f"'pinned_host') with jax {jax.__version__}")
  return None


def check_support(mode: str, memory_kind: str, devices=None) -> None:
  """Raises if the backend of ``devices`` (default: JAX's default devices) cannot run
  ``mode`` with the state in ``memory_kind``; the message names the mode that would work."""
  devices = list(devices) if devices is not None else jax.devices()
  platform = devices[0].platform
  kinds = _memory_kinds(devices)
  if memory_kind not in kinds:
    raise RuntimeError(
        f"ak.offload needs memory kind {memory_kind!r}, but the {platform!r} backend's "
        f"devices offer only {sorted(kinds)}. Neither mode='compute' nor mode='state' can "
        "work here: use the transform without ak.offload (its state then stays in device "
        "memory).")
  state_err = _probe(platform, "state")
  if mode == "state" and state_err is not None:
    raise RuntimeError(
        f"ak.offload(mode='state') cannot keep the state in {memory_kind!r} memory on the "
        f"{platform!r} backend ({state_err}). Neither mode works here; ak.offload is "
        "verified with jax 0.10 (see the adamkit README).")
  if mode == "compute":
    err = _probe(platform, "compute")
    if err is not None:
      hint = (f"Use mode='state': the state still lives in {memory_kind!r} memory and is "
              "computed on the device." if state_err is None else
              "mode='state' does not work here either; ak.offload is verified with jax 0.10.")
      raise RuntimeError(
          "ak.offload(mode='compute') runs the update on the host "
          f"(compute_on('device_host')), which fails on the {platform!r} backend "
          f"({err}). {hint}")


def _concrete_devices(tree) -> list | None:
  devs = []
  for leaf in jax.tree.leaves(tree):
    if is_tracer(leaf):
      return None
    sharding = getattr(leaf, "sharding", None)
    if sharding is not None:
      devs.extend(sharding.device_set)
  return list(dict.fromkeys(devs)) or None


def _reads_params(fn, updates, state, params, extra) -> bool:
  """Whether ``fn(updates, state, params, extra)`` reads ``params`` (traced, not run)."""
  jaxpr = jax.make_jaxpr(fn)(updates, state, params, extra).jaxpr
  n_before = len(jax.tree.leaves((updates, state)))
  wanted = set(jaxpr.invars[n_before:n_before + len(jax.tree.leaves(params))])
  is_var = lambda v: not isinstance(v, jax.extend.core.Literal)  # noqa: E731
  used = {v for eqn in jaxpr.eqns for v in eqn.invars if is_var(v)}
  used.update(v for v in jaxpr.outvars if is_var(v))
  return bool(wanted & used)


# ---------------------------------------------------------------------- shardings


def _replicated(sharding, memory_kind: str, ndim: int = 0):
  """A fully replicated sharding over ``sharding``'s devices, in ``memory_kind``.

  Over a mesh the spec names every axis (``P(None, ...)`` for ``ndim`` axes): that is how a
  jitted step returns a replicated array, and ``jit`` caches ``P()`` and ``P(None)``
  apart, so a state placed with ``P()`` would compile the step a second time.
  """
  if isinstance(sharding, NamedSharding):
    return NamedSharding(sharding.mesh, PartitionSpec(*[None] * ndim), memory_kind=memory_kind)
  if len(sharding.device_set) == 1:
    return SingleDeviceSharding(next(iter(sharding.device_set)), memory_kind=memory_kind)
  devices = np.array(sorted(sharding.device_set, key=lambda d: d.id))
  mesh = jax.sharding.Mesh(devices, ("devices",))
  return NamedSharding(mesh, PartitionSpec(), memory_kind=memory_kind)


def offload_shardings(state: Any, params: Any, *, shardings: Any = None,
                      memory_kind: str = "pinned_host") -> Any:
  """The shardings of an offloaded optimizer state, built from the params' shardings.

  Every state leaf that mirrors a parameter (same shape, and its tree path ends with the
  parameter's path, as ``mu['w']`` ends with ``['w']``) gets that parameter's sharding in
  ``memory_kind``; every other leaf (factored moments, ...) is replicated over the same
  devices in ``memory_kind``, except 0-d leaves (step counts, learning-rate records), which
  are replicated in device memory: a few bytes, and an enclosing ``optax.MultiSteps``'s
  ``lax.cond`` needs them where its own scalars live. Works for single-device and
  ``NamedSharding`` (sharded) parameters alike.

  Args:
    state: the optimizer state, or its ``jax.eval_shape``.
    params: the parameters: arrays, or ``jax.ShapeDtypeStruct`` with ``sharding`` set.
    shardings: optional pytree of ``jax.sharding.Sharding`` matching ``params``, used
      instead of the params' own (e.g. for ``ShapeDtypeStruct`` params without one).
    memory_kind: the host memory kind, ``"pinned_host"``.

  Returns:
    A pytree of shardings with ``state``'s structure, for ``jax.device_put`` or a
    ``jax.jit`` ``in_shardings``/``out_shardings``.

  Examples:
    >>> import jax, jax.numpy as jnp, adamkit as ak
    >>> params = {"w": jnp.ones((8, 2))}
    >>> state = ak.scale_by_adam().init(params)
    >>> sh = ak.offload_shardings(state, params)
    >>> sh.mu["w"].memory_kind, sh.count.memory_kind
    ('pinned_host', 'device')
  """
  _validate.check_choice("memory_kind", memory_kind, _HOST_KINDS)
  if shardings is None:
    shardings = jax.tree.map(lambda p: getattr(p, "sharding", None), params)
  p_flat, p_def = jax.tree_util.tree_flatten_with_path(params)
  try:  # "up to" the params' leaves: a leaf position may hold None (no sharding known)
    s_flat = p_def.flatten_up_to(shardings)
  except (ValueError, TypeError) as e:
    raise ValueError(f"`shardings` must have the params' tree structure: {e}") from None
  entries = []
  for (path, p), s in zip(p_flat, s_flat):
    if s is None:
      raise ValueError(
          f"Param '{_validate.path_name(path) or '<root>'}' has no sharding: pass "
          "concrete arrays, ShapeDtypeStructs with `sharding=`, or `shardings=`.")
    entries.append((tuple(path), np.shape(p), s))
  if not entries:
    raise ValueError("`params` has no leaves: there is nothing to lay the state out by.")
  scalar = _replicated(entries[0][2], "device")

  def place(path, leaf):
    path, shape = tuple(path), tuple(np.shape(leaf))
    if _is_small(leaf):
      return scalar
    best = None
    for p_path, p_shape, s in entries:
      n = len(p_path)
      if p_shape == shape and path[len(path) - n:] == p_path and (
          best is None or n > best[0]):
        best = (n, s)
    if _quant.is_qarray(leaf):  # codes and scales laid out by the param they stand for
      where = best[1] if best else _replicated(entries[0][2], memory_kind)
      return _quant_ops.shardings_like(leaf, where, memory_kind)
    if best is None:
      return _replicated(entries[0][2], memory_kind, len(shape))
    return best[1].with_memory_kind(memory_kind)

  return jax.tree_util.tree_map_with_path(place, state, is_leaf=_quant.is_qarray)


def offload_state(state: Any, params: Any, *, shardings: Any = None,
                  memory_kind: str = "pinned_host") -> Any:
  """Places ``state`` in host memory, laid out like ``params`` (see
  :func:`offload_shardings`).

  Use it after restoring a checkpoint (``numpy`` arrays, or arrays in device memory) to put
  an offloaded optimizer's state back where ``ak.offload`` keeps it. (The offloaded
  ``update`` also takes a state it finds in device memory, or typed so: it moves such
  leaves whole for that one step, row-sparse tables included, and donation fails for that
  step.) Always copies: orbax restores arrays whose sharding names ``pinned_host`` while
  their type says device memory (``float32[N, D]``, not ``float32<host>[N, D]``); a copy
  gives them the host type.

  Examples:
    >>> import numpy as np, jax, jax.numpy as jnp, adamkit as ak
    >>> tx = ak.adam_offload(1e-3)
    >>> params = jax.device_put({"w": jnp.ones(3)}, jax.devices()[0])  # committed
    >>> saved = jax.tree.map(np.asarray, tx.init(params))
    >>> state = ak.offload_state(saved, params)
    >>> {x.sharding.memory_kind for x in jax.tree.leaves(state) if x.ndim}  # the moments
    {'pinned_host'}
  """
  _validate.check_quantized_state(state, "offload_state")  # a restored state: codes, scales
  state = _row_sharded.forget(state)  # no row routing for a host-resident state
  return jax.device_put(
      state, offload_shardings(state, params, shardings=shardings, memory_kind=memory_kind),
      may_alias=False)


# ----------------------------------------------------------- sparse: touched rows only


def _host_gather(table, ids):
  """``table[ids]`` computed on the host; the rows come back in device memory.

  ``mode="clip"``: the padding id ``N`` that :meth:`RowSparse.coalesce` leaves reads row
  ``N - 1``, whose result :func:`_host_scatter` later drops. (``mode="fill"`` would build a
  device-typed mask next to the host-typed table, which JAX rejects.)
  """
  def gather(t, i):
    sharding = _explicit_sharding(t)  # explicit meshes: the k rows come out replicated
    kw = {} if sharding is None else {"out_sharding": NamedSharding(sharding.mesh,
                                                                    PartitionSpec())}
    return t.at[i].get(mode="clip", **kw)

  return _compat.on_host(gather, _compat.DEVICE)(table, ids)


def _host_scatter(table, ids, rows):
  """``table[ids] = rows`` computed on the host, in place when the state is donated."""
  def scatter(t, i, r):
    sharding = _explicit_sharding(t)
    kw = {} if sharding is None else {"out_sharding": sharding}
    return t.at[i].set(r.astype(t.dtype), mode="drop", **kw)

  return _compat.on_host(scatter, _compat.HOST)(table, ids, jax.device_put(rows, _compat.HOST))


def _update_touched_rows(inner, updates, state, params, extra):
  """``mode="state"`` for gradient trees with :class:`RowSparse` leaves.

  Each sparse table's gradient names at most ``k`` distinct rows; the state leaves that
  mirror the table (same shape, path ending with the table's path) are gathered on the
  host to those ``k`` rows, which alone travel to the device. ``inner`` then updates a
  *reduced* problem in which each table has ``k`` rows, and the new rows are scattered back
  into the host-resident state. Every other state leaf moves whole, as in ``mode="state"``.

  Valid for transforms that treat rows independently and leave untouched rows alone (lazy
  sparse Adam); returns ``None`` when ``inner`` answers a sparse gradient with a dense
  update (``lazy=False``: every row moves), or when its state holds multi-tensor moments
  (:class:`adamkit.FlatMoments`: every param's rows back to back in one buffer, which no
  reduced table can mirror), and the caller moves the whole state instead.
  """
  _validate.check_row_ids_untouched(updates)  # before the ids index the host gather
  flat = lambda x: isinstance(x, FlatMoments)  # noqa: E731
  if any(flat(x) for x in jax.tree.leaves(state, is_leaf=flat)):
    return None
  g_flat, g_def = jax.tree_util.tree_flatten_with_path(updates, is_leaf=is_row_sparse)
  tables = {}  # path -> (global ids (k,), num_rows N, row shape)
  reduced_g = []
  for path, g in g_flat:
    if not isinstance(g, RowSparse) or g.indices.shape[0] == 0:
      reduced_g.append(g)
      continue
    # The k occurrences name at most k rows: sorted unique ids, then padding id N. The
    # reduced gradient keeps every occurrence (duplicates, per-occurrence decay) and
    # renames each to its row's slot; bad ids get slot k, which the reduced table drops.
    k, n = g.indices.shape[0], g.num_rows
    ids, slot = jnp.unique(safe_ids(g.indices, n), size=k, fill_value=n, return_inverse=True)
    slot = slot.reshape(-1).astype(g.indices.dtype)
    slot = jnp.where(ids[slot] < n, slot, k)
    tables[tuple(path)] = (ids, n, g.values.shape[1:])
    reduced_g.append(RowSparse.of(slot, g.values, k))
  reduced_updates = g_def.unflatten(reduced_g)

  reduced_params = params
  if params is not None:
    p_flat, p_def = jax.tree_util.tree_flatten_with_path(params)
    reduced_params = p_def.unflatten([
        gather_rows(p, tables[tuple(path)][0]) if tuple(path) in tables else p
        for path, p in p_flat])

  def table_of(path, leaf):
    """The sparse table a state leaf mirrors, or None."""
    path = tuple(path)
    for t_path, (_, n, row) in tables.items():
      if path[len(path) - len(t_path):] == t_path and np.shape(leaf) == (n, *row) and (
          not _quant.is_qarray(leaf) or _quant.rows_apart(leaf.shape, leaf.fmt)):
        return t_path
    return None

  # A quantized moment (codes and scales, blocks within rows) is one leaf here: its rows
  # are gathered and scattered with their scales.
  s_flat, s_def = jax.tree_util.tree_flatten_with_path(state, is_leaf=_quant.is_qarray)
  owners = [table_of(path, leaf) for path, leaf in s_flat]
  on_host = [_typed_host(leaf) for _, leaf in s_flat]
  host_ids = {t: jax.device_put(tables[t][0], _compat.HOST) for t in tables}

  if not all(host for host, t in zip(on_host, owners) if t is not None):
    warnings.warn(
        "ak.offload: a row-sparse table's optimizer state is typed as device memory (an "
        "orbax restore gives host-placed arrays a device type): this step is compiled to "
        "move the whole table, where host and device memory differ. Put the restored state "
        "back first: state = ak.offload_state(state, params).", OffloadedStateWarning,
        stacklevel=4)

  def gather(leaf, t, host):
    if t is None:
      return jax.device_put(leaf, _compat.DEVICE)
    if host:
      return _rows_on_host(leaf, host_ids[t])
    ids = tables[t][0]
    leaf = jax.device_put(leaf, _compat.DEVICE)
    if _quant.is_qarray(leaf):
      return _quant.take_rows(leaf, lambda x: gather_rows(x, ids))
    return gather_rows(leaf, ids)

  reduced_state = s_def.unflatten([gather(leaf, t, host)
                                   for (_, leaf), t, host in zip(s_flat, owners, on_host)])

  u, new_state = inner.update(reduced_updates, reduced_state, reduced_params, **extra)

  u_flat = jax.tree_util.tree_flatten_with_path(u, is_leaf=is_row_sparse)[0]
  out_u = []
  for path, leaf in u_flat:
    t = tables.get(tuple(path))
    if t is None:
      out_u.append(leaf)
      continue
    if not isinstance(leaf, RowSparse):
      return None  # a dense answer: every row of the table moves
    ids, n, _ = t
    global_ids = ids.at[leaf.indices].get(mode="fill", fill_value=n)
    out_u.append(RowSparse.of(global_ids, leaf.values, n))
  out_u = jax.tree.structure(u, is_leaf=is_row_sparse).unflatten(out_u)

  def scatter(old, new, t, host):
    if t is None:
      return _to_host(new)
    if host:
      return _rows_to_host(old, host_ids[t], new)
    # A table typed as device memory (just restored, see _typed_host): scattered on the
    # device and sent to host memory whole, this step only; the next finds it host-typed.
    ids, old = tables[t][0], jax.device_put(old, _compat.DEVICE)
    if _quant.is_qarray(old):
      return _to_host(_quant.put_rows(old, lambda x, r: scatter_rows(x, ids, r), new))
    return _to_host(scatter_rows(old, ids, new))

  new_flat = s_def.flatten_up_to(new_state)
  out_state = s_def.unflatten([scatter(old, new, t, host) for (_, old), new, t, host
                               in zip(s_flat, new_flat, owners, on_host)])
  return out_u, out_state


def _typed_host(leaf) -> bool:
  """Whether JAX types ``leaf`` as host memory (``float32<host>[N, D]``).

  An orbax restore into a ``pinned_host`` sharding gives arrays whose sharding names host
  memory while their type says device memory, and the host gather of a row-sparse step
  refuses to mix the two ("memory_space of all inputs passed to `gather` must be the
  same"). Such a leaf, or a state restored into device memory, takes the device path
  instead (the whole table moves, as in a dense ``mode="state"`` step, where host and
  device memory differ), with an :class:`OffloadedStateWarning` naming the remedy,
  :func:`offload_state`. The state returned is host-typed; but ``jax.jit`` caches the step
  by shardings, which do not show the type, so the step compiled for that first state
  keeps the device path.
  """
  if _quant.is_qarray(leaf):
    return _typed_host(leaf.codes) and _typed_host(leaf.scales)
  aval = getattr(leaf, "aval", None)
  return getattr(aval, "memory_space", None) == _compat.HOST


def _rows_on_host(leaf, ids):
  """:func:`_host_gather` of a state leaf, a quantized one's codes and scales alike."""
  if _quant.is_qarray(leaf):
    return _quant.take_rows(leaf, lambda x: _host_gather(x, ids))
  return _host_gather(leaf, ids)


def _rows_to_host(leaf, ids, rows):
  """:func:`_host_scatter` of a state leaf, a quantized one's codes and scales alike."""
  if _quant.is_qarray(leaf):
    return _quant.put_rows(leaf, lambda x, r: _host_scatter(x, ids, r), rows)
  return _host_scatter(leaf, ids, rows)


# --------------------------------------------------------------------- the wrapper


class OffloadedStateWarning(UserWarning):
  """An offloaded step was traced with a state typed as device memory (e.g. fresh from an
  orbax restore, before ``ak.offload_state``): correct, but it moves whole tables."""


class UncommittedParamsWarning(UserWarning):
  """``ak.offload(...).init`` got uncommitted params: a jitted step compiles twice."""


def _warn_if_uncommitted(params) -> None:
  """Warns (once per call site) when a param is an uncommitted ``jax.Array``.

  JAX caches a jitted step by its arguments' committedness. An offloaded state lives in
  host memory, which only a committed array can, so the step's outputs are committed: fed
  uncommitted params (fresh from ``jnp`` or ``jax.random``), step 1 compiles for them and
  step 2 compiles again for the committed params step 1 returned. No transform can commit
  the caller's arrays; committing them first gives one compilation.
  """
  if any(isinstance(leaf, jax.Array) and not leaf.committed
         for leaf in jax.tree.leaves(params)):
    warnings.warn(
        "ak.offload: the params are uncommitted (fresh from jnp or jax.random); the "
        "offloaded state is committed to host memory, so a jitted step returns committed "
        "params and compiles a second time on its second call. Commit the params once, "
        "before init: params = jax.device_put(params, jax.devices()[0]) (or a "
        "NamedSharding).", UncommittedParamsWarning, stacklevel=3)


def _host_init(init, mode: str, memory_kind: str):
  """``init`` whose state is placed in ``memory_kind``, laid out like the params."""
  def init_fn(params):
    devices = _concrete_devices(params)
    check_support(mode, memory_kind, devices)
    if devices is not None:
      _warn_if_uncommitted(params)
    # The row splits recorded for device-resident steps (adamkit._row_sharded) would
    # route a host-resident state's step through the mesh: dropped, XLA partitions it.
    state = _row_sharded.forget(init(params))
    if mode == "compute" and any(map(_quant.is_qarray,
                                     jax.tree.leaves(state, is_leaf=_quant.is_qarray))):
      raise ValueError(
          "ak.offload(mode='compute') cannot step quantized moments (mu_dtype/nu_dtype "
          "'8bit', '4bit', 'fp8'): inside a host computation JAX (0.10 to 0.12) types the "
          "arrays their codec makes (constants, the branches of its selects) as device "
          "memory, and refuses to mix them with the host-resident codes. Use mode='state' "
          "(the default of ak.offload, and of "
          "ak.adam_offload with a quantized format): the codes and scales still live in "
          "host memory between steps, a quarter of the float32 state's traffic.")
    if devices is None:  # traced init: keep the layout the compiler picks, in host memory
      return _to_host(state)
    return offload_state(state, params, memory_kind=memory_kind)

  return init_fn


@contextlib.contextmanager
def _explain_host_tracing():
  """Turns JAX's memory-space type errors while tracing on the host into advice."""
  try:
    yield
  except (TypeError, ValueError) as e:
    if "memory_space" not in str(e) and "<host>" not in str(e):
      raise
    raise RuntimeError(
        "ak.offload(mode='compute') could not trace this transform's update on the "
        "host-resident state: it creates arrays of its own (zeros, a lax.cond branch), "
        "which JAX types as device memory, and combines them with host-resident ones. "
        "Known cases: optax.clip_by_global_norm (ak.ClipGradByGlobalNorm works), "
        "optax.apply_if_finite (nonfinite='skip'), optax.adafactor, ak.sparse_adam. Use "
        "mode='state' for this transform: its state still lives in host memory between "
        "steps (for sparse tables only the touched rows travel)."
    ) from e


def _offload_fused(opt: FusedStep, mode: str, memory_kind: str) -> FusedStep:
  """:func:`offload` for a :class:`adamkit.FusedStep`: the same two modes, params in/out."""
  def step_fn(params, state, grads):
    if mode == "state":
      params, state = opt.step(params, jax.device_put(state, _compat.DEVICE), grads=grads)
      return params, _to_host(state)
    # The fused step reads and writes the params: they go down with the grads, and the new
    # params (not an update) come up.
    def whole(params, state, grads):
      spaces = _spaces(state)
      params, state, grads = jax.device_put((params, state, grads), _compat.HOST)
      # A fresh function per trace: compute_on caches its trace by function, and
      # by_platform traces this region once per platform (the kernel's, then XLA's).
      def host_step(params, state, grads):
        return opt.step.positional(params, state, grads)
      with _explain_host_tracing():
        return _compat.on_host(host_step, (_compat.DEVICE, spaces))(params, state, grads)
    # the kernel-or-XLA switch around the host region (_backend.by_platform)
    return _backend.by_platform(lambda: whole(params, state, grads), *jax.tree.leaves(grads))

  # The optax form: the optimizer's own ``update`` offloaded as any transform is.
  return FusedStep(_host_init(opt.init, mode, memory_kind), step_fn,
                   offload(optax.GradientTransformationExtraArgs(opt.init, opt.update),
                           mode=mode, memory_kind=memory_kind).update)


def offload(tx: optax.GradientTransformation | FusedStep, *, mode: str = "state",
            memory_kind: str = "pinned_host", chunk_bytes: Any = "auto") -> FusedStep:
  r"""Keeps ``tx``'s state in host memory; the parameters stay in device memory.

  The maths is ``tx``'s, unchanged; only where its state lives and where it is computed
  moves. With :math:`H` host memory and :math:`D` device memory, one step is

  .. math::

    \text{compute:}\quad & g \xrightarrow{D \to H} g_H,\;
      (u_H, s_H) = \mathrm{update}(g_H, s_H, w_H) \text{ on the host},\;
      u_H \xrightarrow{H \to D} u \\
    \text{state:}\quad & s_H \xrightarrow{H \to D} s,\;
      (u, s) = \mathrm{update}(g, s, w) \text{ on the device},\;
      s \xrightarrow{D \to H} s_H

  ``"compute"`` moves a gradient down and an update up (8 bytes per float32 parameter;
  12 when ``tx`` reads the params, e.g. for weight decay); ``"state"`` moves the state
  both ways (32 bytes per float32 Adam parameter) and computes at device speed. The state
  lives in host memory *between* steps; staged whole, XLA brings all of it to the device
  for the step: compiled for a TPU v5e chip (XLA's deviceless compile-time figures, not a
  measurement on hardware), one 2048x2048 float32 AdamW leaf (32 MiB of state) takes
  64.2 MiB of device temporaries in ``"state"`` mode with ``chunk_bytes=None`` and
  48.2 MiB in ``"compute"`` mode, against 0 without offload. ``chunk_bytes`` streams it
  in calls and lowers that figure: in ``"state"`` mode 4.7 MiB with the default
  ``"auto"`` (4 MiB calls on one TPU chip), 1.8 MiB in 1 MiB calls. In ``"compute"`` mode
  each call runs on the host: its gradient (and param) rows go down, its update rows come
  back, and the state rows never leave host memory. Inside a TPU or GPU program the host
  computation is XLA's own (an XLA:CPU FFI kernel cannot be called there).

  The result is a :class:`adamkit.FusedStep`: besides ``update`` (the optax form, which
  returns the whole update for ``optax.apply_updates``: 4 bytes per float32 parameter on
  the device, half of Adam's state) it has ``step(params, state, grads=grads) ->
  (params, state)``. Streamed, ``step`` adds each call's update to its param rows as the
  call ends, written over the params (donate them), so no whole update is ever held: a
  4096x4096 float32 AdamW leaf (128 MiB of state) takes 4.8 MiB of device temporaries in
  ``step`` against 72.8 MiB through ``update``, a 23.1M-parameter transformer-shaped tree
  35.8 MiB against 120.8 MiB (176 MiB of state; TPU v5e chip, compile-time figures,
  2026-12-02). Unstreamed, ``step`` is ``update`` then :func:`adamkit.apply_updates`.

  ``init`` places the state in ``memory_kind`` laid out like the params (see
  :func:`offload_shardings`); ``update`` returns it there, so a plain
  ``jax.jit(step, donate_argnums=(0, 1))`` needs no sharding arguments. ``update`` also
  accepts a state found elsewhere (a restored checkpoint) and moves it.

  With row-sparse gradients (:class:`adamkit.RowSparse`, e.g. ``ak.sparse_adam``),
  ``mode="state"`` moves only the touched rows of each table's moments to the device and
  back; the rest of the table never leaves host memory. To accumulate gradients, offload
  the accumulator (``ak.offload(optax.MultiSteps(tx, k).gradient_transformation(),
  mode="state")``), not the other way round: ``optax.MultiSteps``'s ``lax.cond`` mixes the
  offloaded scalars with device ones, which JAX rejects.

  A :class:`adamkit.FusedStep` (:func:`adamkit.fused_adam`, :func:`adamkit.fused_adamax`)
  is offloaded the same way, and the result is again a ``FusedStep``: its
  ``step(params, state, grads=grads) -> (params, state)`` returns the new params in device
  memory and the state in host memory. In ``"compute"`` mode (DeepSpeed's CPU Adam) the
  grads *and* the params go down and the new params come up (12 bytes per float32
  parameter), and the one-pass step runs on the host; in ``"state"`` mode the state comes
  to the device for the step, as above. Its ``update`` (the optax form) is the fused
  optimizer's ``update`` offloaded as any transform is.

  .. warning::
    Where the offloaded fused step runs its C++ kernel. The kernel is registered with XLA
    for the ``"cpu"`` platform only. On the CPU backend (host and device memory are the
    same RAM) the kernel runs inside the ``compute_on("device_host")`` region, with
    donation honoured, bit-identical to the fused step without offload (tested) and as
    fast (``benchmarks/bench_offload_fused.py``). In a GPU or TPU program,
    ``backend="auto"`` sees a non-CPU backend and traces the pure-JAX path into the host
    region; whether XLA then runs that host computation well, and whether
    ``backend="kernel"`` can lower there at all, is *untested* (no accelerator was
    available when this was written): expect ``backend="kernel"`` to fail to lower.

  Args:
    tx: any ``optax.GradientTransformation`` (adamkit or optax), or a
      :class:`adamkit.FusedStep`.
    mode: ``"state"`` (the default, since 0.2: it runs every transform, row-sparse
      gradients included) or ``"compute"`` (MindSpore ``AdamOffload``, the default of
      :func:`adamkit.adam_offload`: a quarter of the traffic, but JAX 0.10 cannot trace
      some transforms on host-resident arrays: ``optax.clip_by_global_norm``,
      ``optax.apply_if_finite``, ``optax.adafactor``, ``ak.sparse_adam``; those raise at
      trace time naming ``mode="state"``).
    memory_kind: the host memory kind for the state: ``"pinned_host"``.
    chunk_bytes: ``"auto"`` (the default; before this release ``None``), an int, or
      ``None`` (the state is staged whole). An int (a transform, either mode): the state
      is streamed in calls of about this many bytes of state, a float leaf of more than
      a sixteenth of that in equal runs of rows by one ``lax.scan`` (see
      ``adamkit/_stream.py`` for what stays exact, and the offload guide for the device
      figures per format). ``"auto"``: 4 MiB where the step is compiled for one TPU chip;
      whole (``None``) on a CPU (host and device memory are one RAM), on a GPU (XLA does
      not compile the streamed step for a GPU target yet), on a mesh (the pieces of a
      sharded leaf are each one device's, and XLA's partitioner moves them: more device
      memory than staging whole), for quantized moments (XLA:TPU does not compile their
      streamed steps yet; an int is accepted, and XLA's error raised) and for a
      :class:`adamkit.FusedStep` (its one-pass kernel is not cut; an int there is refused).

  Returns:
    A :class:`adamkit.FusedStep` (an ``optax.GradientTransformationExtraArgs`` with a
    one-pass ``step``) whose state is ``tx``'s state, unchanged in structure, held in
    host memory.

  Raises:
    RuntimeError: at ``init`` when the backend has no ``memory_kind`` memory or this JAX
      returns arrays placed in host memory inside ``jit`` in device memory (jax < 0.10; no
      mode can work), or, for ``mode="compute"``, when the backend cannot compute on the
      host (``"state"`` can); at ``update`` (``"compute"``) for a transform JAX cannot
      trace on host-resident arrays (global-norm clipping, ``apply_if_finite``, row-sparse
      gradients), naming ``mode="state"``, which handles them.

  Warns:
    UncommittedParamsWarning: at ``init`` when a param is an uncommitted ``jax.Array``
      (fresh from ``jnp`` or ``jax.random``). The state is committed to host memory, so a
      jitted step returns committed params and would compile a second time on its second
      call; ``jax.device_put(params, jax.devices()[0])`` (or a ``NamedSharding``) before
      ``init`` gives one compilation.

  .. warning::
    Buffer donation: without ``in_shardings`` *and* ``out_shardings``, JAX (0.10) pairs
    donated inputs with outputs by shape and dtype only, in order, ignoring memory kinds;
    a host-memory input paired with a device-memory output aborts the process ("PjRtBuffer's
    memory kind does not match sharding's memory kind"). The usual
    ``step(params, state, ...) -> (params, state, ...)`` with ``donate_argnums=(0, 1)``
    pairs correctly. For any other order, or when donating the state but not the params,
    pass both ``in_shardings`` and ``out_shardings`` (see :func:`offload_shardings`).

  .. warning::
    MindSpore's ``AdamOffload`` sends the gradient down and the parameter delta up. Here
    too only the update comes up, but when ``tx`` reads ``params`` (weight decay) the
    params also go down each step (12 bytes per parameter instead of 8); adamkit copies
    them only if the traced update actually reads them.

  Examples:
    >>> from functools import partial
    >>> import jax, jax.numpy as jnp, optax, adamkit as ak
    >>> tx = ak.offload(ak.adam(0.1))
    >>> params = jax.device_put({"w": jnp.array([1.0, -2.0])}, jax.devices()[0])
    >>> state = tx.init(params)
    >>> @partial(jax.jit, donate_argnums=(0, 1))  # params and state updated in place
    ... def step(params, state):
    ...   grads = jax.grad(lambda p: jnp.sum(p["w"] ** 2))(params)
    ...   updates, state = tx.update(grads, state, params)
    ...   return optax.apply_updates(params, updates), state
    >>> params, state = step(params, state)
    >>> params["w"].round(4), params["w"].sharding.memory_kind
    (Array([ 0.9, -1.9], dtype=float32), 'device')
    >>> {x.sharding.memory_kind for x in jax.tree.leaves(state) if x.ndim}  # the moments
    {'pinned_host'}

    The fused step, offloaded (jit it with ``donate_argnums=(0, 1)``):

    >>> opt = ak.offload(ak.fused_adam(0.1))
    >>> params = jax.device_put({"w": jnp.array([1.0, -2.0])}, jax.devices()[0])
    >>> step = jax.jit(opt.step, donate_argnums=(0, 1))
    >>> params, state = step(params, opt.init(params), grads={"w": jnp.array([2.0, -4.0])})
    >>> params["w"].round(4), params["w"].sharding.memory_kind
    (Array([ 0.9, -1.9], dtype=float32), 'device')
    >>> {x.sharding.memory_kind for x in jax.tree.leaves(state) if x.ndim}  # the moments
    {'pinned_host'}

  References:
    MindSpore 2.10 ``nn.AdamOffload`` (the ``"compute"`` mode); Ren et al., "ZeRO-Offload:
    Democratizing Billion-Scale Model Training", USENIX ATC 2021; JAX's "Memories and
    host offloading" guide (the ``"state"`` mode).
  """
  _validate.check_choice("mode", mode, _MODES)
  _validate.check_choice("memory_kind", memory_kind, _HOST_KINDS)
  _stream.check_chunk_bytes(chunk_bytes)
  _check_streams(tx, chunk_bytes)
  if isinstance(tx, FusedStep):
    return _offload_fused(tx, mode, memory_kind)
  if not isinstance(tx, optax.GradientTransformation):
    raise TypeError("`tx` must be an optax GradientTransformation or an adamkit FusedStep, "
                    f"got {type(tx).__name__}.")
  inner = optax.with_extra_args_support(tx)

  def run(updates, state, params, extra, apply):
    _check_state_memory(state, memory_kind)
    if _has_row_sparse(updates):
      out = None if mode == "compute" else _update_touched_rows(
          inner, updates, state, params, extra)
      if out is None:
        return _whole_step(inner, mode, updates, state, params, extra, apply)
      return (_sparse.apply_updates(params, out[0]), out[1]) if apply else out
    return _maybe_streamed(inner, mode, chunk_bytes, updates, state, params, extra, apply)

  def update_fn(updates, state, params=None, **extra):
    return run(updates, state, params, extra, apply=False)

  def step_fn(params, state, grads):
    return run(grads, state, params, {}, apply=True)

  return FusedStep(_host_init(inner.init, mode, memory_kind), step_fn, update_fn)


def _check_streams(tx, chunk_bytes: Any) -> None:
  """An explicit ``chunk_bytes`` only where the state streams: a transform (not a
  :class:`adamkit.FusedStep`, whose one-pass step is not cut), in either mode."""
  if chunk_bytes in (None, "auto"):
    return
  if isinstance(tx, FusedStep):
    raise ValueError(
        f"`chunk_bytes`={chunk_bytes!r}: an offloaded FusedStep (ak.fused_adam, "
        "ak.fused_adamax) is not streamed; it takes chunk_bytes='auto' (the default) or "
        "None. To stream the state, offload the chain form (ak.adam, ak.adamw, ak.adamax).")


def _has_row_sparse(updates) -> bool:
  return any(isinstance(g, RowSparse) for g in jax.tree.leaves(updates, is_leaf=is_row_sparse))


def _whole_state_step(inner, updates, state, params, extra):
  """``mode="state"`` unstreamed: the whole state to the device, updated, back."""
  state = jax.device_put(state, _compat.DEVICE)
  updates, state = inner.update(updates, state, params, **extra)
  return updates, _to_host(state)


def _whole_compute_step(inner, updates, state, params, extra):
  """``mode="compute"`` unstreamed: one host computation of the whole update."""
  def host_update(updates, state, params, extra):
    return inner.update(updates, state, params, **extra)

  spaces = _spaces(state)
  updates, state, params, extra = jax.device_put((updates, state, params, extra),
                                                 _compat.HOST)
  fn = _compat.on_host(host_update, (_compat.DEVICE, spaces))
  with _explain_host_tracing():
    if params is not None and not _reads_params(host_update, updates, state, params, extra):
      params = None  # keep the 4 bytes per parameter of an unused copy off the link
    return fn(updates, state, params, extra)


def _whole_step(inner, mode, updates, state, params, extra, apply):
  """The unstreamed step of either mode; ``apply``: ``(params, state)``."""
  step = _whole_state_step if mode == "state" else _whole_compute_step
  updates, state = step(inner, updates, state, params, extra)
  return (_sparse.apply_updates(params, updates), state) if apply else (updates, state)


def _maybe_streamed(inner, mode, chunk_bytes, updates, state, params, extra, apply=False):
  """The step streamed in calls of ``chunk_bytes`` (``"auto"``: by the platform the step
  is compiled for, :func:`_auto_chunk_bytes`), or whole where streaming does not apply
  (``None``; a state leaf that mirrors no param; one call would hold it all). ``apply``:
  returns ``(params, state)``, the streamed step adding each call's update to its rows.
  In ``mode="compute"`` each call is computed on the host (its state rows never leave
  it)."""
  def with_bytes(nbytes):
    problem = None if nbytes is None else _stream.structure(updates, state, params, nbytes, inner.init)
    if problem is None:
      return _whole_step(inner, mode, updates, state, params, extra, apply)
    if mode == "state":
      return _stream.step_state(inner.update, problem, extra, apply)
    with _explain_host_tracing():
      reads = params is not None and _reads_params(
          lambda u, s, p, e: inner.update(u, s, p, **e), *jax.device_put(
              (updates, state, params, extra), _compat.HOST))
      problem = dataclasses.replace(problem, host=True, send_params=reads)
      return _stream.step_state(inner.update, problem, extra, apply)

  if chunk_bytes != "auto":
    return with_bytes(chunk_bytes)
  return _auto_chunk_bytes(updates, state, params, inner.init, with_bytes)


def _auto_chunk_bytes(updates, state, params, init, with_bytes):
  """``chunk_bytes="auto"``: about 4 MiB per call where the step of a state with no
  quantized moments is compiled for one TPU chip; the whole state at once elsewhere. On a
  CPU host and device memory are one RAM. XLA (jax 0.12) does not compile the streamed
  step for a GPU target (its host copies: "INTERNAL: Copy-start ... has host memory space
  on both sides"), nor for a TPU where quantized codes stream (an async host call's
  shapes, for every quantized format since the codes keep the leaf's shape). On a
  mesh the pieces of a sharded leaf are each one device's, which XLA's partitioner moves
  between devices: more device memory than the whole state (docs/offload.md).
  Concrete arrays tell their devices; inside ``jit`` the steps are traced and
  ``jax.lax.platform_dependent`` and :func:`adamkit._compat.one_device` keep the one of
  the program's platform and device count (a deviceless compile included)."""
  if any(map(_quant.is_qarray, jax.tree.leaves(state, is_leaf=_quant.is_qarray))):
    return with_bytes(None)
  devices = _concrete_devices((updates, params))
  if devices is not None:
    one_tpu = len(devices) == 1 and devices[0].platform == "tpu"
    return with_bytes(_stream.AUTO_BYTES if one_tpu else None)
  if _stream.structure(updates, state, params, _stream.AUTO_BYTES, init) is None:
    return with_bytes(None)  # nothing to stream: one trace
  streamed = lambda: _compat.one_device(lambda: with_bytes(_stream.AUTO_BYTES),  # noqa: E731
                                        lambda: with_bytes(None))
  return jax.lax.platform_dependent(tpu=streamed, default=lambda: with_bytes(None))


def _check_state_memory(state, memory_kind: str) -> None:
  """A concrete state leaf must be in ``memory_kind`` or in device memory (a restored
  state, moved by the step); any other memory kind is refused, naming the leaf."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
    kind = getattr(getattr(leaf, "sharding", None), "memory_kind", None)
    if is_tracer(leaf) or kind in (None, "device", memory_kind):
      continue
    raise ValueError(
        f"`state` leaf '{_validate.path_name(path)}' is in {kind!r} memory; an offloaded "
        f"state lives in {memory_kind!r} (`memory_kind`) and its 0-d leaves in device "
        "memory. Put a restored state back with ak.offload_state(state, params).")


@_validate.foreign_keywords
def adam_offload(learning_rate: Any = 1e-3, b1: float = 0.9, b2: float = 0.999,
                 eps: float = 1e-8, *, eps_mode: str = "hat", nesterov: bool = False,
                 weight_decay: Any = 0.0,
                 weight_decay_mask: Any = _masks.MINDSPORE_DEFAULT,
                 loss_scale: float = 1.0, grad_clip: Any = None,
                 grad_centralization: bool = False, groups: Any = None,
                 mu_dtype: Any = None, nu_dtype: Any = None, nonfinite: str = "propagate",
                 mode: str | None = None, memory_kind: str = "pinned_host",
                 chunk_bytes: Any = "auto") -> FusedStep:
  r"""MindSpore ``nn.AdamOffload``: :func:`adamkit.adam` with its state in host memory.

  .. math::

    m_t &= \beta_1 m_{t-1} + (1-\beta_1) g_t \\
    v_t &= \beta_2 v_{t-1} + (1-\beta_2) g_t^2 \\
    w_t &= w_{t-1} - \alpha_t \frac{\sqrt{1-\beta_2^t}}{1-\beta_1^t}
           \frac{m_t}{\sqrt{v_t}+\epsilon}

  computed on the host (``mode="compute"``, MindSpore's choice) with ``m`` and ``v``
  held in host memory; the update comes back to the device-resident parameters.

  Args:
    learning_rate: and ``b1``, ``b2``, ``eps``, ``eps_mode``, ``nesterov``, ``weight_decay``,
      ``weight_decay_mask``, ``loss_scale``, ``grad_clip``, ``grad_centralization``,
      ``groups``, ``mu_dtype``, ``nu_dtype``, ``nonfinite``: as :func:`adamkit.adam`
      (MindSpore's defaults: decay skips ``beta``/``gamma`` names). A quantized
      ``mu_dtype``/``nu_dtype`` (:class:`adamkit.Quantized`, e.g. ``"8bit"``) keeps codes
      and scales in host memory: a quarter of the float32 state.
    mode: and ``memory_kind``, ``chunk_bytes``: as :func:`adamkit.offload`. Default mode:
      ``"compute"`` (MindSpore's), or ``"state"`` when ``mu_dtype`` or ``nu_dtype`` is a quantized
      format (``"compute"`` cannot step quantized moments on the host).

  Returns:
    ``ak.offload(ak.adam(...), mode=mode, memory_kind=memory_kind,
    chunk_bytes=chunk_bytes)``.

  .. warning::
    MindSpore's ``use_locking`` has no counterpart (JAX updates are functional).

  Examples:
    >>> import jax, jax.numpy as jnp, optax, adamkit as ak
    >>> tx = ak.adam_offload(0.1, weight_decay=0.0)
    >>> # committed to a device first, as ak.UncommittedParamsWarning asks
    >>> params = jax.device_put({"w": jnp.array([1.0, -2.0])}, jax.devices()[0])
    >>> updates, state = tx.update({"w": jnp.array([2.0, -4.0])}, tx.init(params), params)
    >>> optax.apply_updates(params, updates)["w"].round(4)  # first step: w - lr * sign(g)
    Array([ 0.9, -1.9], dtype=float32)

  References:
    Kingma & Ba, "Adam: A Method for Stochastic Optimization", ICLR 2015. Reproduces
    MindSpore 2.10 ``nn.AdamOffload`` (the same formula as ``nn.Adam``).
  """
  if mode is None:
    quantized = any(_quant.is_quantized(_quant.as_format(name, value)) for name, value in
                    (("mu_dtype", mu_dtype), ("nu_dtype", nu_dtype)))
    mode = "state" if quantized else "compute"
  tx = _adam.adam(learning_rate, b1, b2, eps, eps_mode=eps_mode, nesterov=nesterov,
                  weight_decay=weight_decay, weight_decay_mask=weight_decay_mask,
                  loss_scale=loss_scale, grad_clip=grad_clip,
                  grad_centralization=grad_centralization, groups=groups, mu_dtype=mu_dtype,
                  nu_dtype=nu_dtype, nonfinite=nonfinite)
  return offload(tx, mode=mode, memory_kind=memory_kind, chunk_bytes=chunk_bytes)
