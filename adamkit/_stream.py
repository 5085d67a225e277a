"""Streaming an offloaded state through the device a bounded window at a time.

``ak.offload`` keeps a transform's state in host memory. Staging it whole for the update
puts the whole state (and its new copy) in device memory at once, which is what offload is
meant to avoid. Here the state leaves that mirror a parameter (``mu['w']`` mirrors
``params['w']``) are cut into *pieces* (a leaf, or a run of its rows for a large one) and
the pieces into *calls* of about ``chunk_bytes`` of state each. Each call runs the
transform's own ``update`` on a small problem of the same tree structure: the members'
rows, every other leaf with zero rows, the 0-d leaves whole. Its state rows come from host
memory (to the device in ``mode="state"``; in ``mode="compute"`` they stay on the host and
the call runs there) and go back after it, so the device holds about one call's state, and
XLA may overlap one call's copies with the previous call's arithmetic. All calls are traced
into the one jitted step.

Exactness. Per-element arithmetic (Adam, AdamW, their quantized moments: blocks never span
two pieces) and per-row arithmetic (gradient centralization) give the same values as one
update of the whole tree. Global statistics of the gradient (the global norm of
``clip_by_global_norm``, the finiteness test of ``nonfinite="skip"``) are kept by a
*phantom* row placed in a leaf the call does not otherwise hold: its gradient is
``[r, 0, ..., 0]`` with ``r = sqrt(sum of g^2 over the rest of the tree)`` (NaN where the
rest is not finite), its state and param zeros, and its outputs are dropped. This requires
that the transform apply only linear maps to the gradient before such a statistic (loss
unscaling is one). Transforms with per-leaf norms (``ClipGradByNorm``, trust ratios) see
whole leaves only if no leaf is split (a large ``chunk_bytes``); ``chunk_bytes=None`` stages
the state whole, as before streaming existed.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from adamkit import _compat, _quant

AUTO_BYTES = 4 * 2**20  # "auto" on a TPU: about 4 MiB of state per call
# A float leaf of more than ``chunk_bytes / SCAN_FLOOR`` bytes of state streams in pieces
# through a ``lax.scan`` of its own (two at least). Smaller leaves share unrolled calls,
# whose copies XLA's TPU compiler may merge and issue all at once; so does a leaf under
# ``chunk_bytes`` whose rows divide into no more than SCAN_FLOOR equal pieces (a prime
# number of rows would make a long loop of one-row copies).
SCAN_FLOOR = 16


def check_chunk_bytes(chunk_bytes: Any) -> Any:
  """``chunk_bytes`` if valid: ``"auto"``, ``None`` (no streaming) or an int >= 1."""
  ok = chunk_bytes is None or chunk_bytes == "auto" or (
      isinstance(chunk_bytes, numbers.Integral) and not isinstance(chunk_bytes, bool)
      and chunk_bytes >= 1)
  if not ok:
    raise ValueError("`chunk_bytes` must be 'auto', None (stage the state whole) or an "
                     f"int >= 1 (bytes of state per streamed call), got {chunk_bytes!r}.")
  return chunk_bytes


# --------------------------------------------------------------------------- the plan


@dataclasses.dataclass(frozen=True)
class Piece:
  """Rows ``[start, stop)`` of param leaf ``leaf`` and of the state leaves mirroring it."""

  leaf: int
  start: int
  stop: int


def owners(state_flat, params_flat) -> list | None:
  """For each state leaf (with path): the index of the param leaf it mirrors (same shape,
  its path ends with the param's path), ``-1`` for a 0-d leaf; ``None`` if some other leaf
  (a factored moment, a multi-tensor buffer) mirrors no param: such a state is not
  streamed."""
  out = []
  for path, leaf in state_flat:
    shape = tuple(leaf.shape) if _quant.is_qarray(leaf) else tuple(np.shape(leaf))
    if not shape:
      out.append(-1)
      continue
    best = None
    for i, (p_path, p) in enumerate(params_flat):
      n = len(p_path)
      if np.shape(p) == shape and tuple(path[len(path) - n:]) == tuple(p_path) and (
          best is None or n > best[0]):
        best = (n, i)
    if best is None:
      return None
    out.append(best[1])
  return out


def _row_unit(shape: tuple, leaves) -> int:
  """Rows per piece must be a multiple of this: no quantized block spans two pieces."""
  row = math.prod(shape[1:])
  unit = 1
  for leaf in leaves:
    if _quant.is_qarray(leaf) and row:
      b = leaf.fmt.block_size
      unit = math.lcm(unit, b // math.gcd(row, b))
  return unit


def _even_rows(total: int, rows: int, unit: int) -> int | None:
  """The largest multiple of ``unit`` up to ``rows`` that divides ``total`` (equal pieces,
  which one ``lax.scan`` streams), or ``None`` if there is none."""
  for r in range(rows - rows % unit, 0, -unit):
    if total % r == 0:
      return r
  return None


def _tile_rows(shape: tuple, leaves) -> int:
  """Rows per piece that keep a piece on whole TPU tiles of its leaf: a matrix is tiled
  by (8, 128) 32-bit words (16 rows of bf16, 32 of a byte), a vector by 1024 elements;
  a piece cut across a tile makes XLA relayout the whole leaf to slice it."""
  if len(shape) > 2:
    return 1
  itemsize = min(np.dtype(getattr(x, "dtype", np.uint8)).itemsize if not _quant.is_qarray(x)
                 else 1 for x in leaves)
  return 1024 if len(shape) == 1 else 32 // min(itemsize, 4)


def _rows_per_piece(size: int, chunk_bytes: int, shape: tuple, leaves) -> int:
  """Rows per piece of a leaf (``leaves``: its state leaves and the param) cut into at
  least two pieces of at most about ``chunk_bytes`` of state: equal pieces on whole tiles
  where the rows allow it, else equal pieces, else pieces of that size and a shorter last
  one."""
  unit = _row_unit(shape, leaves)
  pieces = max(2, -(-size // chunk_bytes))  # even: no small tail below a format's min_size
  rows = max(unit, -(-shape[0] // pieces // unit) * unit)
  for u in (math.lcm(unit, _tile_rows(shape, leaves)), unit):
    even = _even_rows(shape[0], rows, u) if u <= rows else None
    if even is not None:
      return even
  return rows


def _nbytes(leaf) -> int:
  if _quant.is_qarray(leaf):
    return leaf.nbytes
  return math.prod(np.shape(leaf)) * np.dtype(leaf.dtype).itemsize


def plan(params_flat, state_flat, own, chunk_bytes: int) -> list[list[Piece]]:
  """The calls: lists of pieces of about ``chunk_bytes`` of state each. A leaf larger than
  that is split into runs of rows, each its own call; smaller leaves share calls."""
  calls, current, used = [], [], 0
  for i, (_, p) in enumerate(params_flat):
    shape = tuple(np.shape(p))
    mine = [leaf for leaf, o in zip((s for _, s in state_flat), own) if o == i]
    size = sum(_nbytes(s) for s in mine)
    if not shape or not mine or not shape[0]:
      continue
    rows = _rows_per_piece(size, chunk_bytes, shape, [*mine, p])
    if size <= chunk_bytes and (any(map(_quant.is_qarray, mine)) or shape[0] < 2 or
                                size <= chunk_bytes // SCAN_FLOOR or
                                shape[0] > SCAN_FLOOR * rows):
      if used + size > chunk_bytes and current:
        calls.append(current)
        current, used = [], 0
      current.append(Piece(i, 0, shape[0]))
      used += size
      continue
    calls.extend([Piece(i, a, min(a + rows, shape[0]))] for a in range(0, shape[0], rows))
  if current:
    calls.append(current)
  return calls


# ------------------------------------------------------------------- rows of a leaf


def take(leaf, start: int, stop: int) -> Any:
  """Rows ``[start, stop)`` of a state leaf (a quantized one's blocks with their scales)."""
  if not _quant.is_qarray(leaf):
    return jax.lax.slice_in_dim(leaf, start, stop, axis=0)
  shape = (stop - start, *leaf.shape[1:])
  if leaf.ndim >= 2 and _quant.leaf_layout(leaf.shape, leaf.fmt.block_size):
    return _quant.QuantizedArray(jax.lax.slice_in_dim(leaf.codes, start, stop, axis=0),
                                 jax.lax.slice_in_dim(leaf.scales, start, stop, axis=0),
                                 shape, leaf.fmt)
  row, b = math.prod(leaf.shape[1:]), leaf.fmt.block_size
  codes, scales = _quant.flat_blocks(leaf)
  lo, hi = start * row // b, -(-stop * row // b)
  return _quant.from_code_blocks(codes[lo:hi], scales[lo:hi], shape, leaf.fmt)


def blank(template) -> Any:
  """Zeros as ``template`` (from :meth:`Problem.templates`) is: quantized zeros for a
  quantized one. The stand-in of a leaf a call does not hold, or of a phantom row."""
  if _quant.is_qarray(template):
    return _quant.zeros(template.shape, template.fmt)
  return jnp.zeros(template.shape, template.dtype)


def _rows(template, n: int) -> Any:
  """``template`` cut to its first ``n`` rows (abstract), for a phantom row's stand-in."""
  shape = (n, *template.shape[1:])
  if _quant.is_qarray(template):
    return _quant.QuantizedArray(None, None, shape, template.fmt)
  return jax.ShapeDtypeStruct(shape, template.dtype)


def concat_rows(a, b) -> Any:
  """Rows of ``a`` then of ``b`` (quantized: ``a`` fills whole blocks, see
  :func:`_aligned`)."""
  if not _quant.is_qarray(a):
    return jnp.concatenate([a, b.astype(a.dtype)], axis=0)
  (ca, sa), (cb, sb) = _quant.flat_blocks(a), _quant.flat_blocks(b)
  shape = (a.shape[0] + b.shape[0], *a.shape[1:])
  return _quant.from_code_blocks(jnp.concatenate([ca, cb]), jnp.concatenate([sa, sb]), shape,
                                 a.fmt)


def _aligned(leaf, rows: int) -> bool:
  """Whether a quantized leaf of ``rows`` rows fills whole blocks (no padding)."""
  return not _quant.is_qarray(leaf) or (rows * math.prod(leaf.shape[1:])) % leaf.fmt.block_size == 0


# ------------------------------------------------------------------- one call's problem


@dataclasses.dataclass
class Problem:
  """Everything one streamed step needs, flattened once."""

  g_flat: list
  g_def: Any
  p_flat: list | None
  s_flat: list
  s_def: Any
  own: list
  calls: list
  init: Callable | None = None
  host: bool = False  # mode="compute": each call computed on the host
  send_params: bool = True  # host calls: whether the update reads the params

  def templates(self, call, slot) -> list:
    """The state leaves ``init`` gives the call's shapes (abstract): what each stand-in
    must be (float, or quantized in which format) for the transform to accept it."""
    shapes = [jax.ShapeDtypeStruct(np.shape(g), g.dtype) for g in
              call_grads(self, call, slot, jnp.float32(0))]
    state = jax.eval_shape(self.init, self.g_def.unflatten(shapes))
    return self.s_def.flatten_up_to(state)

  def mine(self, i: int) -> list:
    return [s for s, o in zip(self.s_flat, self.own) if o == i]

  def phantom_slot(self, call: list[Piece]) -> int | None:
    """The param leaf that carries the call's phantom row: preferably one the call does
    not hold (the row is then its only row), else a held one whose rows fill whole
    quantized blocks (the row is appended); ``None`` if there is none."""
    held = {pc.leaf: pc for pc in call}
    free = [i for i, g in enumerate(self.g_flat) if i not in held and np.ndim(g) >= 1]
    if free:
      return free[0]
    for pc in call:
      if all(_aligned(s, pc.stop - pc.start) for s in self.mine(pc.leaf)):
        return pc.leaf
    return None


def piece_stats(problem: Problem) -> tuple:
  """Per call: the sum of squares of its gradient rows (float32) and whether they are all
  finite; with the 0-d leaves (held by every call) apart."""
  sums, finite = [], []
  for call in problem.calls:
    rows = [jax.lax.slice_in_dim(problem.g_flat[pc.leaf], pc.start, pc.stop, axis=0)
            for pc in call]
    sums.append(sum(jnp.sum(jnp.square(r.astype(jnp.float32))) for r in rows))
    finite.append(jnp.all(jnp.stack([jnp.all(jnp.isfinite(r)) for r in rows])))
  return jnp.stack(sums), jnp.stack(finite)


def phantom_value(sums, finite, k: int):
  """``sqrt`` of the other calls' sums of squares, NaN where one of them is not finite."""
  others = jnp.arange(sums.shape[0]) != k
  rest = jnp.sum(jnp.where(others, sums, 0.0))
  ok = jnp.all(jnp.where(others, finite, True))
  return jnp.where(ok, jnp.sqrt(rest), jnp.nan)


def call_grads(problem: Problem, call, slot, value) -> list:
  """The gradient leaves of one call: held rows, zero rows, the phantom row, 0-d whole."""
  held = {pc.leaf: pc for pc in call}
  out = []
  for i, g in enumerate(problem.g_flat):
    if np.ndim(g) == 0:
      out.append(g)
    elif i in held or i == slot:
      rows = [] if i not in held else [
          jax.lax.slice_in_dim(g, held[i].start, held[i].stop, axis=0)]
      if i == slot:
        row = jnp.zeros((1, *g.shape[1:]), g.dtype)
        rows.append(row.reshape(1, -1).at[0, 0].set(value.astype(g.dtype)).reshape(row.shape))
      out.append(rows[0] if len(rows) == 1 else jnp.concatenate(rows, axis=0))
    else:
      out.append(jnp.zeros((0, *g.shape[1:]), g.dtype))
  return out


def call_params(problem: Problem, call, slot) -> list | None:
  if problem.p_flat is None:
    return None
  held = {pc.leaf: pc for pc in call}
  out = []
  for i, p in enumerate(problem.p_flat):
    if np.ndim(p) == 0:
      out.append(p)
    elif i in held:
      rows = jax.lax.slice_in_dim(p, held[i].start, held[i].stop, axis=0)
      out.append(rows if i != slot else jnp.concatenate([rows, jnp.zeros_like(rows[:1])]))
    else:
      out.append(jnp.zeros((int(i == slot), *p.shape[1:]), p.dtype))
  return out


def call_state(problem: Problem, call, slot, rows_of: Callable) -> list:
  """The state leaves of one call; ``rows_of(j, piece)`` fetches state leaf ``j``'s rows."""
  held = {pc.leaf: pc for pc in call}
  out = []
  for j, (s, o, t) in enumerate(zip(problem.s_flat, problem.own,
                                    problem.templates(call, slot))):
    if o == -1:
      out.append(s)
    elif o in held:
      rows = rows_of(j, held[o])
      if o == slot and problem.host:  # joined in the host computation (_host_call)
        out.append(Phantom(rows, jax.device_put(blank(_rows(t, 1)), HOST)))
      else:
        out.append(rows if o != slot else concat_rows(rows, blank(_rows(t, 1))))
    else:
      out.append(blank(t))
  return out


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Phantom:
  """A host-resident state leaf's rows and its phantom row (zeros), to be joined in the
  host computation: joined outside it, they would mix memory spaces."""

  rows: Any
  row: Any


def run_call(inner_update: Callable, problem: Problem, call, slot, value, rows_of, extra):
  """One call: the transform's update on the call's problem. Returns the update leaves
  and the state leaves of the call, flattened like the full ones."""
  g = problem.g_def.unflatten(call_grads(problem, call, slot, value))
  p = None if problem.p_flat is None else problem.g_def.unflatten(
      call_params(problem, call, slot))
  s = call_state(problem, call, slot, rows_of)
  if problem.host:
    u, new_s = _host_call(inner_update, problem, call, (g, s, p), extra)
  else:
    u, new_s = inner_update(g, problem.s_def.unflatten(s), p, **extra)
  return problem.g_def.flatten_up_to(u), problem.s_def.flatten_up_to(new_s)


def _host_call(inner_update: Callable, problem: Problem, call, args, extra):
  """``mode="compute"``: the call's update computed on the host. Its gradient (and param)
  rows go down, the update rows come up; its state rows stay on the host, phantom row
  dropped there."""
  held = {pc.leaf: pc.stop - pc.start for pc in call}
  g, s, p = args  # s: call_state's flat leaves
  spaces = problem.s_def.unflatten([HOST if o != -1 else DEVICE for o in problem.own])

  def host(g, s, p, extra):
    s = [concat_rows(x.rows, x.row) if isinstance(x, Phantom) else x for x in s]
    u, new_s = inner_update(g, problem.s_def.unflatten(s), p, **extra)
    flat = problem.s_def.flatten_up_to(new_s)
    flat = [trim(x, held[o]) if o in held else x for x, o in zip(flat, problem.own)]
    return u, problem.s_def.unflatten(flat)

  p = p if problem.send_params else None
  g, s, p, extra = jax.device_put((g, s, p, extra), HOST)
  return _compat.on_host(host, (DEVICE, spaces))(g, s, p, extra)


def assemble_updates(problem: Problem, per_call: list, whole_u: dict) -> Any:
  """The full update leaves: a scanned leaf's whole, else concatenated from the calls'
  held rows (0-d leaves: the first unrolled call's, every call computes the same)."""
  pieces = {i: [] for i in range(len(problem.g_flat))}
  for call, u in per_call:
    for pc in call:
      pieces[pc.leaf].append(u[pc.leaf][:pc.stop - pc.start])
  out = {**_zero_d_updates(problem, per_call, whole_u), **whole_u}
  for i, g in enumerate(problem.g_flat):
    if i not in out:
      out[i] = (jnp.zeros_like(g) if not pieces[i] else pieces[i][0] if len(pieces[i]) == 1
                else jnp.concatenate(pieces[i], axis=0))
  return problem.g_def.unflatten([out[i] for i in range(len(problem.g_flat))])


def trim(leaf, rows: int) -> Any:
  """The first ``rows`` rows of a call's state leaf (drops a phantom row)."""
  if leaf.shape[0] == rows:
    return leaf
  return take(leaf, 0, rows)


def _same_kind(real, template) -> bool:
  if _quant.is_qarray(real) or _quant.is_qarray(template):
    return _quant.is_qarray(real) and _quant.is_qarray(template) and real.fmt == template.fmt
  return True


def _accepts(problem: Problem) -> bool:
  """Whether every call's held rows are stored as the transform stores a leaf of their
  shape (a quantized leaf cut below its format's ``min_size`` would not be)."""
  for call in problem.calls:
    slot = problem.phantom_slot(call)
    if slot is None:
      return False
    held = {pc.leaf for pc in call}
    temps = problem.templates(call, slot)
    if not all(_same_kind(s, t) for s, o, t in zip(problem.s_flat, problem.own, temps)
               if o in held):
      return False
  return True


def structure(updates, state, params, chunk_bytes: int, init: Callable) -> Problem | None:
  """The :class:`Problem` of one step, or ``None`` where the state cannot be streamed
  (a leaf that mirrors no param) or a single call would hold it all anyway."""
  g_flat, g_def = jax.tree_util.tree_flatten_with_path(updates)
  s_flat, s_def = jax.tree_util.tree_flatten_with_path(state, is_leaf=_quant.is_qarray)
  own = owners(s_flat, g_flat)
  if own is None:
    return None
  calls = plan(g_flat, s_flat, own, chunk_bytes)
  if len(calls) <= 1:
    return None
  p_flat = None if params is None else g_def.flatten_up_to(params)
  problem = Problem([g for _, g in g_flat], g_def, p_flat, [s for _, s in s_flat], s_def,
                    own, calls, init)
  return problem if _accepts(problem) else None


def new_scalars(problem: Problem, first_state: list) -> dict:
  """The 0-d state leaves after the step: every call computes the same; call 0's."""
  return {j: first_state[j] for j, o in enumerate(problem.own) if o == -1}


HOST, DEVICE = _compat.HOST, _compat.DEVICE


# ----------------------------------------------------------------------- the two modes


def _host_typed(leaf) -> Any:
  """``leaf`` typed as host memory (a state restored into device memory is moved once)."""
  def one(x):
    space = getattr(getattr(x, "aval", None), "memory_space", None)
    return x if space == HOST else jax.device_put(x, HOST)
  return jax.tree.map(one, leaf)


def _host_take(leaf, pc: Piece, to=DEVICE) -> Any:
  """Rows of a host leaf, cut on the host and sent to the device (``to``: left there)."""
  return _compat.on_host(lambda x: take(x, pc.start, pc.stop), to)(leaf)


def concat(pieces: list) -> Any:
  """A leaf's rows, in order, as one leaf (quantized: blocks and scales)."""
  if len(pieces) == 1:
    return pieces[0]
  if not _quant.is_qarray(pieces[0]):
    return jnp.concatenate(pieces, axis=0)
  out = pieces[0]
  for q in pieces[1:]:
    out = concat_rows(out, q)
  return out


def _host_concat(pieces: list) -> Any:
  """The new rows of a leaf sent to the host and joined there, in one host computation:
  a leaf passed from one host computation to the next would be staged in device memory
  (XLA's TPU compiler does so), so each leaf is written once."""
  return _compat.on_host(lambda *xs: concat(list(xs)), HOST)(*pieces)


def _collect(problem: Problem, call, new: list, rows: dict) -> list:
  """Sends the call's new state rows (phantom dropped) to the host and adds them to
  ``rows`` (leaf -> list); returns them."""
  sent = []
  for pc in call:
    for j, o in enumerate(problem.own):
      if o == pc.leaf:
        sent.append(new[j] if problem.host else jax.device_put(
            trim(new[j], pc.stop - pc.start), HOST))
        rows.setdefault(j, []).append(sent[-1])
  return sent


WINDOW = 2  # calls in flight: call k's rows come down once call k - WINDOW's went up


def _after(states: list, sent: list, k: int) -> list:
  """``states`` made to depend on call ``k - WINDOW``'s rows being back on the host, so
  XLA brings call ``k``'s rows down no earlier: without it, it may fetch every call's
  rows at once (one merged host computation), the whole state on the device again."""
  if k < WINDOW or sent[k - WINDOW] is None:
    return states
  return jax.lax.optimization_barrier((states, sent[k - WINDOW]))[0]


def _zero_d_updates(problem: Problem, per_call: list, whole_u: dict) -> dict:
  """The 0-d leaves' updates (every call computes the same; the first one's)."""
  return {i: whole_u[i] if i in whole_u else per_call[0][1][i]
          for i, g in enumerate(problem.g_flat) if np.ndim(g) == 0}


def scan_groups(problem: Problem) -> list[list[int]]:
  """The calls, grouped: the equal pieces of one leaf that together cover it (streamed by
  one ``lax.scan``), and every other call alone (unrolled)."""
  groups = []
  for k, call in enumerate(problem.calls):
    last = problem.calls[groups[-1][-1]] if groups else None
    if last is not None and len(call) == 1 and len(last) == 1 and \
        call[0].leaf == last[0].leaf and call[0].start == last[0].stop and \
        call[0].stop - call[0].start == last[0].stop - last[0].start:
      groups[-1].append(k)
    else:
      groups.append([k])
  return groups


def _stacked(leaf, m: int) -> Any:
  """A whole host leaf viewed as ``m`` equal pieces of rows (a reshape, no copy)."""
  if not _quant.is_qarray(leaf):
    return leaf.reshape(m, -1, *leaf.shape[1:])
  # Only the leading axis is split: a reshape that merges tiled axes is a relayout that
  # XLA's TPU host offloading does not implement for host buffers.
  return (leaf.codes.reshape(m, -1, *leaf.codes.shape[1:]),
          leaf.scales.reshape(m, -1, *leaf.scales.shape[1:]))


def _unstacked(ys, like) -> Any:
  if not _quant.is_qarray(like):
    return ys.reshape(like.shape)
  codes, scales = ys
  return _quant.QuantizedArray(codes.reshape(like.codes.shape),
                               scales.reshape(like.scales.shape), like.shape, like.fmt)


def _piece_rows(x, like, rows: int) -> Any:
  """One scanned piece of a state leaf, as the leaf's ``rows`` rows, on the device."""
  if not _quant.is_qarray(like):
    return jax.device_put(x, DEVICE)
  codes, scales = jax.device_put(x, DEVICE)
  return _quant.from_code_blocks(codes, scales, (rows, *like.shape[1:]), like.fmt)


def _to_host_rows(q) -> Any:
  return jax.device_put((q.codes, q.scales) if _quant.is_qarray(q) else q, HOST)


def scan_group(update: Callable, problem: Problem, ks: list, values, states: list,
               extra: dict, apply: bool = False) -> tuple:
  """The calls ``ks`` (the equal pieces of one leaf) as one ``lax.scan``: each iteration
  brings one piece's state rows down, updates them and sends them up, so XLA keeps one
  iteration's buffers (and the next one's copies) in device memory.

  Returns the leaf's update (``apply``: its new param, written piece by piece over the old
  one, which the loop carries: no whole update is ever held), ``{state leaf: new leaf}``
  and the new 0-d state leaves with the 0-d leaves' updates."""
  call = problem.calls[ks[0]]
  i, m = call[0].leaf, len(ks)
  rows = call[0].stop - call[0].start
  slot = problem.phantom_slot(call)
  js = [j for j, o in enumerate(problem.own) if o == i]
  g = problem.g_flat[i].reshape(m, rows, *problem.g_flat[i].shape[1:])
  p = None if problem.p_flat is None else problem.p_flat[i].reshape(g.shape)
  xs = (g, None if apply else p, [_stacked(states[j], m) for j in js], values,
        jnp.arange(m))
  piece = [Piece(i, 0, rows)]

  def body(carry, x):
    g_k, p_k, s_k, v, k = x
    if apply:
      p_k = jax.lax.dynamic_index_in_dim(carry, k, keepdims=False)
    sub = dataclasses.replace(problem, g_flat=_swap(problem.g_flat, i, g_k),
                              p_flat=None if p_k is None else _swap(problem.p_flat, i, p_k))
    pieces = dict(zip(js, s_k))
    rows_of = lambda j, pc: pieces[j] if problem.host else _piece_rows(  # noqa: E731
        pieces[j], problem.s_flat[j], rows)
    u, new = run_call(update, sub, piece, slot, v, rows_of, extra)
    out = [new[j] if problem.host else _to_host_rows(trim(new[j], rows)) for j in js]
    zero_d = {n: u[n] for n, g_n in enumerate(problem.g_flat) if np.ndim(g_n) == 0}
    if apply:
      new_p = optax.apply_updates(p_k, u[i][:rows])
      carry = jax.lax.dynamic_update_index_in_dim(carry, new_p, k, 0)
      return carry, (out, (new_scalars(problem, new), zero_d))
    return carry, (u[i][:rows], out, (new_scalars(problem, new), zero_d))

  carry, ys = jax.lax.scan(body, p if apply else 0, xs)
  u, (out, firsts) = (carry, ys) if apply else (ys[0], ys[1:])
  new = {j: _unstacked(y, states[j]) for j, y in zip(js, out)}
  scalars, zero_d = jax.tree.map(lambda x: x[0], firsts)
  return {**zero_d, i: u.reshape(problem.g_flat[i].shape)}, new, scalars


def _swap(leaves: list, i: int, x) -> list:
  out = list(leaves)
  out[i] = x
  return out


def step_state(update: Callable, problem: Problem, extra: dict, apply: bool = False):
  """The streamed step. ``mode="state"``: each call's state rows come down, are updated on
  the device, and go back up; the device holds one call's rows (and XLA's copies in
  flight). ``mode="compute"`` (``problem.host``): each call's gradient rows go to the host,
  its update is computed there beside its state rows, and its update rows come back.

  Returns ``(updates, state)``, or with ``apply`` ``(params, state)``: each call's update
  is added to its param rows at once, written over the (donated) params, so the step never
  holds a whole update (4 bytes per float32 parameter) in device memory."""
  sums, finite = piece_stats(problem)
  states = [s if o == -1 else _host_typed(s) for s, o in zip(problem.s_flat, problem.own)]
  per_call, scalars, rows, sent, whole_u = [], None, {}, [], {}
  for ks in scan_groups(problem):
    if len(ks) > 1 and _covers(problem, ks):
      values = jnp.stack([phantom_value(sums, finite, k) for k in ks])
      u, new, sc = scan_group(update, problem, ks, values, states, extra, apply)
      whole_u = {**u, **whole_u}  # 0-d leaves: the first group's
      if apply:
        problem = _with_param(problem, ks, u)
      states = [new.get(j, x) for j, x in enumerate(states)]
      scalars = sc if scalars is None else scalars
      sent.extend([None] * len(ks))
      continue
    for k in ks:
      call = problem.calls[k]
      u, new = _unrolled(update, problem, k, sums, finite, states, sent, extra)
      per_call.append((call, u))
      if apply:
        problem = _applied(problem, call, u)
      scalars = new_scalars(problem, new) if scalars is None else scalars
      sent.append(_collect(problem, call, new, rows))
  for j, pieces in rows.items():
    states[j] = _host_concat(pieces)
  for j, v in scalars.items():
    states[j] = v
  state = problem.s_def.unflatten(states)
  if not apply:
    return assemble_updates(problem, per_call, whole_u), state
  zero_d = _zero_d_updates(problem, per_call, whole_u)  # the other leaves hold theirs
  params = [optax.apply_updates(p, zero_d[i]) if i in zero_d else p
            for i, p in enumerate(problem.p_flat)]
  return problem.g_def.unflatten(params), state


def _with_param(problem: Problem, ks: list, new_leaves: dict) -> Problem:
  """``problem`` with the scanned leaf's new param (the calls after it read it)."""
  i = problem.calls[ks[0]][0].leaf
  return dataclasses.replace(problem, p_flat=_swap(problem.p_flat, i, new_leaves[i]))


def _applied(problem: Problem, call: list[Piece], u: list) -> Problem:
  """``problem`` with the call's update added to its param rows, each written over the
  old rows (``dynamic_update_slice``: in place where the params are donated)."""
  p_flat = list(problem.p_flat)
  for pc in call:
    old = jax.lax.slice_in_dim(p_flat[pc.leaf], pc.start, pc.stop, axis=0)
    new = optax.apply_updates(old, u[pc.leaf][:pc.stop - pc.start])
    p_flat[pc.leaf] = jax.lax.dynamic_update_slice_in_dim(p_flat[pc.leaf], new, pc.start, 0)
  return dataclasses.replace(problem, p_flat=p_flat)


def _covers(problem: Problem, ks: list) -> bool:
  """Whether the group's pieces cover their leaf and its state is unquantized (scanned
  codes and scales: XLA's TPU host offloading cannot yet view a host buffer of codes as
  pieces, "only handling bitcasts with majormost dimension of size 1"; such a leaf is
  streamed unrolled)."""
  first, last = problem.calls[ks[0]][0], problem.calls[ks[-1]][0]
  if any(_quant.is_qarray(s) for s in problem.mine(first.leaf)):
    return False
  return first.start == 0 and last.stop == problem.g_flat[first.leaf].shape[0]


def _unrolled(update, problem: Problem, k: int, sums, finite, states, sent, extra):
  """Call ``k`` traced on its own (small leaves sharing a call, unequal pieces)."""
  call = problem.calls[k]
  slot = problem.phantom_slot(call)
  gated = _after(states, sent, k)
  rows_of = lambda j, pc: _host_take(gated[j], pc, HOST if problem.host else DEVICE)  # noqa: E731
  return run_call(update, problem, call, slot, phantom_value(sums, finite, k), rows_of, extra)
