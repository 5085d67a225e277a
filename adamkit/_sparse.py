"""Sparse Adam for embedding tables: MindSpore's fused ops and the ``sparse_adam`` transform.

A batch that looks up ``k`` rows of an ``(N, D)`` table has a gradient with ``k`` non-zero
rows. Here that gradient is a :class:`adamkit.RowSparse` and the lazy step costs
``O(k D)``: gather the touched rows of the table and moments, update them, scatter them
back (in place under ``jax.jit(..., donate_argnums=...)``). On one CPU device a C++ kernel
(``adamkit/_cpu/adam_kernels.cc``) does this in one pass: duplicate ids merged in a hash
table, each touched row read and written once, rows prefetched ahead; elsewhere (GPU, TPU,
tables sharded over several devices, other dtypes) XLA gathers and scatters do it. Row
ids outside ``[0, N)`` raise a ``ValueError`` outside jit; inside jit they are dropped, as
MindSpore's kernels do (scatters use ``mode="drop"``, gathers read zeros, the kernels skip
them), and :func:`adamkit.check_row_ids` turns them into a ``checkify`` error instead.
Tables may be sharded by rows, on meshes with Auto or Explicit axes.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import checkify

from adamkit import (
    _adam,
    _backend,
    _groups,
    _links,
    _masks,
    _ops,
    _quant,
    _quant_ops,
    _row_sharded,
    _schedules,
    _validate,
)
from adamkit._dtypes import compute_dtype
from adamkit._sparse_types import RowSparse, check_row_args, is_row_sparse
from adamkit._tree import leaf_names, through_variables


def check_row_ids(grads: Any) -> None:
  """A ``checkify`` check that every id of every :class:`RowSparse` leaf is in range.

  Inside ``jax.jit`` adamkit drops out-of-range and negative ids (MindSpore's policy). Call
  this in a step function wrapped by ``jax.experimental.checkify.checkify`` to get an
  error naming the first bad id instead; outside jit it raises at once.

  Args:
    grads: a pytree whose ``RowSparse`` leaves are checked (dense leaves are ignored).

  Examples:
    >>> import jax, jax.numpy as jnp, adamkit as ak
    >>> from jax.experimental import checkify
    >>> @jax.jit
    ... def step(ids):
    ...   grads = {"emb": ak.RowSparse(ids, jnp.ones((2, 3)), num_rows=10)}
    ...   ak.check_row_ids(grads)
    ...   return grads["emb"].todense().sum()
    >>> err, out = checkify.checkify(step)(jnp.array([3, 12]))
    >>> print(err.get())
    RowSparse row id 12 (position 1) is outside [0, 10) (`check` failed)
  """
  for leaf in jax.tree.leaves(grads, is_leaf=is_row_sparse):
    if isinstance(leaf, RowSparse) and leaf.indices.shape[0]:
      ids = leaf.indices
      bad = (ids < 0) | (ids >= leaf.num_rows)
      pos = jnp.argmax(bad)
      checkify.check(~jnp.any(bad),
                     f"RowSparse row id {{id}} (position {{pos}}) is outside [0, {leaf.num_rows})",
                     id=ids[pos], pos=pos)


# ------------------------------------------------------------------ functional ops


def _scalar(name: str, x: Any) -> jax.Array:
  a = jnp.asarray(x)
  if a.ndim > 1 or a.size != 1:
    raise ValueError(f"`{name}` must be a scalar or have shape (1,), got shape {a.shape}.")
  if not jnp.issubdtype(a.dtype, jnp.floating) and not jnp.issubdtype(a.dtype, jnp.integer):
    raise TypeError(f"`{name}` must be a real number, got dtype {a.dtype}.")
  return a.reshape(()).astype(jnp.float32)


def _fused_args(var, m, v, gradient, indices):
  var, m, v = jnp.asarray(var), jnp.asarray(m), jnp.asarray(v)
  if var.ndim < 1:
    raise ValueError(f"`var` must be a table of at least 1 dimension, shape (N, *row_shape); "
                     f"got shape {var.shape}.")
  if not jnp.issubdtype(var.dtype, jnp.floating):
    raise TypeError(f"`var` must be a floating-point array, got dtype {var.dtype}.")
  for name, x in (("m", m), ("v", v)):
    if x.shape != var.shape:
      raise ValueError(f"`{name}` must have the shape of `var` {var.shape}, got {x.shape}.")
  ids, values = check_row_args(indices, gradient, var.shape[0], values_name="gradient",
                               row_shape=var.shape[1:], table_name="`var`")
  return var, m, v, RowSparse.of(ids, values, var.shape[0])


def _fused_hyper(beta1_power, beta2_power, lr, beta1, beta2, epsilon):
  b1p, b2p, lr, b1, b2, eps = (_scalar(n, x) for n, x in (
      ("beta1_power", beta1_power), ("beta2_power", beta2_power), ("lr", lr),
      ("beta1", beta1), ("beta2", beta2), ("epsilon", epsilon)))
  return dict(b1=b1, b2=b2, eps=eps, bc1=1.0 - b1p, bc2=1.0 - b2p), lr


def fused_sparse_adam(var, m, v, beta1_power, beta2_power, lr, beta1, beta2, epsilon,
                      gradient, indices, *, use_nesterov: bool = False):
  r"""MindSpore ``ops.FusedSparseAdam``: merge duplicate ids, then a dense Adam step.

  With :math:`G` the densified gradient (duplicate ids summed, zero on absent rows),
  every row of the table is updated:

  .. math::

    m &\leftarrow \beta_1 m + (1-\beta_1) G \\
    v &\leftarrow \beta_2 v + (1-\beta_2) G^2 \\
    n &= \beta_1 m + (1-\beta_1) G \text{ if use\_nesterov else } m \\
    w &\leftarrow w - \alpha \frac{\sqrt{1-\beta_2^t}}{1-\beta_1^t}\,\frac{n}{\sqrt{v}+\epsilon}

  The cost is ``O(N)``: all moments decay. For the ``O(k)`` step see
  :func:`fused_sparse_lazy_adam`.

  .. warning::
    With ``use_nesterov=True``, absent rows get the dense Nesterov update with a zero
    gradient, :math:`n = \beta_1 m`. MindSpore 2.10's CPU kernel reads uninitialised memory
    for those rows instead, so its results differ there.

  Args:
    var: the table, shape ``(N, *row_shape)`` with ``N >= 0``, floating point.
    m, v: first and second moments, the shape of ``var``.
    beta1_power, beta2_power: :math:`\beta_1^t`, :math:`\beta_2^t` (scalars or shape
      ``(1,)``, as in MindSpore), ``t`` the 1-based step.
    lr, beta1, beta2, epsilon: :math:`\alpha, \beta_1, \beta_2, \epsilon`.
    gradient: gradient rows, shape ``(k, *row_shape)``.
    indices: int32/int64 row ids, shape ``(k,)``; duplicates allowed. Outside jit, an id
      outside ``[0, N)`` raises ``ValueError``; inside jit it is dropped.
    use_nesterov: use the Nesterov numerator.

  Returns:
    The new ``(var, m, v)``, shapes and dtypes unchanged.

  Examples:
    >>> import numpy as np, adamkit as ak
    >>> ones = np.ones([3, 1, 2], np.float32)
    >>> var, m, v = ak.fused_sparse_adam(ones, ones, ones, 0.9, 0.999, 0.001, 0.9, 0.999,
    ...                                  1e-8, np.full([2, 1, 2], 0.1, np.float32), [0, 1])
    >>> print(np.asarray(var)[:, 0])  # the example of MindSpore's documentation
    [[0.9997121  0.9997121 ]
     [0.9997121  0.9997121 ]
     [0.99971527 0.99971527]]

  References:
    Reproduces MindSpore 2.10 ``ops.FusedSparseAdam`` (CPU, ``use_nesterov=False``).
  """
  _validate.check_bool("use_nesterov", use_nesterov)
  var, m, v, g = _fused_args(var, m, v, gradient, indices)
  hyper, lr = _fused_hyper(beta1_power, beta2_power, lr, beta1, beta2, epsilon)
  dt = compute_dtype(var)
  u, m_new, v_new = _adam.adam_direction(g.todense(like=m).astype(dt), m.astype(dt), v.astype(dt),
                                         eps_mode="hat", nesterov=use_nesterov, **hyper)
  var_new = var.astype(dt) - lr * u
  return var_new.astype(var.dtype), m_new.astype(m.dtype), v_new.astype(v.dtype)


def fused_sparse_lazy_adam(var, m, v, beta1_power, beta2_power, lr, beta1, beta2, epsilon,
                           gradient, indices, *, use_nesterov: bool = False,
                           backend: str = "auto"):
  r"""MindSpore ``ops.FusedSparseLazyAdam``: Adam on the rows present in ``indices`` only.

  Duplicate ids are summed into :math:`G_i`; for each distinct id :math:`i`:

  .. math::

    m_i &\leftarrow \beta_1 m_i + (1-\beta_1) G_i \\
    v_i &\leftarrow \beta_2 v_i + (1-\beta_2) G_i^2 \\
    n_i &= \beta_1 m_i + (1-\beta_1) G_i \text{ if use\_nesterov else } m_i \\
    w_i &\leftarrow w_i - \alpha \frac{\sqrt{1-\beta_2^t}}{1-\beta_1^t}\,
          \frac{n_i}{\sqrt{v_i}+\epsilon}

  Every other row of ``var``, ``m`` and ``v`` is returned bit-identical. The cost is
  ``O(k)`` in the number of ids, independent of the table size when the caller donates
  ``var, m, v`` to ``jax.jit``.

  Args:
    var: and ``m``, ``v``, ``beta1_power``, ``beta2_power``, ``lr``, ``beta1``, ``beta2``,
      ``epsilon``, ``gradient``, ``indices``, ``use_nesterov``: as in
      :func:`fused_sparse_adam`.
    backend: ``"auto"`` (one C++ kernel call for float32 tables on one CPU device when the
      kernel is built, XLA otherwise), ``"kernel"`` (error if not built) or ``"xla"``.

  Returns:
    The new ``(var, m, v)``.

  Examples:
    >>> import numpy as np, adamkit as ak
    >>> ones = np.ones([3, 2], np.float32)
    >>> var, m, v = ak.fused_sparse_lazy_adam(ones, ones, ones, 0.9, 0.999, 0.001, 0.9,
    ...                                       0.999, 1e-8, np.full([2, 2], 0.1), [0, 0])
    >>> np.asarray(var)[:, 0]  # row 0 moves with the summed gradient 0.2; rows 1, 2 do not
    array([0.99970895, 1.        , 1.        ], dtype=float32)

  References:
    Reproduces MindSpore 2.10 ``ops.FusedSparseLazyAdam``; Paddle ``Adam(lazy_mode=True)``
    is the same rule.
  """
  _validate.check_bool("use_nesterov", use_nesterov)
  _validate.check_choice("backend", backend, _backend.BACKENDS)
  var, m, v, g = _fused_args(var, m, v, gradient, indices)
  hyper, lr = _fused_hyper(beta1_power, beta2_power, lr, beta1, beta2, epsilon)
  h = _ops.Hyper("hat", use_nesterov, lr=lr, **hyper)
  var, (m, v) = _ops.lazy_row_step(h, var, g, (m, v), merge=True, backend=backend)
  return var, m, v


# ---------------------------------------------------------------------- transforms


class ScaleBySparseAdamState(NamedTuple):
  count: jax.Array  # int32 scalar, steps taken (saturates); the global step t of every row
  mu: optax.Updates  # first moment, params' shapes: ``mu_dtype``, the params' dtype, or codes
  nu: optax.Updates  # second moment, params' shapes: ``nu_dtype``, the params' dtype, or codes
  # No arrays: the row-sharded tables' splits as seen at init (a RowSplits node, static
  # data, not shaped like the params), so that a step jitted over Auto axes routes its rows.
  row_splits: Any = None


def _init_moments(params, fmt, role: str):
  """Zero moments for every leaf in ``fmt`` (a quantized table keeps its blocks within rows,
  :func:`adamkit._quant.table_format`)."""
  if not _quant.is_quantized(fmt):
    return jax.tree.map(lambda p: _quant.init_table_moment(p, fmt, role), params)

  def zero(p):
    # A Flax NNX variable gives its value: the moment must be the QuantizedArray itself
    # (as in the dense step, see adamkit._quant_ops.zero_moments).
    if _quant_ops.is_nnx_variable(p):
      p = p.get_value()
      if not hasattr(p, "shape"):  # a parameter group's masked leaf
        return p
    return _quant.init_table_moment(p, fmt, role)

  return jax.tree.map(zero, params, is_leaf=_quant_ops.is_nnx_variable)


def _check_format(name: str, x: Any, fmt: Any, role: str, what: str) -> None:
  """A moment leaf must be stored as this optimizer stores it: a quantized moment in the
  format and block size :func:`adamkit._quant.table_format` gives (any table size: the
  offloaded step hands in the touched rows alone), a float moment where the format is not
  quantized or the leaf is under ``min_size``."""
  arg = "mu_dtype" if role == "mu" else "nu_dtype"
  if _quant.is_qarray(x):
    want = _quant.table_format(fmt, role, x.shape) if _quant.is_quantized(fmt) else None
    if x.fmt != want:
      raise ValueError(f"The {what} of '{name}' is stored as {x.fmt}, but this optimizer's "
                       f"`{arg}` stores it as {want or 'a float array'}: a state made with "
                       "another format or block size.")
    _validate.check_quantized_layout(x, name, f"The optimizer state's {what}")  # codes, scales
  elif _quant.is_quantized(fmt) and fmt.pad and math.prod(x.shape) >= max(fmt.min_size, 1):
    # (with pad=False a float table is not told from its gathered rows: the offloaded
    # step hands in the touched rows alone, whose count may be a multiple of the block)
    raise ValueError(f"The {what} of '{name}' is a float array of {math.prod(x.shape)} "
                     f"elements, but this optimizer's `{arg}` ({fmt}) stores it quantized: "
                     "a state made with another format.")


@_validate.foreign_keywords
def scale_by_sparse_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, *,
                         lazy: bool = True, eps_mode: str = "hat", nesterov: bool = False,
                         amsgrad: bool = False, bias_correction: bool = True,
                         unique_ids: bool = False, mu_dtype: Any = None,
                         nu_dtype: Any = None, backend: str = "auto") -> optax.GradientTransformation:
  r"""Adam's direction for gradient trees whose leaves may be :class:`adamkit.RowSparse`.

  Dense leaves get exactly :func:`adamkit.scale_by_adam`. For a ``RowSparse`` leaf with
  duplicate ids summed into :math:`G` (rows :math:`i \in I`):

  .. math::

    \text{lazy:}\quad m_i &\leftarrow \beta_1 m_i + (1-\beta_1) G_i, \quad
       v_i \leftarrow \beta_2 v_i + (1-\beta_2) G_i^2, \quad
       u_i = \frac{\sqrt{1-\beta_2^t}}{1-\beta_1^t}\frac{n_i}{\sqrt{v_i}+\epsilon},
       \quad i \in I \\
    \text{not lazy:}\quad & \text{dense Adam on } G \text{ (zero on absent rows)}

  with :math:`n`, ``eps_mode``, ``bias_correction`` and ``amsgrad`` as in
  :func:`adamkit.scale_by_adam` (with ``amsgrad`` the running maximum
  :math:`\bar v_i = \max(\bar v_i, v_i)` replaces :math:`v_i`, and in lazy mode it moves
  on the touched rows only, like :math:`m` and :math:`v`) and :math:`t` the global step.
  Lazy mode returns a ``RowSparse`` of row updates (unique ids) that
  :func:`adamkit.apply_updates` scatters; rows not in :math:`I` keep their moments
  bit-identical. Non-lazy mode returns a dense update and costs ``O(N)``.

  **Quantized moments** (``mu_dtype``/``nu_dtype`` an :class:`adamkit.Quantized` or
  ``"8bit"``, ``"4bit"``, ``"fp8"``): a leaf of shape ``(N, *row)`` stores each moment
  with blocks that never span two rows, so a lazy step gathers the codes and scales of
  the :math:`k` touched rows only, dequantizes them, updates them in float32 as above,
  requantizes them (each row its own scales) and scatters them back: ``O(k)``, and every
  other row's codes and scales keep their bits. The block is the format's
  (``block_size``, default 256 at 8 bits) when it divides the last axis, else the whole
  row (one float32 scale per row, any row length; codes ``(N, D)``, scales
  ``(N, 1)`` for a 2-D table). The state is then :math:`2 (1 + 4/B)` bytes per element
  at 8 bits (B the block): 2.06 for rows of 128, 2.125 for rows of 64, 2.5 for rows of
  16, 3 for rows of 8 (float32 Adam: 8); 4-bit halves the codes. Leaves under
  ``min_size`` elements keep float32 moments; a 1-D leaf uses the format's blocks as
  :func:`adamkit.scale_by_adam` does, and so cannot take a row-sparse gradient lazily (a
  ``ValueError``). On one CPU device, 8-bit moments of a table whose rows are whole
  power-of-two blocks take the C++ row kernel (the same codes and scales as XLA's step,
  which runs everywhere else; 4-bit, fp8 and other blocks always run in XLA, also with
  ``backend="kernel"``). Non-finite moment values are stored
  as 0 and never reach a block's scale (``nonfinite="propagate"`` still carries a NaN
  gradient into the update).

  **Row-sharded tables** (``P("rows", None)`` over several devices, float or quantized
  moments, the codes and scales split by rows as ``init`` places them): each device
  updates the touched rows it owns (see ``docs/scaling_out.md``). Under a ``jit``
  over Auto axes the arrays do not show their split, so ``init`` records it from the
  params it is given, in the state's tree structure (``row_splits``: one node, no
  arrays, static data rather than a params-shaped tree, so ``optax.tree.map_params``
  works on the state). Concrete or ``jax.ShapeDtypeStruct`` params with shardings
  record it; abstract or traced ones (``jax.jit(tx.init)``) do not, and XLA then
  partitions the step (the same numbers, every device processing every id).

  Args:
    b1: decay :math:`\beta_1` of the first moment, in [0, 1) (default 0.9).
    b2: decay :math:`\beta_2` of the second moment, in [0, 1) (default 0.999).
    eps: :math:`\epsilon`, added to the denominator (default 1e-8), finite and at least
      1.18e-38 (float32's smallest normal).
    lazy: update only the touched rows (default ``True``; MindSpore
      ``FusedSparseLazyAdam``, Paddle ``lazy_mode=True``, ``torch.optim.SparseAdam``) or
      every row, with a zero gradient on absent rows (``False``; ``FusedSparseAdam``).
    eps_mode: where :math:`\epsilon` enters (default ``"hat"``, MindSpore's: before the
      bias correction; ``"corrected"``: optax's, PyTorch's), as in
      :func:`adamkit.scale_by_adam`.
    nesterov: MindSpore's ``use_nesterov`` numerator (default ``False``), as in
      :func:`adamkit.scale_by_adam`.
    amsgrad: divide by the running maximum of the raw :math:`v` (default ``False``); in
      lazy mode it moves on the touched rows only. The state is then
      :class:`adamkit.ScaleByAmsgradState`.
    bias_correction: divide by :math:`1-\beta^t` (default ``True``), :math:`t` the global
      step; ``False``: no correction (MindSpore ``AdamWeightDecay``).
    unique_ids: the caller guarantees that no id repeats (default ``False``; MindSpore
      ``unique=False``): skip the merge. With repeated ids the lazy result is then
      unspecified (one of the duplicates wins, or each is applied in turn), though never
      outside the repeated rows.
    mu_dtype: storage of the first moment (default: the params' dtype), a float dtype or a
      quantized format (``"8bit"``, ``"4bit"``, ``"fp8"``, :class:`adamkit.Quantized`), as
      in :func:`adamkit.scale_by_adam`; the arithmetic is always float32 or wider.
    nu_dtype: storage of the second moment and of the AMSGrad maximum (default: the
      params' dtype), as ``mu_dtype``. A quantized format keeps a table's blocks within its
      rows, so the lazy step reads and writes only the touched rows' codes and scales.
    backend: where the lazy row step runs: ``"auto"`` (default: the C++ kernel for float32
      tables and int32 ids computed on one CPU device, when built; XLA otherwise, e.g. for
      a table sharded over several devices), ``"kernel"`` (error if not built) or
      ``"xla"``. The two agree to float32 rounding: the kernel computes the formula as
      written, XLA may contract a multiply and an add into one FMA. The kernel has no
      differentiation rule: use ``"xla"`` to differentiate through the step.

  Returns:
    An ``optax.GradientTransformation`` with state :class:`ScaleBySparseAdamState`, or
    :class:`adamkit.ScaleByAmsgradState` with ``amsgrad=True``.

  Examples:
    >>> import jax.numpy as jnp, adamkit as ak
    >>> tx = ak.scale_by_sparse_adam()
    >>> state = tx.init({"emb": jnp.zeros((5, 2))})
    >>> g = {"emb": ak.RowSparse(jnp.array([3, 3]), jnp.full((2, 2), 0.25), num_rows=5)}
    >>> u, state = tx.update(g, state)
    >>> u["emb"].indices[:1], u["emb"].values[:1].round(4)  # one merged row, about sign(g)
    (Array([3], dtype=int32), Array([[1., 1.]], dtype=float32))

    8-bit moments, one scale per row of 64:

    >>> tx = ak.scale_by_sparse_adam(mu_dtype="8bit", nu_dtype="8bit")
    >>> state = tx.init({"emb": jnp.zeros((1000, 64))})
    >>> state.mu["emb"].codes.shape, state.mu["emb"].scales.shape
    ((1000, 64), (1000, 1))

  References:
    Kingma & Ba (2015). Reproduces MindSpore 2.10 ``ops.FusedSparseLazyAdam`` /
    ``ops.FusedSparseAdam`` (``lazy=False``). Quantized moments: Dettmers et al., "8-bit
    Optimizers via Block-wise Quantization", ICLR 2022 (who keep 32-bit states for
    embeddings instead, and have no lazy step).
  """
  _adam.check_adam_hyper(b1, b2, eps)
  _validate.check_choice("eps_mode", eps_mode, ("hat", "corrected"))
  for name, flag in (("lazy", lazy), ("nesterov", nesterov), ("amsgrad", amsgrad),
                     ("bias_correction", bias_correction), ("unique_ids", unique_ids)):
    _validate.check_bool(name, flag)
  _validate.check_choice("backend", backend, _backend.BACKENDS)
  mu_fmt = _quant.as_format("mu_dtype", mu_dtype)
  nu_fmt = _quant.as_format("nu_dtype", nu_dtype)
  state_type = _adam.ScaleByAmsgradState if amsgrad else ScaleBySparseAdamState
  fmts = ((mu_fmt, "mu"), (nu_fmt, "nu"), (nu_fmt, "nu"))  # AMSGrad's maximum as nu

  def init_fn(params):
    _validate.check_float_params(params)
    moments = [_init_moments(params, fmt, role) for fmt, role in fmts[:3 if amsgrad else 2]]
    if amsgrad:  # three buffers: never routed (see adamkit._ops._row_layout)
      return state_type(jnp.zeros([], jnp.int32), *moments)
    return state_type(jnp.zeros([], jnp.int32), *moments,
                      row_splits=_row_sharded.record_all(params))

  def update_fn(updates, state, params=None):
    _validate.check_state(state, state_type, "ak.scale_by_sparse_adam", updates)
    updates = _validate.float_grads(updates, params)
    leaf_view = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state.nu,
                             is_leaf=_quant.is_qarray)
    count = optax.safe_increment(state.count)
    h = _ops.Hyper.of(eps_mode, nesterov, b1, b2, eps, count, bias_correction=bias_correction,
                      amsgrad=amsgrad)

    def leaf(name, g, split, *olds):  # olds: (m, v) or (m, v, v_max)
      for x, what, (fmt, role) in zip(olds, _ops.STATE_NAMES, fmts):
        _check_format(name, x, fmt, role, what)
      if isinstance(g, RowSparse):
        _ops.check_rows(g, olds[0].shape, what=f"gradient of '{name}'")
        for x, what in zip(olds[1:], _ops.STATE_NAMES[1:]):
          _ops.check_moments(x, None, olds[0].shape, f"{what} of '{name}'")
      if isinstance(g, RowSparse) and lazy:
        ids, u, news = _ops.lazy_rows(h, g, olds, table_shape=olds[0].shape,
                                      merge=not unique_ids, backend=backend, split=split)
        return RowSparse.of(ids, u.astype(g.dtype), g.num_rows), *news
      if isinstance(g, RowSparse):
        g = g.todense(like=None if _quant.is_qarray(olds[0]) else olds[0])
      dt = compute_dtype(g)
      u, *news = _ops.direction(h, g.astype(dt), *(_quant.load(x).astype(dt) for x in olds))
      return u.astype(g.dtype), *(_quant.store(n, o, step=count) for n, o in zip(news, olds))

    treedef = jax.tree.structure(state.nu, is_leaf=_quant.is_qarray)
    n_moments = 3 if amsgrad else 2  # mu, nu(, nu_max); then the recorded splits
    moments = [jax.tree.leaves(t, is_leaf=_quant.is_qarray) for t in state[1:1 + n_moments]]
    names = leaf_names(leaf_view)
    out = [leaf(*args) for args in zip(names, treedef.flatten_up_to(updates),
                                       _row_sharded.recorded(state, names), *moments)]
    if not out:
      return updates, state._replace(count=count)
    u, *news = (treedef.unflatten(list(x)) for x in zip(*out))
    return u, state._replace(count=count, **dict(zip(state._fields[1:], news)))

  return optax.GradientTransformation(*through_variables(init_fn, update_fn))


@_validate.foreign_keywords
def sparse_adam(learning_rate: _schedules.ScalarOrSchedule = 1e-3, b1: float = 0.9,
                b2: float = 0.999, eps: float = 1e-8, *, lazy: bool = True,
                eps_mode: str = "hat", nesterov: bool = False, amsgrad: bool = False,
                weight_decay: Any = 0.0,
                weight_decay_mask: _masks.MaskSpec = _masks.MINDSPORE_DEFAULT,
                loss_scale: float = 1.0, grad_clip: Any = None, groups=None,
                unique_ids: bool = False, mu_dtype: Any = None, nu_dtype: Any = None,
                nonfinite: str = "propagate", backend: str = "auto") -> optax.GradientTransformation:
  r"""Adam for trees mixing :class:`adamkit.RowSparse` (embedding) and dense gradients.

  .. math::

    g &\leftarrow g / s \quad \text{(loss scale)} \\
    g &\leftarrow \mathrm{clip}(g) \quad \text{(norms of the dense equivalent)} \\
    g_j &\leftarrow g_j + \lambda_t w_{i_j} \quad \text{(decay, each sparse id } i_j
      \text{; every element of a dense leaf)} \\
    u &\leftarrow \mathtt{scale\_by\_sparse\_adam}(g) \\
    w &\leftarrow w - \alpha_t u \quad \text{(with } \mathtt{ak.apply\_updates}\text{)}

  The chain is ``check -> unscale -> clip -> [decay -> scale_by_sparse_adam -> -lr]``, the
  bracket with each parameter group's settings (one shared state). Dense leaves
  get ordinary Adam. Use :func:`adamkit.apply_updates` (not ``optax.apply_updates``): in
  lazy mode the updates of sparse leaves are ``RowSparse`` row deltas that it scatters,
  in place when the params and state are donated to ``jax.jit``.

  Args:
    learning_rate: :math:`\alpha_t` (default 1e-3), every form :func:`adamkit.adam`
      accepts.
    b1: decay :math:`\beta_1` of the first moment, in [0, 1) (default 0.9).
    b2: decay :math:`\beta_2` of the second moment, in [0, 1) (default 0.999).
    eps: :math:`\epsilon`, added to the denominator (default 1e-8), finite and at least
      1.18e-38.
    lazy: only touched rows change (default ``True``; MindSpore ``FusedSparseLazyAdam``)
      or all rows move as in dense Adam with a zero gradient on absent rows (``False``;
      ``FusedSparseAdam``, ``O(N)`` per step).
    eps_mode: where :math:`\epsilon` enters (default ``"hat"``, MindSpore's;
      ``"corrected"``: optax's and PyTorch's), as in :func:`adamkit.scale_by_adam`.
    nesterov: MindSpore's ``use_nesterov`` numerator (default ``False``).
    amsgrad: divide by the running maximum of the raw :math:`v` (default ``False``); lazy
      AMSGrad moves the maximum on the touched rows only.
    weight_decay: L2 coefficient (default 0.0: no decay), a number >= 0 or a schedule, or
      ``ak.L1Decay``/``ak.L2Decay``. On a sparse leaf only the touched rows decay.
    weight_decay_mask: which leaves decay (default: MindSpore's rule, no ``"beta"`` or
      ``"gamma"`` in the path; ``None``: every leaf), as in :func:`adamkit.adam`.
    loss_scale: gradients are divided by it first, > 0 (default 1.0).
    grad_clip: ``ak.ClipGradByGlobalNorm``, ``ak.ClipGradByNorm`` or ``ak.ClipGradByValue``
      (default ``None``). A ``RowSparse`` leaf is clipped as its dense equivalent: its
      norm is that of the table gradient with duplicate ids summed, and value clipping
      merges duplicates first.
    groups: parameter groups (default ``None``), as in :func:`adamkit.adam`
      (``grad_centralization`` is refused for a sparse optimizer).
    unique_ids: skip merging duplicate ids (default ``False``), as in
      :func:`scale_by_sparse_adam`.
    nonfinite: ``"propagate"`` (default) or ``"skip"``, as in :func:`adamkit.adam`.
    mu_dtype: storage of the first moment (default: the params' dtype), a float dtype or
      a quantized format (``"8bit"``, ``"4bit"``, ``"fp8"``, :class:`adamkit.Quantized`),
      as in :func:`scale_by_sparse_adam`.
    nu_dtype: storage of the second moment and of the AMSGrad maximum, as ``mu_dtype``.
    backend: ``"auto"`` (default), ``"kernel"`` or ``"xla"``, see
      :func:`scale_by_sparse_adam`; pass the same to :func:`adamkit.apply_updates`. For
      the fastest step (the table updated in the same pass as its moments) see
      :func:`adamkit.fused_adam`.

  Returns:
    An ``optax.GradientTransformation``.

  .. warning::
    Decay is added to each *occurrence* of an id before duplicates are merged, as in
    MindSpore (``nn.Adam`` decays the ``RowTensor`` values, then the fused op sums them):
    a row looked up ``c`` times in a batch decays ``c`` times. Inside ``jax.jit``, ids
    outside ``[0, N)`` are dropped, not reported (see :func:`adamkit.check_row_ids`).
    ``optax.clip``, ``optax.clip_by_global_norm`` and ``optax.scale`` chained *before*
    ``sparse_adam`` map over the row ids and are refused while tracing (a TypeError that
    names ``grad_clip=`` and ``loss_scale=``); ``optax.zero_nans`` and
    ``optax.apply_if_finite`` work. ``ak.ClipGradByValue`` merges duplicate ids first, so
    decay then applies once per row. Bias correction uses the
    global step for every row, as MindSpore and ``torch.optim.SparseAdam``; Paddle's CPU
    row-sparse (``SelectedRows``) kernel uses step ``t + 1`` and gives other numbers.

  Examples:
    >>> import jax, jax.numpy as jnp, adamkit as ak
    >>> params = {"emb": jnp.ones((1_000, 4)), "w": jnp.ones(4)}
    >>> tx = ak.sparse_adam(0.1)
    >>> state = tx.init(params)
    >>> grads = {"emb": ak.RowSparse(jnp.array([7, 7, 42]), jnp.ones((3, 4)), 1_000),
    ...          "w": jnp.ones(4)}
    >>> updates, state = tx.update(grads, state, params)
    >>> params = ak.apply_updates(params, updates)
    >>> print(params["emb"][jnp.array([0, 7, 42]), 0], params["w"][0])  # rows 7, 42 and w move
    [1.         0.90000004 0.90000004] 0.90000004
  """
  _adam.check_adam_hyper(b1, b2, eps)
  _quant.as_format("mu_dtype", mu_dtype)
  _quant.as_format("nu_dtype", nu_dtype)
  _validate.check_choice("eps_mode", eps_mode, ("hat", "corrected"))
  for name, flag in (("lazy", lazy), ("nesterov", nesterov), ("amsgrad", amsgrad),
                     ("unique_ids", unique_ids)):
    _validate.check_bool(name, flag)
  _validate.check_choice("backend", backend, _backend.BACKENDS)
  if isinstance(grad_clip, optax.GradientTransformation):
    raise TypeError(
        "ak.sparse_adam's `grad_clip` must be ak.ClipGradByGlobalNorm, ak.ClipGradByNorm or "
        "ak.ClipGradByValue (they clip a RowSparse gradient as its dense equivalent); an "
        "optax transform would map over the row ids.")
  for i, g in enumerate(groups or ()):
    if getattr(g, "grad_centralization", None) or (
        isinstance(g, dict) and g.get("grad_centralization")):
      raise ValueError(f"groups[{i}].grad_centralization is not defined for ak.sparse_adam.")

  def direction(b1, b2, eps):
    return scale_by_sparse_adam(b1, b2, eps, lazy=lazy, eps_mode=eps_mode, nesterov=nesterov,
                                amsgrad=amsgrad, unique_ids=unique_ids, mu_dtype=mu_dtype,
                                nu_dtype=nu_dtype, backend=backend)

  return _groups.build_named(
      direction, learning_rate=learning_rate, hyper=dict(b1=b1, b2=b2, eps=eps),
      weight_decay=weight_decay, weight_decay_mask=weight_decay_mask, loss_scale=loss_scale,
      grad_clip=grad_clip, groups=groups, nonfinite=nonfinite, name="ak.sparse_adam")


@_validate.foreign_keywords
def sparse_adamw(learning_rate: _schedules.ScalarOrSchedule = 1e-3, b1: float = 0.9,
                 b2: float = 0.999, eps: float = 1e-8, *, lazy: bool = True,
                 weight_decay: Any = 0.01,
                 weight_decay_mask: _masks.MaskSpec = _masks.MINDSPORE_DEFAULT,
                 bias_correction: bool = True, eps_mode: str = "corrected",
                 amsgrad: bool = False, loss_scale: float = 1.0, unique_ids: bool = False,
                 mu_dtype: Any = None, nu_dtype: Any = None, nonfinite: str = "propagate",
                 backend: str = "auto") -> optax.GradientTransformation:
  r"""AdamW for trees mixing :class:`adamkit.RowSparse` (embedding) and dense gradients:
  lazy AdamW, the decoupled decay on the touched rows only.

  With :math:`R` the distinct ids of the batch and :math:`G_r` their merged gradient rows,
  in lazy mode (default), for each :math:`r \in R`:

  .. math::

    m_r &\leftarrow \beta_1 m_r + (1-\beta_1) G_r, \quad
      v_r \leftarrow \beta_2 v_r + (1-\beta_2) G_r^2, \quad
      \bar v_r \leftarrow \max(\bar v_r, v_r) \text{ (amsgrad)} \\
    u_r &= \mathtt{scale\_by\_adam}(m_r, \bar v_r) + \lambda_t w_r
      \quad \text{(decay masked per leaf)} \\
    w_r &\leftarrow w_r - \alpha_t u_r

  and every other row keeps its parameters and moments bit for bit: a row that is not
  looked up does not decay either. Dense leaves get :func:`adamkit.adamw` exactly. The chain
  is ``check -> unscale -> scale_by_sparse_adam -> add_decoupled_decay -> -lr``; apply the
  updates with :func:`adamkit.apply_updates`. :func:`adamkit.fused_adamw` computes the same
  step with the table updated in the same pass as its moments.

  .. warning::
    MindSpore and Paddle have no lazy AdamW (Paddle's ``AdamW`` has no ``lazy_mode``;
    MindSpore's ``AdamWeightDecay`` takes dense gradients only), so this is adamkit's
    definition: the decay of a row is applied on the steps that touch it, once per step
    however often the batch repeats its id (L2 decay in :func:`sparse_adam` is per
    occurrence, MindSpore's rule), with the learning rate of that step. Where every row is
    touched it is :func:`adamkit.adamw` on the densified gradient (tested); a row touched
    every :math:`k`-th step decays :math:`k` times less than under dense AdamW.
    ``lazy=False`` is that dense AdamW on the densified gradient (every row moves and
    decays, :math:`O(N)`).

  Args:
    learning_rate: :math:`\alpha_t` (default 1e-3), every form :func:`adamkit.adam`
      accepts; it multiplies the decay too.
    b1: decay :math:`\beta_1` of the first moment, in [0, 1) (default 0.9).
    b2: decay :math:`\beta_2` of the second moment, in [0, 1) (default 0.999).
    eps: :math:`\epsilon`, added to the denominator (default 1e-8), finite and at least
      1.18e-38.
    lazy: only the touched rows move and decay (default ``True``), or every row
      (``False``: dense AdamW on the densified gradient, ``O(N)`` per step).
    weight_decay: the decoupled coefficient :math:`\lambda_t` (default 0.01, as
      :func:`adamkit.adamw`), a number >= 0 or a schedule.
    weight_decay_mask: which leaves decay (default: MindSpore's rule, no ``"beta"`` or
      ``"gamma"`` in the path; ``None``: every leaf), as in :func:`adamkit.adamw`.
    bias_correction: divide by :math:`1-\beta^t` (default ``True``); ``False`` is
      MindSpore ``AdamWeightDecay``'s uncorrected step.
    eps_mode: where :math:`\epsilon` enters (default ``"corrected"``, as
      :func:`adamkit.adamw`; ``"hat"``: MindSpore's), see :func:`adamkit.scale_by_adam`.
    amsgrad: divide by the running maximum of the raw :math:`v` (default ``False``), moved
      on the touched rows only in lazy mode.
    loss_scale: gradients are divided by it first, > 0 (default 1.0).
    unique_ids, nonfinite, mu_dtype, nu_dtype, backend: as in :func:`sparse_adam` (skip
      merging duplicate ids; ``"propagate"`` or ``"skip"`` a step with a NaN/Inf gradient;
      the moments' storage, a float dtype or a quantized format; where the lazy row step
      runs).

  Returns:
    An ``optax.GradientTransformation``.

  Examples:
    >>> import jax.numpy as jnp, adamkit as ak
    >>> params = {"emb": jnp.ones((1_000, 2))}
    >>> tx = ak.sparse_adamw(0.1, weight_decay=0.5, weight_decay_mask=None)
    >>> grads = {"emb": ak.RowSparse(jnp.array([7, 7]), jnp.ones((2, 2)), 1_000)}
    >>> updates, state = tx.update(grads, tx.init(params), params)
    >>> params = ak.apply_updates(params, updates)
    >>> print(params["emb"][jnp.array([0, 7]), 0])  # row 7: w - lr (sign(g) + wd w), once
    [1.   0.85]

  References:
    Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR 2019; the lazy row
    rule of MindSpore ``FusedSparseLazyAdam`` and ``torch.optim.SparseAdam``.
  """
  _adam.check_adam_hyper(b1, b2, eps)
  _quant.as_format("mu_dtype", mu_dtype)
  _quant.as_format("nu_dtype", nu_dtype)
  _validate.check_choice("eps_mode", eps_mode, ("hat", "corrected"))
  for name, flag in (("lazy", lazy), ("bias_correction", bias_correction),
                     ("amsgrad", amsgrad), ("unique_ids", unique_ids)):
    _validate.check_bool(name, flag)
  _validate.check_choice("backend", backend, _backend.BACKENDS)
  if isinstance(weight_decay, (_links.L1Decay, _links.L2Decay)):
    raise TypeError(
        f"ak.sparse_adamw's `weight_decay` is the decoupled coefficient (a number >= 0 or a "
        f"schedule), got {type(weight_decay).__name__}: an L1/L2 penalty is ak.sparse_adam's.")

  def direction(b1, b2, eps):
    return scale_by_sparse_adam(b1, b2, eps, lazy=lazy, eps_mode=eps_mode, amsgrad=amsgrad,
                                bias_correction=bias_correction, unique_ids=unique_ids,
                                mu_dtype=mu_dtype, nu_dtype=nu_dtype, backend=backend)

  return _groups.build_named(
      direction, learning_rate=learning_rate, hyper=dict(b1=b1, b2=b2, eps=eps),
      weight_decay=weight_decay, weight_decay_mask=weight_decay_mask, loss_scale=loss_scale,
      grad_clip=None, groups=None, nonfinite=nonfinite, decoupled=True, name="ak.sparse_adamw")


def apply_updates(params: optax.Params, updates: optax.Updates, *,
                  backend: str = "auto") -> optax.Params:
  """``params + updates``, scattering :class:`adamkit.RowSparse` updates into their rows.

  Dense leaves behave as ``optax.apply_updates``. A ``RowSparse`` update adds its values
  to its rows (duplicates add up, ids outside ``[0, N)`` are dropped), so under
  ``jax.jit(step, donate_argnums=...)`` the table is updated in place: on one CPU device by
  the C++ kernel (rows prefetched ahead, one pass), elsewhere by an XLA scatter.

  Args:
    params: the parameter tree.
    updates: a tree of the same structure; some leaves may be ``RowSparse``.
    backend: ``"auto"`` (the kernel where it can run), ``"kernel"`` or ``"xla"``.

  Returns:
    The new params, dtypes unchanged.

  Examples:
    >>> import jax.numpy as jnp, adamkit as ak
    >>> p = {"emb": jnp.zeros((4, 2))}
    >>> u = {"emb": ak.RowSparse(jnp.array([1]), jnp.ones((1, 2)), num_rows=4)}
    >>> ak.apply_updates(p, u)["emb"][:, 0]
    Array([0., 1., 0., 0.], dtype=float32)
  """
  _validate.check_choice("backend", backend, _backend.BACKENDS)

  def apply(p, u):
    if p is None:
      return None
    if isinstance(u, RowSparse):
      if u.shape != tuple(np.shape(p)):
        raise ValueError(f"A RowSparse update of dense shape {u.shape} does not fit a "
                         f"parameter of shape {np.shape(p)}.")
      return _ops.row_add(jnp.asarray(p), u, backend=backend)
    return jnp.asarray(p + u).astype(jnp.asarray(p).dtype)

  return jax.tree.map(apply, params, updates, is_leaf=lambda x: x is None)
