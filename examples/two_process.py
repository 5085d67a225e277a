"""adamkit under jax.distributed: two processes on this machine, 2 CPU devices each.

    python examples/two_process.py            # starts both processes and waits for them

Each process runs ``worker()``: it joins the job, builds a (data=2, model=2) mesh over the
4 devices of both processes, trains a model with an embedding table row-sharded over all
4 devices (``ak.sparse_adam``: each device updates the rows it owns) and model-parallel
dense layers, then saves params and optimizer state with orbax (each process writes its
own shards) and restores them. On real hosts run ``worker`` once per host with the
coordinator's address instead of 127.0.0.1 (or let ``jax.distributed.initialize()``
find the cluster on Slurm, Kubernetes or Cloud TPU).
"""

import os
import socket
import subprocess
import sys
import tempfile
from functools import partial

ROWS, DIM, HIDDEN, BATCH, STEPS = 1024, 16, 32, 32, 20


def worker(process_id: int, port: int, ckpt_dir: str) -> None:
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"  # before JAX starts
  import jax
  jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives
  jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
                             initialization_timeout=60)
  import jax.numpy as jnp
  import numpy as np
  import orbax.checkpoint as ocp
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P

  import adamkit as ak

  # Explicit axes: the shardings are part of the types, so adamkit sees that the table is
  # row-sharded and routes each id to the device that owns its row.
  mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  specs = {"emb": P(("data", "model"), None), "w1": P(None, "model"), "w2": P("model", None)}
  rng = np.random.default_rng(0)  # the same numbers in every process
  host = {"emb": 0.1 * rng.standard_normal((ROWS, DIM)),
          "w1": rng.standard_normal((DIM, HIDDEN)) / np.sqrt(DIM),
          "w2": rng.standard_normal((HIDDEN, 1)) / np.sqrt(HIDDEN)}

  def global_array(x, spec):  # each process builds only the shards its devices hold
    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda i: x[i])

  params = {k: global_array(v.astype(np.float32), specs[k]) for k, v in host.items()}
  true_w = rng.standard_normal(DIM).astype(np.float32)

  by_batch = NamedSharding(mesh, P("data", None))

  def loss(params, ids, y):
    h = ak.lookup(params["emb"], ids)
    h = jnp.tanh(jnp.einsum("bd,dh->bh", h, params["w1"], out_sharding=by_batch))
    pred = jnp.einsum("bh,ho->bo", h, params["w2"], out_sharding=by_batch)[:, 0]
    return jnp.mean((pred - y) ** 2)

  tx = ak.sparse_adam(0.01)
  grad_fn = ak.value_and_sparse_grad(loss)

  @partial(jax.jit, donate_argnums=(0, 1))  # each process's shards updated in place
  def step(params, state, ids, y):
    value, grads = grad_fn(params, {"emb": ids}, ids, y)  # RowSparse gradient for the table
    updates, state = tx.update(grads, state, params)
    return ak.apply_updates(params, updates), state, value

  state = tx.init(params)
  emb_host = host["emb"].astype(np.float32)
  for t in range(STEPS):
    ids = rng.integers(0, ROWS, BATCH).astype(np.int32)
    y = np.tanh(emb_host[ids] @ true_w)
    batch = global_array(ids, P("data")), global_array(y.astype(np.float32), P("data"))
    params, state, value = step(params, state, *batch)
    if t in (0, STEPS - 1):
      print(f"process {process_id}: step {t} loss {float(value):.4f}", flush=True)

  # The state keeps the params' shardings: the table's moments are row-sharded too.
  is_adam = lambda x: isinstance(x, ak.ScaleBySparseAdamState)  # noqa: E731
  adam_state = next(x for x in jax.tree.leaves(state, is_leaf=is_adam) if is_adam(x))
  assert adam_state.mu["emb"].sharding.spec == specs["emb"]
  ckptr = ocp.StandardCheckpointer()  # every process calls save and restore
  ckptr.save(os.path.join(ckpt_dir, "step"), {"params": params, "state": state})
  ckptr.wait_until_finished()
  target = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": params, "state": state})
  restored = ckptr.restore(os.path.join(ckpt_dir, "step"), target)
  same = all(bool(jnp.array_equal(a, b)) for a, b in
             zip(jax.tree.leaves(restored), jax.tree.leaves({"params": params, "state": state})))
  print(f"process {process_id}: checkpoint restored identically: {same}", flush=True)
  jax.distributed.shutdown()


def main(timeout_s: float = 300) -> int:
  with socket.socket() as s:  # a free port for the coordinator
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  with tempfile.TemporaryDirectory() as ckpt_dir:
    procs = [subprocess.Popen([sys.executable, __file__, str(i), str(port), ckpt_dir])
             for i in range(2)]
    try:
      codes = [p.wait(timeout=timeout_s) for p in procs]  # bounded: a hang ends here
    finally:  # never leave a process waiting for a peer that died
      for p in procs:
        if p.poll() is None:
          p.kill()
  return max(codes)


if __name__ == "__main__":
  if len(sys.argv) == 4:
    worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
  else:
    sys.exit(main())
