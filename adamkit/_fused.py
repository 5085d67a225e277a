"""The fused step: Adam and AdaMax in one pass over memory, params included.

Why a separate API. An optax ``GradientTransformation`` returns *updates*, and
``optax.apply_updates`` adds them to the params afterwards; XLA:CPU then emits an Adam step as
three loops (first moment, second moment, params), about 40 bytes of memory traffic per
float32 parameter, while the step's data is 28 bytes (read p, g, m, v; write p, m, v).
Memory bandwidth, not arithmetic, bounds the step on a CPU (the host-compute offload path
runs it there), so the fast path is a *fused step* ``(grads, state, params) -> (params,
state)`` that computes decay, moments, direction, learning rate and the new params together:

* on CPU, with the compiled kernel available (see :func:`build_cpu_kernel`), one call of a
  C++ ``jax.ffi`` kernel reads and writes each byte once, in place when the caller donates
  params and state; in multi-tensor mode (Paddle ``use_multi_tensor``) the moments of all
  leaves of a dtype are one flat buffer and one call updates up to 32 leaves, so 300 small
  leaves cost 10 launches and 600 fewer buffers per step, not 900 loops;
* elsewhere (other backends, other dtypes, no kernel), the same arithmetic in plain JAX,
  leaf by leaf (XLA fuses each leaf's step; with the flat multi-tensor state each leaf's
  moments are written back in place with ``dynamic_update_slice``, which XLA compiles
  slowly for hundreds of leaves: seconds).

The reference is the named optimizer: for the options it accepts,
``fused_adam(...).step(p, s, g)[0]`` equals ``optax.apply_updates(p, adam(...).update(g, s2,
p)[0])`` to float32 rounding; the tests check every option on both backends.

The argument order ``step(params, state, grads) -> (params, state)`` puts the donated inputs
in the order of the outputs: ``jax.jit`` pairs donated buffers with outputs of the same shape
in order, and a mismatch (say params paired with a first moment) makes XLA copy every
buffer before the kernel runs, a whole extra pass.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from adamkit import _adam, _kernels, _masks, _schedules, _sparse, _validate
from adamkit._adamax import adamax_direction
from adamkit._dtypes import compute_dtype
from adamkit._sparse_types import RowSparse, gather_rows, safe_ids, scatter_rows

_LEAVES_PER_CALL = 32  # multi-tensor: leaves per kernel call
_MIN_LEAF = 1 << 15  # per leaf, backend="auto": smaller leaves stay in XLA


class FusedAdamState(NamedTuple):
  count: jax.Array  # int32 scalar, steps taken (saturates at int32 max)
  # First and second moment (AdaMax: infinity norm), ``mu_dtype``/``nu_dtype`` or the
  # params' dtype. Per leaf: trees of the params' shapes. Multi-tensor: a dict
  # {dtype name: 1-D buffer} holding the leaves of that moment dtype back to back, in the
  # params' tree order.
  mu: Any
  nu: Any


class FusedStep(NamedTuple):
  """A fused optimizer: ``init(params) -> state`` and ``step(params, state, grads) ->
  (params, state)``. Jit ``step`` with ``donate_argnums=(0, 1)``: the kernel then updates
  params and state in place."""

  init: Callable[[optax.Params], FusedAdamState]
  step: Callable[[optax.Params, FusedAdamState, optax.Updates],
                 tuple[optax.Params, FusedAdamState]]


class _Slot(NamedTuple):
  """Where a leaf's moments live: ``buffer`` key (None: the leaf's own arrays), offset."""
  buffer: str | None
  offset: int


def _flat_layout(leaves, dtype_of) -> tuple[list[_Slot], dict[str, int]]:
  """Multi-tensor layout: leaves of one moment dtype back to back, in tree order."""
  sizes: dict[str, int] = {}
  slots = []
  for leaf in leaves:
    key = jnp.dtype(dtype_of(leaf)).name
    slots.append(_Slot(key, sizes.get(key, 0)))
    sizes[key] = sizes.get(key, 0) + int(np.prod(leaf.shape))
  return slots, sizes


def _dense_xla(kind, p, g, m, v, *, decay, wd, lr, b1, b2, eps, bc1, bc2, eps_mode, nesterov):
  """One dense leaf in plain JAX, with the reference's rounding points: the direction in the
  gradient's dtype, then the learning-rate link, then optax.apply_updates in the params'
  dtype. Returns ``(p, m, v)``."""
  if decay:
    g = g + (wd * p.astype(jnp.float32)).astype(g.dtype)
  g_dtype = g.dtype
  dt = compute_dtype(g)
  g = g.astype(dt)
  if kind == "adamax":
    u, m2, v2 = adamax_direction(g, m.astype(dt), v.astype(dt), b1=b1, b2=b2, eps=eps, bc1=bc1)
  else:
    u, m2, v2 = _adam.adam_direction(g, m.astype(dt), v.astype(dt), b1=b1, b2=b2, eps=eps,
                                     bc1=bc1, bc2=bc2, eps_mode=eps_mode, nesterov=nesterov)
  u = u.astype(g_dtype)
  step = (-lr * u.astype(compute_dtype(u))).astype(u.dtype)
  return (p + step).astype(p.dtype), m2.astype(m.dtype), v2.astype(v.dtype)


def _lazy_rows_xla(p, g: RowSparse, m, v, *, lr, merge, **hyper):
  """One lazy row-sparse leaf in plain JAX: the rows of ``g`` move as in
  ``ak.sparse_adam`` + ``ak.apply_updates`` (same rounding points); the others keep their
  bits. Returns ``(p, m, v)``."""
  ids, u, m, v = _sparse.lazy_rows(g, m, v, merge=merge, backend="xla", **hyper)
  u = u.astype(g.dtype)
  step = (-lr * u.astype(compute_dtype(u))).astype(u.dtype)
  return scatter_rows(p, ids, step, add=True), m, v


# --------------------------------------------------------------------- the fused step


def _fused(algo: str, learning_rate, b1, b2, eps, *, eps_mode, nesterov, weight_decay,
           weight_decay_mask, mu_dtype, nu_dtype, multi_tensor, backend, lazy=True,
           unique_ids=False) -> FusedStep:
  _adam.check_adam_hyper(b1, b2, eps)
  _validate.check_choice("eps_mode", eps_mode, ("hat", "corrected"))
  for name, flag in (("nesterov", nesterov), ("multi_tensor", multi_tensor), ("lazy", lazy),
                     ("unique_ids", unique_ids)):
    _validate.check_bool(name, flag)
  _validate.check_choice("backend", backend, _kernels.BACKENDS)
  if not callable(weight_decay):
    _validate.check_non_negative("weight_decay", weight_decay)
  lr_schedule = _schedules.as_schedule(learning_rate, "learning_rate")
  decays = callable(weight_decay) or weight_decay != 0
  mu_dtype = None if mu_dtype is None else jnp.dtype(mu_dtype)
  nu_dtype = None if nu_dtype is None else jnp.dtype(nu_dtype)
  kind = "adamax" if algo == "adamax" else eps_mode
  mu_of = lambda p: mu_dtype or p.dtype  # noqa: E731
  nu_of = lambda p: nu_dtype or p.dtype  # noqa: E731

  def init_fn(params):
    _validate.check_float_params(params)
    if multi_tensor:
      leaves = jax.tree.leaves(params)
      mu = {k: jnp.zeros([n], k) for k, n in _flat_layout(leaves, mu_of)[1].items()}
      nu = {k: jnp.zeros([n], k) for k, n in _flat_layout(leaves, nu_of)[1].items()}
    else:
      mu, nu = _adam.zero_moments(params, mu_dtype, nu_dtype)
    return FusedAdamState(count=jnp.zeros([], jnp.int32), mu=mu, nu=nu)

  def step_fn(params, state, grads):
    _validate.check_matching_trees(grads, params)
    leaves, treedef = jax.tree.flatten(params)
    g_l = treedef.flatten_up_to(grads)
    if multi_tensor:
      m_slots, m_sizes = _flat_layout(leaves, mu_of)
      v_slots, v_sizes = _flat_layout(leaves, nu_of)
      for name, sizes, bufs in (("mu", m_sizes, state.mu), ("nu", v_sizes, state.nu)):
        got = {k: tuple(b.shape) for k, b in dict(bufs).items()}
        if got != {k: (n,) for k, n in sizes.items()}:
          raise ValueError(f"The multi-tensor state's {name} buffers {got} do not match the "
                           f"params (expected {sizes}): was the state made by this optimizer "
                           "for these params?")
      mu, nu = dict(state.mu), dict(state.nu)
      m_l = [lax.slice(mu[s.buffer], (s.offset,), (s.offset + p.size,)).reshape(p.shape)
             for s, p in zip(m_slots, leaves)]
      v_l = [lax.slice(nu[s.buffer], (s.offset,), (s.offset + p.size,)).reshape(p.shape)
             for s, p in zip(v_slots, leaves)]
    else:
      _validate.check_matching_trees(state.nu, params, what="optimizer state")
      m_l = treedef.flatten_up_to(state.mu)
      v_l = treedef.flatten_up_to(state.nu)
    lr = _schedules.scalar_or_schedule(lr_schedule, state.count)
    wd = _schedules.scalar_or_schedule(weight_decay, state.count)
    count = optax.safe_increment(state.count)
    bc1, bc2 = _adam.bias_corrections(b1, b2, count)
    b1_, b2_, eps_ = (jnp.asarray(x, jnp.float32) for x in (b1, b2, eps))
    keep = _masks.resolve_mask(weight_decay_mask, params) if decays else None
    k_l = [bool(k) for k in treedef.flatten_up_to(keep)] if decays else [False] * len(leaves)
    new_p, new_m, new_v = list(leaves), list(m_l), list(v_l)
    # Row-sparse gradients, as in ak.sparse_adam: the touched rows decay, once per
    # occurrence (MindSpore's rule); then the lazy row step below, or (lazy=False) the
    # dense step on the densified gradient.
    sparse = [i for i, g in enumerate(g_l) if isinstance(g, RowSparse)]
    if sparse and algo == "adamax":
      raise TypeError("fused_adamax takes dense gradients (AdaMax has no row-sparse form in "
                      "MindSpore or Paddle): pass `g.todense()` for a RowSparse leaf.")
    for i in sparse:
      g = g_l[i]
      if k_l[i]:
        rows = gather_rows(leaves[i], safe_ids(g.indices, g.num_rows))
        g = g.with_values(g.values + (wd * rows.astype(jnp.float32)).astype(g.dtype))
        k_l[i] = False
      g_l[i] = g if lazy else g.todense(like=leaves[i])
    if not lazy:
      sparse = []

    def one_offset(i):  # a kernel call takes one offset into both moment buffers
      return not multi_tensor or m_slots[i].offset == v_slots[i].offset

    def is_f32(i):
      return one_offset(i) and all(x.dtype == jnp.float32
                                   for x in (leaves[i], g_l[i], m_l[i], v_l[i]))

    if backend == "kernel" and not _kernels.cpu_kernel_available():
      raise RuntimeError("backend='kernel' but the adamkit CPU kernel is not built: run "
                         "`python -m adamkit._kernels` (see adamkit.build_cpu_kernel).")
    use_kernel = backend == "kernel" or (backend == "auto" and _kernels.on_cpu(params)
                                         and _kernels.cpu_kernel_available())
    # Per leaf, a kernel call costs more than XLA's fused loop on a small leaf.
    on_kernel = [i for i in range(len(leaves)) if use_kernel and is_f32(i) and i not in sparse
                 and (multi_tensor or backend == "kernel" or leaves[i].size >= _MIN_LEAF)]
    # A lazy row step runs on the kernel on one CPU device (auto), or when forced.
    on_sparse_kernel = [i for i in sparse if one_offset(i) and _kernels.use_sparse_kernel(
        backend, leaves[i], g_l[i].values, m_l[i], v_l[i], ids=g_l[i].indices,
        num_rows=g_l[i].num_rows)]
    if on_kernel or on_sparse_kernel:
      scalars = _kernels.kernel_scalars(kind, b1_, b2_, eps_, lr, wd, bc1, bc2)
    for i in on_sparse_kernel:
      g = g_l[i]
      args = (kind, nesterov, not unique_ids, scalars, g.indices, g.values)
      if multi_tensor:
        key = m_slots[i].buffer
        mu[key], nu[key], new_p[i] = _kernels.sparse_lazy_call(
            *args, mu[key], nu[key], leaves[i], num_rows=g.num_rows, offset=m_slots[i].offset)
      else:
        new_m[i], new_v[i], new_p[i] = _kernels.sparse_lazy_call(
            *args, m_l[i], v_l[i], leaves[i], num_rows=g.num_rows)
    if on_kernel:
      if multi_tensor:
        # Runs of consecutive float32 leaves with one decay flag, at most _LEAVES_PER_CALL
        # each (XLA's compile time grows faster than linearly in a call's operand count).
        # Each call updates its stretch of the flat moments in place.
        runs, run = [], []
        for i in on_kernel:
          if run and (i != run[-1] + 1 or k_l[i] != k_l[run[0]] or len(run) == _LEAVES_PER_CALL):
            runs.append(run)
            run = []
          run.append(i)
        runs.append(run)
        key = m_slots[on_kernel[0]].buffer  # "float32" for both moments
        for run in runs:
          p_o, mu[key], nu[key] = _kernels.dense_call(
              kind, nesterov, k_l[run[0]], m_slots[run[0]].offset, scalars,
              [leaves[i] for i in run], [g_l[i] for i in run], mu[key], nu[key])
          for j, i in enumerate(run):
            new_p[i] = p_o[j]
      else:
        for i in on_kernel:
          (new_p[i],), new_m[i], new_v[i] = _kernels.dense_call(
              kind, nesterov, k_l[i], 0, scalars, [leaves[i]], [g_l[i]], m_l[i], v_l[i])

    done = set(on_kernel) | set(on_sparse_kernel)
    for i, (p, g, m, v) in enumerate(zip(leaves, g_l, m_l, v_l)):
      if i in done:
        continue
      if i in sparse:
        new_p[i], new_m[i], new_v[i] = _lazy_rows_xla(
            p, g, m, v, lr=lr, merge=not unique_ids, b1=b1_, b2=b2_, eps=eps_, bc1=bc1,
            bc2=bc2, eps_mode=eps_mode, nesterov=nesterov)
      else:
        new_p[i], new_m[i], new_v[i] = _dense_xla(
            kind, p, g, m, v, decay=k_l[i], wd=wd, lr=lr, b1=b1_, b2=b2_, eps=eps_, bc1=bc1,
            bc2=bc2, eps_mode=eps_mode, nesterov=nesterov)
      if multi_tensor:  # back into the flat buffers, in place
        ms, vs = m_slots[i], v_slots[i]
        mu[ms.buffer] = lax.dynamic_update_slice(mu[ms.buffer], new_m[i].ravel(), (ms.offset,))
        nu[vs.buffer] = lax.dynamic_update_slice(nu[vs.buffer], new_v[i].ravel(), (vs.offset,))

    if multi_tensor:
      new_state = FusedAdamState(count=count, mu=mu, nu=nu)
    else:
      new_state = FusedAdamState(count=count, mu=treedef.unflatten(new_m),
                                 nu=treedef.unflatten(new_v))
    return treedef.unflatten(new_p), new_state

  return FusedStep(init_fn, step_fn)


def fused_adam(learning_rate: _schedules.ScalarOrSchedule = 1e-3, b1: float = 0.9,
               b2: float = 0.999, eps: float = 1e-8, *, eps_mode: str = "hat",
               nesterov: bool = False, weight_decay: Any = 0.0,
               weight_decay_mask: _masks.MaskSpec = _masks.MINDSPORE_DEFAULT,
               mu_dtype: Any = None, nu_dtype: Any = None, multi_tensor: bool = True,
               backend: str = "auto", lazy: bool = True,
               unique_ids: bool = False) -> FusedStep:
  r"""Adam as one fused step that returns the new params (the fast path of :func:`adam`
  and, for row-sparse gradients, of :func:`sparse_adam`).

  .. math::

    g &\leftarrow g + \lambda_t w \quad \text{(L2 decay, masked)} \\
    m_t &= \beta_1 m_{t-1} + (1-\beta_1) g \\
    v_t &= \beta_2 v_{t-1} + (1-\beta_2) g^2 \\
    w &\leftarrow w - \alpha_t\, u_t(m_t, v_t) \quad \text{(} u_t \text{ of }
        \mathtt{scale\_by\_adam}\text{)}

  The same numbers as ``optax.apply_updates(params, adam(...).update(...)[0])`` with the
  same options, computed in one pass: on CPU by a C++ kernel through ``jax.ffi`` when it is
  built (:func:`build_cpu_kernel`), else by plain JAX. Jit ``step(params, state, grads)``
  with ``donate_argnums=(0, 1)`` so the kernel works in place.

  A gradient leaf may be a :class:`adamkit.RowSparse` (an embedding table's rows). With
  ``lazy=True`` only its rows move, as in ``ak.sparse_adam(...)`` + ``ak.apply_updates``
  (MindSpore ``FusedSparseLazyAdam``; decay per occurrence of a touched row): on one CPU
  device one kernel call merges the ids and reads and writes each touched row of the table
  and of both moments once, in place, so the step costs ``O(k)`` for ``k`` ids whatever the
  table size. ``lazy=False`` densifies it (``FusedSparseAdam``: every row moves).

  .. warning::
    Not an ``optax.GradientTransformation``: ``step`` returns the new params, because the
    extra pass of ``optax.apply_updates`` is what keeps the optax-protocol step at about
    40 bytes per parameter instead of 28. Only the options listed here are fused;
    clipping, loss scale, groups and gradient centralization need :func:`adam`.

  Args:
    learning_rate: and ``b1``, ``b2``, ``eps``, ``eps_mode``, ``nesterov``, ``weight_decay``,
      ``weight_decay_mask``, ``mu_dtype``: as in :func:`adamkit.adam` (``weight_decay``: a
      number or schedule, L2).
    nu_dtype: dtype of the second moment (default: the params' dtype).
    multi_tensor: keep the moments of all leaves of a dtype in one flat buffer and update
      runs of up to 32 float32 leaves per kernel call (Paddle ``use_multi_tensor``);
      ``False``: state shaped like the params, one kernel call per leaf of at least 32K
      elements (smaller leaves: XLA).
    backend: ``"auto"`` (the kernel for float32 leaves on CPU when built, JAX otherwise;
      row-sparse leaves: on one CPU device), ``"kernel"`` (error if not built) or ``"xla"``
      (pure JAX).
    lazy: a ``RowSparse`` gradient moves its rows only (default) or is densified.
    unique_ids: the caller guarantees no repeated id in a ``RowSparse`` gradient: skip the
      merge (as in :func:`sparse_adam`).

  Returns:
    A :class:`FusedStep` ``(init, step)``, state :class:`FusedAdamState`.

  Examples:
    >>> import jax, jax.numpy as jnp, adamkit as ak
    >>> opt = ak.fused_adam(0.1)
    >>> params = {"emb": jnp.zeros((1_000_000, 4))}
    >>> step = jax.jit(opt.step, donate_argnums=(0, 1))
    >>> grads = {"emb": ak.RowSparse(jnp.array([7, 7, 42]), jnp.ones((3, 4)), 1_000_000)}
    >>> params, state = step(params, opt.init(params), grads)  # 2 rows of 1M move
    >>> jnp.flatnonzero(params["emb"][:, 0]).tolist()  # each moved by about -lr * sign(g)
    [7, 42]

    >>> opt = ak.fused_adam(0.1, eps_mode="corrected")
    >>> params = {"w": jnp.array([1.0, -2.0])}
    >>> step = jax.jit(opt.step, donate_argnums=(0, 1))
    >>> params, state = step(params, opt.init(params), {"w": jnp.array([2.0, -4.0])})
    >>> params["w"]
    Array([ 0.9, -1.9], dtype=float32)

  References:
    DeepSpeed ``DeepSpeedCPUAdam`` (a one-pass CPU Adam for offloading) and
    ``torch.optim.Adam(fused=True)``, for the idea; the numbers are :func:`adamkit.adam`'s.
  """
  return _fused("adam", learning_rate, b1, b2, eps, eps_mode=eps_mode, nesterov=nesterov,
                weight_decay=weight_decay, weight_decay_mask=weight_decay_mask,
                mu_dtype=mu_dtype, nu_dtype=nu_dtype, multi_tensor=multi_tensor,
                backend=backend, lazy=lazy, unique_ids=unique_ids)


def fused_adamax(learning_rate: _schedules.ScalarOrSchedule = 1e-3, b1: float = 0.9,
                 b2: float = 0.999, eps: float = 1e-8, *, weight_decay: Any = 0.0,
                 weight_decay_mask: _masks.MaskSpec = _masks.MINDSPORE_DEFAULT,
                 mu_dtype: Any = None, nu_dtype: Any = None, multi_tensor: bool = True,
                 backend: str = "auto") -> FusedStep:
  r"""AdaMax as one fused step that returns the new params (the fast path of :func:`adamax`).

  .. math::

    g &\leftarrow g + \lambda_t w \quad \text{(L2 decay, masked)} \\
    m_t &= \beta_1 m_{t-1} + (1-\beta_1) g \\
    v_t &= \max(\beta_2 v_{t-1}, |g|) \\
    w &\leftarrow w - \frac{\alpha_t}{1-\beta_1^t}\,\frac{m_t}{v_t + \epsilon}

  Every argument means what it means in :func:`fused_adam`; the numbers are
  :func:`adamkit.adamax`'s (MindSpore's :math:`\epsilon` placement).

  .. warning::
    Not an ``optax.GradientTransformation`` (see :func:`fused_adam`). The :math:`\epsilon`
    placement differs from optax's and PyTorch's AdaMax (see :func:`scale_by_adamax`).

  Examples:
    >>> import jax.numpy as jnp, adamkit as ak
    >>> opt = ak.fused_adamax(0.1)
    >>> params = {"w": jnp.array([1.0, -2.0])}
    >>> params, state = opt.step(params, opt.init(params), {"w": jnp.array([3.0, -1.0])})
    >>> params["w"]
    Array([ 0.9, -1.9], dtype=float32)
  """
  return _fused("adamax", learning_rate, b1, b2, eps, eps_mode="hat", nesterov=False,
                weight_decay=weight_decay, weight_decay_mask=weight_decay_mask,
                mu_dtype=mu_dtype, nu_dtype=nu_dtype, multi_tensor=multi_tensor,
                backend=backend)
