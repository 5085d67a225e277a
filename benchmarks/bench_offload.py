"""Step time and optimizer-state memory with and without ``ak.offload``, in one run.

A 4-layer MLP (default width 5120: 105M float32 parameters) trained with ``ak.adam``:
no offload, ``mode="state"`` and ``mode="compute"``. For each, one table row:

* step time: median over ``--steps`` donated, jitted steps (compile and two warm-up
  steps excluded; the modes' steps interleaved), and its ratio to no offload;
* state bytes in device memory between steps, from the state leaves' shardings;
* what ``compiled.memory_analysis()`` reports: device arguments + temporaries, and the
  host-side arguments where the backend reports host memory separately (GPU, TPU). The CPU
  backend reports every buffer under "device" and 0 for host, whatever its memory kind;
* bytes crossing host <-> device per step, computed from the mode.

On CPU the "device" and "pinned_host" memories are the same RAM, so the timings measure
the bookkeeping of offloading (extra copies), not a PCIe link; read them as such.

  python benchmarks/bench_offload.py              # 105M parameters
  python benchmarks/bench_offload.py --width 512  # a quick smoke run
  python benchmarks/bench_offload.py --width 1024 --chunk-bytes 1048576  # + streamed state
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import optax

import adamkit as ak


def make_params(width: int, layers: int):
  keys = jax.random.split(jax.random.key(0), layers)
  return {f"layer{i}": {"kernel": jax.random.normal(k, (width, width), jnp.float32)
                        / jnp.sqrt(jnp.float32(width)),
                        "bias": jnp.zeros((width,), jnp.float32)}
          for i, k in enumerate(keys)}


def loss_fn(params, x):
  for layer in params.values():
    x = jnp.tanh(x @ layer["kernel"] + layer["bias"])
  return jnp.mean(x * x)


def make_step(tx, one_pass=False):
  """The jitted training step: ``update`` + ``optax.apply_updates``, or (``one_pass``) the
  offloaded transform's ``step``, which adds each streamed call's update to its rows."""
  def step(params, state, x):
    grads = jax.grad(loss_fn)(params, x)
    if one_pass:
      return tx.step(params, state, grads=grads)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state
  return jax.jit(step, donate_argnums=(0, 1))


def nbytes(tree, kind=None):
  return sum(x.nbytes for x in jax.tree.leaves(tree)
             if kind is None or x.sharding.memory_kind == kind)


class Case:
  """One optimizer: its compiled step, live params/state, and its step times."""

  def __init__(self, name, tx, width, layers, batch, one_pass=False):
    self.name = name
    self.params = make_params(width, layers)
    self.x = jax.random.normal(jax.random.key(1), (batch, width), jnp.float32)
    self.state = tx.init(self.params)
    self.compiled = make_step(tx, one_pass).lower(self.params, self.state, self.x).compile()
    self.mem = self.compiled.memory_analysis()
    self.times = []

  def step(self, record=True):
    t0 = time.perf_counter()
    self.params, self.state = self.compiled(self.params, self.state, self.x)
    jax.block_until_ready((self.params, self.state))
    if record:
      self.times.append(time.perf_counter() - t0)

  def row(self):
    mem = self.mem
    return dict(
        name=self.name, n=sum(p.size for p in jax.tree.leaves(self.params)),
        median=statistics.median(self.times), state_total=nbytes(self.state),
        state_dev=nbytes(self.state, "device"),
        dev_mem=None if mem is None else mem.argument_size_in_bytes + mem.temp_size_in_bytes,
        host_arg=None if mem is None else getattr(mem, "host_argument_size_in_bytes", None))


def mib(b):
  return "n/a" if b is None else f"{b / 2**20:,.0f}"


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--width", type=int, default=5120)
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--batch", type=int, default=16)
  ap.add_argument("--steps", type=int, default=5)
  ap.add_argument("--chunk-bytes", type=int, default=0,
                  help="also time mode='state' streamed in calls of this many bytes of state "
                       "(ak.offload's chunk_bytes; 0: no such row)")
  a = ap.parse_args()

  def adam():
    return ak.adam(1e-3)

  cases = [("no offload", adam()),
           ("offload mode='state'", ak.offload(adam(), mode="state")),
           ("offload mode='compute'", ak.offload(adam(), mode="compute"))]
  streamed = f"offload mode='state' chunk_bytes={a.chunk_bytes}"
  if a.chunk_bytes:
    cases.append((streamed, ak.offload(adam(), mode="state", chunk_bytes=a.chunk_bytes)))
    cases.append((streamed + ", step",
                  ak.offload(adam(), mode="state", chunk_bytes=a.chunk_bytes)))
  cases = [Case(name, tx, a.width, a.layers, a.batch, one_pass=name.endswith(", step"))
           for name, tx in cases]
  for c in cases:  # warm-up: first touch of every buffer
    c.step(record=False)
    c.step(record=False)
  for _ in range(a.steps):  # interleaved, so drifts in machine load hit every mode alike
    for c in cases:
      c.step()
  rows = [c.row() for c in cases]
  n = rows[0]["n"]
  moved = {"no offload": 0, "offload mode='state'": 32 * n, "offload mode='compute'": 8 * n,
           streamed: 32 * n, streamed + ", step": 32 * n}
  base = rows[0]["median"]
  dev = jax.devices()[0]
  print(f"\nak.offload benchmark: {n / 1e6:.1f}M float32 params, ak.adam, batch {a.batch}, "
        f"median of {a.steps} donated jitted steps; backend {dev.platform} "
        f"({dev.device_kind}), jax {jax.__version__}\n")
  head = ("mode", "step ms", "x no-offload", "state MiB (device)", "state MiB (total)",
          "compiled device MiB", "compiled host-arg MiB", "H<->D MiB/step")
  lines = [head]
  for r in rows:
    lines.append((r["name"], f"{r['median'] * 1e3:,.1f}", f"{r['median'] / base:.2f}",
                  mib(r["state_dev"]), mib(r["state_total"]), mib(r["dev_mem"]),
                  mib(r["host_arg"]), mib(moved[r["name"]])))
  widths = [max(len(str(line[i])) for line in lines) for i in range(len(head))]
  for i, line in enumerate(lines):
    print(" | ".join(str(c).rjust(w) if j else str(c).ljust(w)
                     for j, (c, w) in enumerate(zip(line, widths))))
    if i == 0:
      print("-+-".join("-" * w for w in widths))
  if dev.platform == "cpu":
    print("\nCPU: 'device' and 'pinned_host' are the same RAM; memory_analysis() files every "
          "buffer under device (host columns 0), so the device-resident state bytes above "
          "come from the state leaves' shardings. Step-time ratios measure the cost of the "
          "extra copies and host-annotated computation, not of a PCIe link.")
  print("H<->D per step: 'state' moves mu and nu down and up (32 B/param); 'compute' moves "
        "the gradient down and the update up (8 B/param; 12 if the optimizer reads params, "
        "e.g. weight decay).")


if __name__ == "__main__":
  main()
