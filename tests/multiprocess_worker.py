"""One JAX process of tests/test_multiprocess.py (not a test module: the parent launches it).

``python tests/multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR`` joins a
``jax.distributed`` job on 127.0.0.1 with 2 CPU devices per process (gloo collectives),
trains a small model sharded over a global ("data", "model") mesh with every optimizer
and compares each shard this process holds with the same training run on one local
device. It writes ``OUT_DIR/result_<PROCESS_ID>.json``: ``{case: "ok" or the error}``.
Nothing runs on import (pytest's doctest collection imports every module under tests/).
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import traceback

N_ROWS, DIM, HIDDEN, OUT, BATCH, STEPS, LR = 64, 8, 16, 4, 16, 3, 0.05


def _setup(process_id: int, num_processes: int, port: int):
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
  import jax
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.config.update("jax_numpy_dtype_promotion", "strict")
  # Bounded waits: a peer that never comes (or dies) ends this process instead of hanging.
  jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=num_processes,
                             process_id=process_id, initialization_timeout=60,
                             heartbeat_timeout_seconds=30, shutdown_timeout_seconds=30)
  return jax


def _optax_form(fused):
  """A fused optimizer seen only as an optax transform (its ``update``, not ``step``)."""
  import optax
  return optax.GradientTransformation(fused.init, fused.update)


def main(process_id: int, num_processes: int, port: int, out_dir: pathlib.Path) -> None:
  jax = _setup(process_id, num_processes, port)
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import AxisType, NamedSharding, SingleDeviceSharding
  from jax.sharding import PartitionSpec as P

  here = pathlib.Path(__file__).resolve().parent
  sys.path[:0] = [str(here.parent), str(here)]  # this checkout's adamkit, and registry.py
  from registry import REGISTRY

  import adamkit as ak
  from adamkit import _compat, _fused, _quant

  assert jax.process_count() == num_processes and jax.local_device_count() == 2
  mesh = jax.make_mesh((2, jax.device_count() // 2), ("data", "model"),
                       axis_types=(AxisType.Auto, AxisType.Auto))
  specs = {"emb": P(("data", "model"), None),  # the table: rows over every device
           "w1": P(None, "model"), "w2": P("model", None),  # model-parallel
           "b": P()}  # replicated
  rng = np.random.default_rng(0)
  host_params = {"emb": 0.1 * rng.standard_normal((N_ROWS, DIM)),
                 "w1": rng.standard_normal((DIM, HIDDEN)) / np.sqrt(DIM),
                 "w2": rng.standard_normal((HIDDEN, OUT)) / np.sqrt(HIDDEN),
                 "b": np.zeros(OUT)}
  host_params = {k: v.astype(np.float32) for k, v in host_params.items()}
  host_batches = [(rng.integers(0, N_ROWS, BATCH).astype(np.int32),
                   rng.standard_normal((BATCH, OUT)).astype(np.float32)) for _ in range(2 * STEPS)]

  def global_array(x, spec):
    sharding = NamedSharding(mesh, spec)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

  local = SingleDeviceSharding(jax.local_devices()[0])

  def params_on(kind, dtype=jnp.float32):
    if kind == "mesh":
      out = {k: global_array(v, specs[k]) for k, v in host_params.items()}
    else:
      out = {k: jax.device_put(v, local) for k, v in host_params.items()}
    return {k: v.astype(dtype) if k != "emb" else v for k, v in out.items()}

  def batches_on(kind):
    if kind == "mesh":
      return [(global_array(i, P("data")), global_array(y, P("data", None)))
              for i, y in host_batches]
    return [(jax.device_put(i, local), jax.device_put(y, local)) for i, y in host_batches]

  def loss(params, ids, y):
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731 - bf16 params (master_weights) too
    h = ak.lookup(params["emb"], ids)
    pred = jnp.tanh(h @ f32(params["w1"])) @ f32(params["w2"]) + f32(params["b"])
    return jnp.mean((pred - y) ** 2)

  def make_step(opt, grads_kind, pin=None):
    """The jitted step; ``pin``: the params' shardings, given to jit as their
    ``out_shardings`` (see :func:`pinned`)."""
    sparse_vg = ak.value_and_sparse_grad(loss)
    out = None if pin is None else (pin, None)

    def grads_of(params, ids, y):
      if grads_kind == "sparse":
        return sparse_vg(params, {"emb": ids}, ids, y)[1]
      return jax.grad(loss)(params, ids, y)

    if isinstance(opt, ak.FusedStep):
      return jax.jit(lambda p, s, ids, y: opt.step(p, s, grads=grads_of(p, ids, y)),
                     out_shardings=out)

    def step(params, state, ids, y):
      updates, state = opt.update(grads_of(params, ids, y), state, params)
      return ak.apply_updates(params, updates), state
    return jax.jit(step, out_shardings=out)

  def pinned(params, state):
    """The params' shardings where the step cannot keep them by itself, else None: a
    multi-tensor fused state (flat moment buffers, not the params' tree) on a JAX without
    ``shard_alike`` (0.12), whose documented remedy on an Auto mesh is jit's
    ``out_shardings`` (docs/optimizers/fused.md)."""
    if _compat.TIES_SHARDINGS:
      return None
    fused = (_fused.FusedAdamState, _fused.FusedAmsgradState)
    flat = [x for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, fused))
            if isinstance(x, fused) and jax.tree.structure(x.mu, is_leaf=_quant.is_qarray)
            != jax.tree.structure(params)]
    return jax.tree.map(lambda x: x.sharding, params) if flat else None

  def train(opt, grads_kind, kind, dtype, steps=STEPS):
    params = params_on(kind, dtype)
    state = opt.init(params)
    step = make_step(opt, grads_kind, pinned(params, state))
    for ids, y in batches_on(kind)[:steps]:
      params, state = step(params, state, ids, y)
    return params, state

  def assert_shards_match(tree, ref, rtol, atol):
    """Every shard this process holds equals the matching block of the one-device run."""
    leaves, ref_leaves = jax.tree.leaves(tree), jax.tree.leaves(ref)
    assert len(leaves) == len(ref_leaves), (len(leaves), len(ref_leaves))
    for x, r in zip(leaves, ref_leaves):
      assert x.shape == r.shape and x.dtype == r.dtype, (x.shape, x.dtype, r.shape, r.dtype)
      r = np.asarray(r.astype(jnp.float32) if r.dtype == jnp.bfloat16 else r)
      for shard in x.addressable_shards:
        got = np.asarray(shard.data.astype(jnp.float32) if x.dtype == jnp.bfloat16 else shard.data)
        if x.dtype == jnp.uint8:
          # quantized codes: a moment that the mesh's float32 rounding moves across a
          # level's boundary takes the neighbouring code; the scales and params are held
          # to the float tolerances, and a wrong step would change most codes
          assert np.mean(got != r[shard.index]) <= 0.01, np.mean(got != r[shard.index])
          continue
        np.testing.assert_allclose(got, r[shard.index], rtol=rtol, atol=atol)

  # The mesh run splits the batch and hidden reductions over devices, so its gradients
  # differ from one device's by float32 rounding; Adam's normalised step m / sqrt(v) turns
  # that into up to ~1e-3 of a step (lr 0.05) on a near-zero gradient component (jax 0.12's
  # reduction order: 2.8e-4 seen). A wrong update would be off by about a whole step.
  tol_params, tol_state = dict(rtol=1e-4, atol=5e-5), dict(rtol=1e-4, atol=1e-6)
  # bf16 params: a gradient one bf16 unit apart (0.4%) moves the float32 master by ~1e-4.
  tol_bf16 = dict(rtol=1e-2, atol=2e-4)
  cases = {}
  for name, factory in REGISTRY.items():
    cases[f"registry:{name}"] = (lambda f=factory: f(LR), "dense", jnp.float32)
  cases.update({
      "sparse_adam_lazy": (lambda: ak.sparse_adam(LR, weight_decay=0.01), "sparse", jnp.float32),
      "sparse_adam_not_lazy": (lambda: ak.sparse_adam(LR, lazy=False), "sparse", jnp.float32),
      "fused_adam_xla": (lambda: ak.fused_adam(LR, weight_decay=0.01, backend="xla"), "sparse",
                         jnp.float32),
      "fused_adam_auto": (lambda: ak.fused_adam(LR, weight_decay=0.01), "sparse", jnp.float32),
      "fused_adamax": (lambda: ak.fused_adamax(LR, backend="xla"), "dense", jnp.float32),
      # the fused step's optax form (update + apply_updates), multi-tensor state
      "fused_adam_update": (lambda: _optax_form(ak.fused_adam(LR, weight_decay=0.01)), "sparse",
                            jnp.float32),
      "offload_state": (lambda: ak.offload(ak.adam(LR), mode="state"), "dense", jnp.float32),
      "offload_compute": (lambda: ak.offload(ak.adam(LR), mode="compute"), "dense", jnp.float32),
      "master_weights": (lambda: ak.master_weights(ak.adam(LR)), "dense", jnp.bfloat16),
      # quantized moments (8-bit m, 4-bit v), state offloaded: codes and scales in host memory
      "quantized_offload_state": (lambda: ak.offload(ak.adamw(
          LR, mu_dtype=ak.Quantized("8bit", block_size=64, min_size=0),
          nu_dtype=ak.Quantized("4bit", block_size=64, min_size=0)), mode="state"), "dense",
          jnp.float32),
  })
  only = os.environ.get("ADAMKIT_MP_CASES")
  if only:
    cases = {k: v for k, v in cases.items() if k in only.split(",")}

  def changed_shardings(params):
    return {k: str(params[k].sharding.spec) for k, spec in specs.items()
            if not params[k].sharding.is_equivalent_to(NamedSharding(mesh, spec), params[k].ndim)}

  # Two outcomes per case: the values ("values") and whether the params kept their
  # shardings ("shardings"); the parent turns each into a test.
  results = {}
  for name, (make, grads_kind, dtype) in cases.items():
    out = results[name] = {}
    try:
      opt = make()
      params, state = train(opt, grads_kind, "mesh", dtype)
      ref_params, ref_state = train(opt, grads_kind, "local", dtype)
      bf16 = dtype == jnp.bfloat16
      assert_shards_match(params, ref_params, **(tol_bf16 if bf16 else tol_params))
      assert_shards_match(state, ref_state, **(tol_bf16 if bf16 else tol_state))
      out["values"] = "ok"
      moved = changed_shardings(params)
      out["shardings"] = f"params resharded to {moved}" if moved else "ok"
    except Exception:  # noqa: BLE001 - reported to the parent, which fails that case
      out["values"] = out["shardings"] = traceback.format_exc()
    print(process_id, name, out, flush=True)

  # The routed row step (adamkit/_row_sharded.py) across processes: a table row-sharded
  # over the 4 devices of an Explicit mesh, RowSparse gradients with repeated ids and ids
  # piling onto one shard; bit-identical to one device.
  out = results["routed_rows"] = {}
  try:
    explicit = jax.make_mesh((jax.device_count(),), ("rows",), axis_types=(AxisType.Explicit,))
    rows, rep = NamedSharding(explicit, P("rows", None)), NamedSharding(explicit, P())
    tx = ak.sparse_adam(LR, weight_decay=0.01, backend="xla")
    id_sets = [rng.integers(0, N_ROWS, 40), rng.integers(0, N_ROWS // 4, 40)]
    grads = [(i.astype(np.int32), rng.standard_normal((40, DIM)).astype(np.float32))
             for i in id_sets]

    @jax.jit
    def row_step(params, state, ids, values):
      g = {"emb": ak.RowSparse.tree_unflatten(N_ROWS, (ids, values))}
      updates, state = tx.update(g, state, params)
      return ak.apply_updates(params, updates, backend="xla"), state

    def run(put_table, put):
      params = {"emb": put_table(host_params["emb"])}
      state = tx.init(params)
      for ids, values in grads:
        params, state = row_step(params, state, put(ids), put(values))
      return params, state

    from adamkit import _row_sharded
    table = jax.make_array_from_callback((N_ROWS, DIM), rows, lambda i: host_params["emb"][i])
    assert _row_sharded.row_layout(table).num_shards == jax.device_count()  # it routes
    got = run(lambda x: jax.make_array_from_callback(x.shape, rows, lambda i: x[i]),
              lambda x: jax.make_array_from_callback(x.shape, rep, lambda i: x[i]))
    ref = run(lambda x: jax.device_put(x, local), lambda x: jax.device_put(x, local))
    assert_shards_match(got, ref, rtol=0, atol=0)
    out["values"] = "ok"
    out["shardings"] = "ok" if got[0]["emb"].sharding.is_equivalent_to(rows, 2) else str(
        got[0]["emb"].sharding)
  except Exception:  # noqa: BLE001
    out["values"] = out["shardings"] = traceback.format_exc()
  print(process_id, "routed_rows", out, flush=True)

  # bf16 params without a master copy (issue 20): the random bits of stochastic rounding
  # come from the key, the step and each element's global position, and the Kahan buffer is
  # sharded like its param, so both processes together write exactly the one-device bits.
  # Elementwise gradients (no cross-device reduction) make the inner update bit-identical.
  for method in ("stochastic", "kahan"):
    out = results[f"param_rounding_{method}"] = {}
    try:
      tx = ak.param_rounding(ak.adamw(LR, weight_decay=0.01), method, seed=5)

      @jax.jit
      def rounding_step(params, state, t, tx=tx):
        grads = jax.tree.map(lambda p: jnp.sin(3.0 * p.astype(jnp.float32) + t).astype(p.dtype),
                             params)
        updates, state = tx.update(grads, state, params)
        return ak.apply_updates(params, updates), state

      def rounding_run(kind, tx=tx, step=rounding_step):
        params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params_on(kind))
        state = tx.init(params)
        for t in range(STEPS):
          params, state = step(params, state, jnp.float32(t))
        return params, state

      got, ref = rounding_run("mesh"), rounding_run("local")
      assert_shards_match(got, ref, rtol=0, atol=0)
      table = global_array(host_params["emb"], specs["emb"])
      key = jax.random.key(3)
      assert_shards_match(jax.jit(ak.stochastic_round, static_argnums=1)(table, jnp.bfloat16, key),
                          ak.stochastic_round(jax.device_put(host_params["emb"], local),
                                              jnp.bfloat16, key), rtol=0, atol=0)
      out["values"] = "ok"
      moved = changed_shardings(got[0])
      out["shardings"] = f"params resharded to {moved}" if moved else "ok"
    except Exception:  # noqa: BLE001
      out["values"] = out["shardings"] = traceback.format_exc()
    print(process_id, f"param_rounding_{method}", out, flush=True)

  # Checkpoints of the sharded state: ak.state_dict (gathered, every process calls it) and
  # orbax (each process writes its shards into one shared directory).
  import orbax.checkpoint as ocp
  from jax.experimental import multihost_utils

  def whole(x):
    """All of ``x`` as NumPy (a collective when ``x`` spans both processes)."""
    if x.is_fully_addressable:
      return np.asarray(x)
    if x.sharding.memory_kind not in (None, "device"):
      x = jax.device_put(x, x.sharding.with_memory_kind("device"))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))

  def assert_trees_equal(tree, ref):
    for x, r in zip(jax.tree.leaves(tree), jax.tree.leaves(ref), strict=True):
      assert x.shape == r.shape and x.dtype == r.dtype, (x, r)
      np.testing.assert_array_equal(whole(x), whole(r))

  for name in ("sparse_adam_lazy", "offload_state", "offload_compute", "fused_adam_xla",
               "quantized_offload_state"):
    if name not in cases:
      continue
    out = results[f"checkpoint:{name}"] = {}
    try:
      make, grads_kind, dtype = cases[name]
      opt = make()
      step = make_step(opt, grads_kind)
      batches = batches_on("mesh")
      params = params_on("mesh", dtype)
      state = opt.init(params)
      for ids, y in batches[:STEPS]:
        params, state = step(params, state, ids, y)

      flat = ak.state_dict(state)
      _, ref_state = train(opt, grads_kind, "local", dtype)
      ref_flat = ak.state_dict(ref_state)
      assert sorted(flat) == sorted(ref_flat), (sorted(flat), sorted(ref_flat))
      for key in flat:
        np.testing.assert_allclose(flat[key], ref_flat[key], **tol_state)
      # The restore target: the layout the compiled step gives params and state (a fresh
      # init leaves its step counter uncommitted on one device, not on the mesh).
      p0 = params_on("mesh", dtype)
      s0 = opt.init(p0)
      layout = step.lower(p0, s0, *batches[0]).compile().output_shardings
      target = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                            (p0, s0), layout)
      zeros = lambda t: jax.make_array_from_callback(  # noqa: E731
          t.shape, t.sharding, lambda i: np.zeros(t.shape, t.dtype)[i])
      like = jax.tree.map(zeros, target[1])
      loaded = ak.load_state_dict(flat, like)
      if name.startswith("quantized"):
        # quantized moments go through the state dict as float32 and are quantized again:
        # the same values but where a block's largest entry has no code of its own
        jax.tree.map(lambda x, r: None, loaded, state)  # the same structure
        for key, value in ak.state_dict(loaded).items():
          np.testing.assert_allclose(value, flat[key], rtol=0.05, atol=1e-9)
      else:
        assert_trees_equal(loaded, state)
      out["state_dict"] = "ok"

      ckptr = ocp.StandardCheckpointer()
      path = out_dir / "ckpt" / name
      ckptr.save(path, {"params": params, "opt_state": state})
      ckptr.wait_until_finished()
      restored = ckptr.restore(path, {"params": target[0], "opt_state": target[1]})
      assert_trees_equal(restored, {"params": params, "opt_state": state})
      p_a, s_a, p_b, s_b = params, state, restored["params"], restored["opt_state"]
      for ids, y in batches[STEPS:]:
        p_a, s_a = step(p_a, s_a, ids, y)
        p_b, s_b = step(p_b, s_b, ids, y)
      assert_trees_equal((p_b, s_b), (p_a, s_a))  # resumes bit-identically
      out["orbax"] = "ok"
    except Exception:  # noqa: BLE001
      out.setdefault("state_dict", traceback.format_exc())
      out["orbax"] = traceback.format_exc()
    print(process_id, f"checkpoint:{name}", out, flush=True)

  (out_dir / f"result_{process_id}.json").write_text(json.dumps(results))
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), pathlib.Path(sys.argv[4]))
