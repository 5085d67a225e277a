"""Memory safety of the C++ kernels, checked on every test run.

Builds ``adamkit/_cpu/adam_kernels.cc`` with ``-fsanitize=address,undefined`` and drives
every entry point (``sparse_adam`` and ``sparse_adamw(amsgrad=True)`` + ``apply_updates``,
``fused_adam`` and ``fused_adamw(amsgrad=True)`` per leaf and multi-tensor with a table
between dense leaves, ``fused_sparse_lazy_adam``, the dense step of every variant, the
dense step with 8-bit quantized moments, the lazy step of 8-bit table moments, the chain
form's requantization of 8-bit moments (``adamw``, ``adam(amsgrad=True)``, ``adamax``),
the rounded dense step on bf16 params
(``param_rounding``), and each kernel called directly past the Python checks, including
every malformed attribute of tests/kernel_attrs.py: offsets at INT64_MAX, sums that wrap)
with adversarial inputs, in a
subprocess with AddressSanitizer preloaded (built and run in the background from the end
of collection on, beside the rest of the suite: tests/background.py). Passes when the subprocess reports zero
sanitizer errors and no row of a table or moment that no valid id addresses has changed.
Skipped, with the reason, only where no C++ compiler (or no ASan runtime) exists.
"""

import os
import pathlib
import subprocess
import sys
import tempfile

import background
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEADLINE_S = 900  # the build and the driver: about 3 minutes beside the suite
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def _runtime(cxx: str, name: str) -> str | None:
  try:
    out = subprocess.run([cxx, f"-print-file-name={name}"], capture_output=True, text=True,
                         timeout=60).stdout.strip()
  except (OSError, subprocess.TimeoutExpired):
    return None
  return out if os.path.isabs(out) and os.path.exists(out) else None


def _build_and_drive():
  """Builds the sanitizer kernel and runs the driver on it in a subprocess: ``(reason,
  None)`` where it cannot be built here, else ``(None, the finished driver)``."""
  from adamkit._cpu import build
  cxx = os.environ.get("CXX", "c++")
  asan, stdcxx = _runtime(cxx, "libasan.so"), _runtime(cxx, "libstdc++.so")
  if asan is None or stdcxx is None:
    return f"no C++ compiler with an AddressSanitizer runtime ({cxx!r})", None
  with tempfile.TemporaryDirectory(prefix="adamkit-asan-") as tmp:
    library = pathlib.Path(tmp) / "libadamkit_asan.so"
    try:
      build.build_cpu_kernel(library, compiler=cxx, sanitize=True)
    except RuntimeError as e:
      return f"cannot build the sanitizer kernel here: {e}", None
    # libstdc++ preloaded with ASan: its __cxa_throw interceptor needs the real one
    # resolved before jaxlib (which throws while it starts) is loaded.
    env = dict(os.environ, ADAMKIT_CPU_KERNEL=str(library), LD_PRELOAD=f"{asan} {stdcxx}",
               PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
               ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:halt_on_error=1",
               UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1")
    env.pop("XLA_FLAGS", None)  # one device: "auto" picks the kernel too
    return None, background.run([sys.executable, __file__], env=env, cwd=ROOT,
                                timeout=DEADLINE_S)


# Started when collection ends, beside the rest of the suite (tests/background.py).
BACKGROUND = _build_and_drive


def test_kernels_under_address_and_undefined_behaviour_sanitizers():
  reason, done = background.result(_build_and_drive, timeout=2 * DEADLINE_S)
  if reason is not None:
    pytest.skip(reason)
  log = done.stdout + done.stderr
  assert "AddressSanitizer" not in log and "runtime error:" not in log, log[-6000:]
  assert done.returncode == 0, log[-6000:]
  assert "sanitizer driver: all" in done.stdout, log[-3000:]


# ------------------------------------------------- the driver (runs in the subprocess)


def _drive():  # noqa: C901 - one list of cases
  import functools
  import itertools

  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax

  import adamkit as ak
  from adamkit import _quant

  assert ak.cpu_kernel_available(), "the sanitizer kernel did not load"
  rng = np.random.default_rng(0)
  counts = {"cases": 0, "refused": 0}

  def unaddressed_rows_kept(before, after, ids, num_rows):
    valid = {int(i) for i in np.asarray(ids) if 0 <= int(i) < num_rows}
    keep = np.array([r for r in range(num_rows) if r not in valid], dtype=np.int64)
    for b, a in zip(before, after):
      assert np.shape(a) == np.shape(b)
      if num_rows:
        b, a = np.asarray(b).reshape(num_rows, -1), np.asarray(a).reshape(num_rows, -1)
        np.testing.assert_array_equal(a[keep], b[keep])
    counts["cases"] += 1

  def refused(fn, *args, **kwargs):
    try:
      jax.block_until_ready(fn(*args, **kwargs))
    except Exception:  # noqa: BLE001 - any clear error; the sanitizer watches the rest
      counts["refused"] += 1
      return
    raise AssertionError("a malformed input was accepted")

  def id_sets(n):
    sets = [[], [0], list(range(n))[:3] * 2, [-1, n, INT32_MIN, INT32_MAX]]
    if n:
      sets.append([n - 1, -1, 0, n, INT32_MAX, n - 1, INT32_MIN])
    return [np.asarray(s, np.int32) for s in sets]

  def table(n, width):
    return jnp.asarray(rng.normal(size=(n, width)), jnp.float32)

  # --- sparse_adam + apply_updates, fused_sparse_lazy_adam, the fused step, per table shape
  for n, width in [(0, 3), (1, 3), (37, 1), (37, 3), (37, 17), (9, 1000)]:
    for ids in id_sets(n):
      k = len(ids)
      vals = jnp.asarray(rng.normal(size=(k, width)), jnp.float32)
      if k:
        vals = vals.at[0, 0].set(jnp.nan).at[k - 1, -1].set(jnp.inf)
      repeats = len(set(ids.tolist())) < len(ids)
      transforms = [functools.partial(ak.sparse_adam, weight_decay=0.01),
                    functools.partial(ak.sparse_adamw, weight_decay=0.01, amsgrad=True)]
      for unique, make in itertools.product((False, True) if repeats else (False,), transforms):
        tx = make(0.1, unique_ids=unique, backend="kernel")
        p = {"emb": table(n, width)}
        state = tx.init(p)

        @jax.jit
        def sparse_step(p, state, ids, vals, tx=tx, n=n):
          u, state = tx.update({"emb": ak.RowSparse(ids, vals, n)}, state, p)
          return ak.apply_updates(p, u, backend="kernel"), state

        new, new_state = sparse_step(p, state, ids, vals)
        moments = [x for x in jax.tree.leaves(state) if np.shape(x) == (n, width)]
        new_moments = [x for x in jax.tree.leaves(new_state) if np.shape(x) == (n, width)]
        unaddressed_rows_kept([p["emb"], *moments], [new["emb"], *new_moments], ids, n)

      var, m, v = table(n, width), jnp.abs(table(n, width)), jnp.abs(table(n, width))
      op = jax.jit(functools.partial(ak.fused_sparse_lazy_adam, use_nesterov=bool(k % 2),
                                     backend="kernel"))
      out = op(var, m, v, 0.9, 0.999, 0.01, 0.9, 0.999, 1e-8, vals, ids)
      unaddressed_rows_kept((var, m, v), out, ids, n)

      # fused_adam and fused_adamw(amsgrad): a table between two dense leaves, per leaf
      # and multi-tensor.
      fused = [functools.partial(ak.fused_adam, weight_decay=0.01),
               functools.partial(ak.fused_adamw, weight_decay=0.01, amsgrad=True,
                                 weight_decay_mask=None)]
      for mt, make in itertools.product((True, False), fused):
        opt = make(0.1, multi_tensor=mt, unique_ids=False, backend="kernel")
        params = {"a": table(5, 7), "b_emb": table(n, width), "c": jnp.ones(1000)}
        state = opt.init(params)

        @jax.jit
        def fused_step(params, state, ids, vals, opt=opt, n=n):
          grads = {"a": jnp.ones((5, 7)), "b_emb": ak.RowSparse(ids, vals, n),
                   "c": jnp.full((1000,), 0.5)}
          return opt.step(params, state, grads=grads)

        new, new_state = fused_step(params, state, ids, vals)
        moments = lambda s: s[1:]  # noqa: E731 - mu, nu (and nu_max)
        if mt:
          at = 35  # the table's moments lie after leaf "a" in the flat buffer
          span = slice(at, at + n * width)
          before = [params["b_emb"], *(x["float32"][span] for x in moments(state))]
          after = [new["b_emb"], *(x["float32"][span] for x in moments(new_state))]
        else:
          before = [params["b_emb"], *(x["b_emb"] for x in moments(state))]
          after = [new["b_emb"], *(x["b_emb"] for x in moments(new_state))]
        unaddressed_rows_kept(before, after, ids, n)

  # --- the dense step of each variant on leaves of sizes 0, 1, 17 and one split over the
  # thread pool
  dense = [functools.partial(ak.fused_adam, weight_decay=0.1, nesterov=True),
           functools.partial(ak.fused_adam, amsgrad=True, eps_mode="corrected"),
           functools.partial(ak.fused_adamw, amsgrad=True, bias_correction=False),
           functools.partial(ak.fused_adamax, weight_decay=0.1)]
  for sizes, make, mt in itertools.product([(1,), (17, 0, 3), (300_000,), (5, 200_000)], dense,
                                           (True, False)):
    opt = make(0.1, multi_tensor=mt, backend="kernel")
    params = {f"l{i}": jnp.asarray(rng.normal(size=s), jnp.float32) for i, s in enumerate(sizes)}
    grads = {k: jnp.where(jnp.arange(x.size) % 7 == 0, jnp.nan, x) for k, x in params.items()}
    jax.block_until_ready(jax.jit(opt.step)(params, opt.init(params), grads=grads))
    counts["cases"] += 1

  # --- malformed states and values through the public API: refused before any kernel runs
  big = {"w": jnp.ones(100_000)}
  opt = ak.fused_adam(0.1, multi_tensor=False, backend="kernel")
  refused(jax.jit(opt.step), big, opt.init(big)._replace(mu={"w": jnp.zeros(10)}), grads=big)
  refused(jax.jit(opt.step), big, opt.init(big)._replace(nu={"w": jnp.zeros(10)}), grads=big)
  refused(jax.jit(opt.step), big,
          opt.init(big)._replace(mu={"w": jnp.zeros(100_000, jnp.int32)}), grads=big)
  ams = ak.fused_adamw(0.1, amsgrad=True, multi_tensor=False, backend="kernel")
  refused(jax.jit(ams.step), big, ams.init(big)._replace(nu_max={"w": jnp.zeros(10)}), grads=big)
  refused(jax.jit(ams.step), big, opt.init(big), grads=big)  # no running maximum at all
  short = ak.RowSparse(jnp.array([1, 2, 3, 4]), jnp.ones((4, 8)), 100).with_values(jnp.ones((2, 8)))
  emb = {"e": jnp.zeros((100, 8))}
  tx = ak.sparse_adam(0.1, backend="kernel")
  refused(jax.jit(tx.update), {"e": short}, tx.init(emb), emb)
  refused(lambda: ak.apply_updates(emb, {"e": short}, backend="kernel"))
  fopt = ak.fused_adam(0.1, backend="kernel")
  refused(jax.jit(fopt.step), emb, fopt.init(emb), grads={"e": short})

  # --- each kernel called directly with mismatched buffers: the handler itself refuses
  f32 = lambda *s: jnp.zeros(s, jnp.float32)
  sd = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
  s9 = f32(9)
  call = lambda target, outs, *a, **kw: jax.ffi.ffi_call(target, outs)(*a, **kw)
  step_attrs = dict(kind=np.int64(0), nesterov=False, decay=np.int64(1), amsgrad=False,
                    state=np.int64(2))
  ams_attrs = dict(step_attrs, decay=np.int64(2), amsgrad=True, state=np.int64(3))
  p, small, full = f32(100_000), f32(10), f32(100_000)
  for state, off, attrs in [((small, full), 0, step_attrs), ((full, small), 0, step_attrs),
                            ((full, full), 1, step_attrs), ((full, full), -5, step_attrs),
                            ((full, full, small), 0, ams_attrs), ((full, full, full), 1, ams_attrs),
                            ((full, full), 0, ams_attrs),  # AMSGrad without its third buffer
                            ((full, full, full), 0, step_attrs),  # a third buffer, no AMSGrad
                            ((full, full, full), 0, dict(ams_attrs, kind=np.int64(2)))]:
    refused(call, "adamkit_cpu_step", [sd(p), *map(sd, state)], s9, p, p, *state,
            offset=np.int64(off), **attrs)
  refused(call, "adamkit_cpu_step", [sd(p), sd(full), sd(full)], s9, p, f32(99_999), full, full,
          offset=np.int64(0), **step_attrs)
  ids = jnp.array([1, 2, 3, 99], jnp.int32)
  tbl = f32(100, 8)
  lazy_attrs = dict(step_attrs, decay=np.int64(0), apply=True, merge=True)
  lazy_ams = dict(ams_attrs, apply=True, merge=True)
  for rows, m, off, n in [(f32(2, 16), tbl, 0, 100), (f32(4, 8), f32(10, 8), 0, 100),
                          (f32(4, 8), tbl, 8, 100), (f32(4, 8), tbl, 0, 101),
                          (f32(4, 8), tbl, 0, -1), (f32(4, 8), tbl, -8, 100)]:
    refused(call, "adamkit_cpu_sparse_lazy", [sd(m), sd(tbl), sd(tbl)], s9, ids, rows, m, tbl,
            tbl, offset=np.int64(off), num_rows=np.int64(n), **lazy_attrs)
    refused(call, "adamkit_cpu_sparse_lazy", [sd(tbl), sd(tbl), sd(m), sd(tbl)], s9, ids, rows,
            tbl, tbl, m, tbl, offset=np.int64(off), num_rows=np.int64(n), **lazy_ams)
  refused(call, "adamkit_cpu_sparse_lazy", [sd(tbl), sd(tbl), sd(tbl)], s9, ids, f32(4, 8), tbl,
          tbl, tbl, offset=np.int64(0), num_rows=np.int64(100), **lazy_ams)  # no table: 3 args
  refused(call, "adamkit_cpu_sparse_lazy", [sd(tbl), sd(tbl), sd(f32(4)), sd(f32(4, 8))], s9,
          ids, f32(4, 8), tbl, tbl, offset=np.int64(0), num_rows=np.int64(100),
          **dict(lazy_attrs, apply=False))
  refused(call, "adamkit_cpu_sparse_lazy",  # decoupled decay needs the table
          [sd(tbl), sd(tbl), sd(tbl), sd(f32(4).astype(jnp.int32)), sd(f32(4, 8))], s9, ids,
          f32(4, 8), tbl, tbl, tbl, offset=np.int64(0), num_rows=np.int64(100),
          **dict(lazy_ams, apply=False))
  for rows, t in [(f32(2, 8), tbl), (f32(4, 3), tbl), (f32(4, 8, 1), tbl), (f32(4), f32(100, 1))]:
    refused(call, "adamkit_cpu_row_add", sd(t), ids, rows, t)
  # --- the quantized dense step (8-bit moments): public API on leaves of sizes 0, 1, 17,
  # 300 (partial blocks) and one split over the thread pool, NaN/Inf gradients; the general
  # path (AMSGrad, one moment quantized) and the vector passes (both moments quantized:
  # AVX-512 for blocks of 64 and more, AVX2 for smaller ones, where the CPU has them)
  q8, q8_32 = ak.Quantized("8bit", min_size=0), ak.Quantized("8bit", 32, 0)
  quantized = [functools.partial(ak.fused_adamw, mu_dtype=q8, nu_dtype=q8, amsgrad=True),
               functools.partial(ak.fused_adam, mu_dtype=q8, weight_decay=0.1),
               functools.partial(ak.fused_adamax, nu_dtype=ak.Quantized("8bit", 64, 0)),
               functools.partial(ak.fused_adamw, mu_dtype=q8, nu_dtype=q8),
               functools.partial(ak.fused_adam, mu_dtype=q8_32, nu_dtype=q8_32, nesterov=True)]
  # the lazy step of 8-bit table moments (the row kernel: rows of power-of-two blocks),
  # every id set, NaN/Inf gradients; the codes and scales of untouched rows kept
  for (n, width), make in itertools.product([(0, 8), (37, 1), (37, 16)], [
      functools.partial(ak.sparse_adam, mu_dtype=q8, nu_dtype=q8),
      functools.partial(ak.sparse_adamw, mu_dtype=q8, nu_dtype=q8, amsgrad=True)]):
    for ids in id_sets(n):
      tx = make(0.1, backend="kernel")
      p = {"emb": table(n, width)}
      vals = jnp.asarray(rng.normal(size=(len(ids), width)), jnp.float32)
      vals = vals.at[0, 0].set(jnp.nan).at[-1, -1].set(jnp.inf) if len(ids) else vals
      state = tx.init(p)
      step = jax.jit(lambda ids, vals, state, p, tx=tx, n=n: tx.update(
          {"emb": ak.RowSparse(ids, vals, n)}, state, p))  # ids outside: dropped in jit
      u, new_state = step(ids, vals, state, p)
      rows = [[x for x in jax.tree.leaves(t) if np.shape(x)[:1] == (n,)] for t in (state, new_state)]
      unaddressed_rows_kept(*rows, ids, n)
  for sizes, make, mt in itertools.product([(1,), (17, 0, 300), (300_000,), (5, 200_000)],
                                           quantized, (True, False)):
    opt = make(0.1, multi_tensor=mt, backend="kernel")
    params = {f"l{i}": jnp.asarray(rng.normal(size=s), jnp.float32) for i, s in enumerate(sizes)}
    grads = {k: jnp.where(jnp.arange(x.size) % 7 == 0, jnp.nan, x * 1e30) for k, x in params.items()}
    jax.block_until_ready(jax.jit(opt.step)(params, opt.init(params), grads=grads))
    counts["cases"] += 1

  # --- the quantized kernel called directly with malformed buffers: the handler refuses
  u8 = lambda *s: jnp.zeros(s, jnp.uint8)
  mid = jnp.asarray(np.sort(rng.normal(size=255)), jnp.float32)
  book = f32(256)
  q_attrs = dict(kind=np.int64(1), nesterov=False, decay=np.int64(2), amsgrad=False,
                 state=np.int64(2), quantized=np.array([1, 1], np.int64),
                 offsets=np.array([0, 0], np.int64), block=np.int64(256))
  n = 1000  # 4 blocks
  pq, codes, scales = f32(n), u8(4, 256), f32(4)
  good = [pq, pq, codes, scales, book, mid, codes, scales, book, mid]
  outs = [sd(pq), sd(codes), sd(scales), sd(codes), sd(scales)]
  jax.block_until_ready(call("adamkit_cpu_step_quantized", outs, s9, *good, **q_attrs))
  bad_args = [
      [pq, f32(999), *good[2:]],  # a gradient shorter than its param
      [pq, pq, u8(3, 256), *good[3:]],  # fewer codes than scales x block
      [pq, pq, codes, f32(3), *good[4:]],  # too few blocks for the leaf
      [pq, pq, codes, scales, f32(255), *good[5:]],  # a short code book
      [pq, pq, codes, scales, book, f32(254), *good[6:]],  # short midpoints
      [pq, pq, codes, scales, book, mid[::-1], *good[6:]],  # unsorted midpoints
      [pq, pq, codes, scales, book, mid.at[3].set(jnp.nan), *good[6:]],
      [pq, pq, f32(4, 256), *good[3:]],  # float codes
      [pq, pq, *good[2:9]],  # a buffer missing
  ]
  for operands in bad_args:
    refused(call, "adamkit_cpu_step_quantized", outs, s9, *operands, **q_attrs)
  for attrs in [dict(q_attrs, block=np.int64(100)), dict(q_attrs, block=np.int64(0)),
                dict(q_attrs, offsets=np.array([1, 0], np.int64)),
                dict(q_attrs, offsets=np.array([-1, 0], np.int64)),
                dict(q_attrs, quantized=np.array([1], np.int64)),
                dict(q_attrs, quantized=np.array([1, 0], np.int64)),
                dict(q_attrs, amsgrad=True, state=np.int64(3))]:
    refused(call, "adamkit_cpu_step_quantized", outs, s9, *good, **attrs)
  refused(call, "adamkit_cpu_step_quantized", outs[:-1] + [sd(f32(5))], s9, *good, **q_attrs)
  # --- the chain form's requantization (adamkit_cpu_requantize): ak.adamw / ak.adam
  # (AMSGrad) / ak.adamax with 8-bit moments, update + apply_updates under jit and eagerly,
  # on leaves of whole and partial blocks (the AVX-512 pass for blocks of 64 and more, the
  # general path for the rest and for blocks of 32), one split over the thread pool, NaN/Inf
  # gradients in some blocks
  from adamkit import _quant_ops

  chain = [functools.partial(ak.adamw, mu_dtype=q8, nu_dtype=q8),
           functools.partial(ak.adam, mu_dtype=q8_32, nu_dtype=q8_32, amsgrad=True),
           functools.partial(ak.adamax, mu_dtype=ak.Quantized("8bit", 64, 0),
                             nu_dtype=ak.Quantized("8bit", 64, 0))]
  for shape, make, jitted in itertools.product([(40_000,), (300, 1001), (64, 1024), (700_000,)],
                                               chain, (True, False)):
    tx = make(0.1)
    params = {"w": jnp.asarray(rng.normal(size=shape), jnp.float32)}
    state = tx.init(params)
    for t in range(2):
      g = jnp.asarray(rng.normal(size=shape) * 10.0 ** rng.integers(-30, 30, size=shape),
                      jnp.float32).reshape(-1)
      g = g.at[t * 300].set(jnp.nan).at[-1 - t].set(jnp.inf).at[5000].set(-jnp.inf)

      def step(p, s, g, tx=tx):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

      params, state = (jax.jit(step) if jitted else step)(params, state, {"w": g.reshape(shape)})
    jax.block_until_ready(params)
    counts["cases"] += 1
  g = jnp.ones(40_000, jnp.float32)
  olds = tuple(_quant.zeros((40_000,), _quant.resolve(q8, r)) for r in ("mu", "nu"))
  assert _quant_ops._on_kernel(_quant_ops.MomentRule("adam", 0.9, 0.999), g, olds), \
      "the chain form did not take the kernel"

  # --- the requantize kernel called directly with malformed buffers: the handler refuses
  rq_attrs = dict(kind=np.int64(1), amsgrad=False, state=np.int64(2), block=np.int64(256))
  gq = f32(1000)  # 4 blocks, the last one partial
  rq_good = [codes, scales, book, mid, codes, scales, book, mid]
  rq_outs = [sd(codes), sd(scales), sd(codes), sd(scales)]
  jax.block_until_ready(call("adamkit_cpu_requantize", rq_outs, s9, gq, *rq_good, **rq_attrs))
  for operands, attrs, outs in [
      ((f32(700), *rq_good), rq_attrs, rq_outs),  # 3 blocks of gradient, 4 of moments
      ((f32(1100), *rq_good), rq_attrs, rq_outs),  # 5 blocks of gradient
      ((gq, u8(3, 256), *rq_good[1:]), rq_attrs, rq_outs),  # fewer codes than scales x block
      ((gq, codes, f32(3), *rq_good[2:]), rq_attrs, rq_outs),  # too few scales
      ((gq, *rq_good[:4], codes, f32(5), *rq_good[6:]), rq_attrs, rq_outs),  # too many
      ((gq, codes, scales, f32(255), *rq_good[3:]), rq_attrs, rq_outs),  # a short code book
      ((gq, codes, scales, book.at[7].set(jnp.inf), *rq_good[3:]), rq_attrs, rq_outs),
      ((gq, codes, scales, book, f32(254), *rq_good[4:]), rq_attrs, rq_outs),  # short midpoints
      ((gq, codes, scales, book, mid[::-1], *rq_good[4:]), rq_attrs, rq_outs),  # unsorted
      ((gq, codes, scales, book, mid.at[3].set(jnp.nan), *rq_good[4:]), rq_attrs, rq_outs),
      ((gq, f32(4, 256), *rq_good[1:]), rq_attrs, rq_outs),  # float codes
      ((gq, *rq_good[:7]), rq_attrs, rq_outs),  # a buffer missing
      ((gq, *rq_good), dict(rq_attrs, block=np.int64(100)), rq_outs),
      ((gq, *rq_good), dict(rq_attrs, block=np.int64(0)), rq_outs),
      ((gq, *rq_good), dict(rq_attrs, block=np.int64(2**21)), rq_outs),
      ((gq, *rq_good), dict(rq_attrs, kind=np.int64(7)), rq_outs),
      ((gq, *rq_good), dict(rq_attrs, state=np.int64(3)), rq_outs),  # 3 buffers, no AMSGrad
      ((gq, *rq_good, *rq_good[:4]), dict(rq_attrs, kind=np.int64(2), amsgrad=True,
                                          state=np.int64(3)), rq_outs + rq_outs[:2]),  # AdaMax
      ((gq, *rq_good), rq_attrs, rq_outs[:3] + [sd(f32(5))]),  # a short result
      ((gq, *rq_good), rq_attrs, [sd(u8(4, 255))] + rq_outs[1:]),  # short result codes
      ((gq, *rq_good), rq_attrs, rq_outs[:3]),  # a result missing
      ((gq, *rq_good), rq_attrs, rq_outs[:2] + [sd(f32(4, 256)), sd(scales)]),  # float codes
  ]:
    refused(call, "adamkit_cpu_requantize", outs, s9, *operands, **attrs)
  # --- the rounded dense step (bf16 params, param_rounding): public API on leaves of sizes
  # 0, 1, 17 (2-D: counters in two words), one split over the thread pool; bf16 and float32
  # gradients with NaN and Inf; every method, per leaf and multi-tensor
  rounded = [functools.partial(ak.fused_adamw, amsgrad=True, param_rounding="kahan"),
             functools.partial(ak.fused_adam, weight_decay=0.1, param_rounding="stochastic",
                               seed=5),
             functools.partial(ak.fused_adamax, weight_decay=0.1, param_rounding="nearest")]
  for shapes, make, mt, gdt in itertools.product(
      [[(1,)], [(17, 3), (0,), ()], [(300_000,)], [(5,), (400, 500)]], rounded, (True, False),
      (jnp.bfloat16, jnp.float32)):
    opt = make(0.1, multi_tensor=mt, backend="kernel")
    params = {f"l{i}": jnp.asarray(rng.normal(size=s), jnp.bfloat16) for i, s in enumerate(shapes)}
    grads = {k: jnp.where(jnp.arange(x.size).reshape(x.shape) % 7 == 0, jnp.nan,
                          x.astype(gdt) * 1e30).astype(gdt) for k, x in params.items()}
    jax.block_until_ready(jax.jit(opt.step)(params, opt.init(params), grads=grads))
    counts["cases"] += 1

  # --- the rounded kernel called directly with malformed buffers: the handler refuses
  bf = lambda *s: jnp.zeros(s, jnp.bfloat16)
  r_attrs = dict(step_attrs, decay=np.int64(2), offset=np.int64(0), rounding=np.int64(2),
                 grads_f32=False)
  pb, cb = bf(1000), bf(1000)
  m1 = f32(1000)
  r_outs = [sd(pb), sd(m1), sd(m1), sd(cb)]
  jax.block_until_ready(call("adamkit_cpu_step_rounded", r_outs, s9, pb, pb, m1, m1, cb,
                             **r_attrs))
  for operands, attrs, outs in [
      ((pb, bf(999), m1, m1, cb), r_attrs, r_outs),  # a gradient shorter than its param
      ((pb, pb, m1, m1, bf(999)), r_attrs, r_outs),  # a short Kahan buffer
      ((pb, pb, m1, f32(999), cb), r_attrs, r_outs),  # a short second moment
      ((pb, pb, m1, m1, cb), dict(r_attrs, offset=np.int64(1)), r_outs),
      ((pb, pb, m1, m1, cb), dict(r_attrs, offset=np.int64(-1)), r_outs),
      ((pb, pb, m1, m1, cb), dict(r_attrs, rounding=np.int64(7)), r_outs),
      ((pb, pb, m1, m1, cb), dict(r_attrs, grads_f32=True), r_outs),  # bf16 grads said f32
      ((m1, pb, m1, m1, cb), r_attrs, [sd(m1)] + r_outs[1:]),  # float32 params
      ((pb, pb, m1, m1, f32(1000)), r_attrs, r_outs[:3] + [sd(m1)]),  # float32 buffer
      ((pb, pb, m1, m1), r_attrs, r_outs[:3]),  # no Kahan buffer
      ((pb, pb, m1, m1, cb), r_attrs, r_outs[:3] + [sd(bf(999))]),  # a short result
      ((pb, pb, m1, m1, jnp.zeros(1, jnp.uint32)),  # stochastic: one key word, not two
       dict(r_attrs, rounding=np.int64(1)), r_outs[:3]),
      ((pb, pb, m1, m1, jnp.zeros(2, jnp.int32)),  # stochastic: signed key words
       dict(r_attrs, rounding=np.int64(1)), r_outs[:3]),
      ((pb, pb, m1, m1), dict(r_attrs, rounding=np.int64(1)), r_outs[:3]),  # no keys
      ((pb, pb, m1, m1, m1), dict(r_attrs, amsgrad=True, state=np.int64(3), rounding=np.int64(0)),
       r_outs[:3]),  # three state buffers, two results
  ]:
    refused(call, "adamkit_cpu_step_rounded", outs, s9, *operands, **attrs)
  # --- every handler's attributes and sizes at and past the ends of their ranges
  # (tests/kernel_attrs.py: INT64_MAX / INT64_MIN offsets, sums that wrap int64, products
  # that overflow it, block sizes and row counts out of range): the expected error, the
  # operands unchanged, or at the edge of a range a run that keeps what lies outside it
  import kernel_attrs

  for c in kernel_attrs.calls():
    kernel_attrs.check(c)
    counts["refused" if c.error else "cases"] += 1
  print(f"sanitizer driver: all {counts['cases']} cases held, {counts['refused']} malformed "
        "inputs refused")


if __name__ == "__main__":
  _drive()
