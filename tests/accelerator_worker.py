"""Compiles adamkit steps for TPU, GPU and CPU targets in a process with ONE CPU device.

``tests/test_accelerator.py`` runs this in a fresh interpreter: the suite's own process has
8 CPU devices, where a traced step never takes the CPU kernel, so it could not show the
backend rule's case that matters, a one-CPU process tracing a step whose platform is only
known when it is lowered (``adamkit/_backend.py``, rule 5). Here the same registry factory is
compiled for each target and the CPU kernels must appear on "cpu" only.

Usage: ``python accelerator_worker.py JOBS.json OUT.json``; a job is ``[what, name, tree,
target]`` (``what``: "registry" for ``tests/registry.py``'s entries, "format" for
:data:`FORMATS`, "offload" for a format's ``ak.offload``, named as :func:`offloaded`
says); the output maps each job (joined by "|") to its figures, its CPU custom calls, its
state's bytes and its compile's seconds, or to ``{"skip": why}`` / ``{"error": why}``.
"""

import os

if __name__ == "__main__":  # not when the tests import FORMATS: their subprocesses inherit
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ["XLA_FLAGS"] = " ".join(
      f for f in os.environ.get("XLA_FLAGS", "").split()
      if "xla_force_host_platform_device_count" not in f)
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import dataclasses  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import adamkit as ak  # noqa: E402
from adamkit import _targets  # noqa: E402


def shapes(tree, dtype=jnp.float32):
  return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, dtype), tree,
                      is_leaf=lambda x: isinstance(x, tuple))


# The registry's names (conv, bn: the groups' and masks' patterns) on leaves that a 4-device
# mesh can split, a table for the sparse entries, and odd sizes (padded blocks).
SMALL = {"conv": {"kernel": (3, 3, 8, 16), "bias": (16,)},
         "dense": {"kernel": (64, 192), "bias": (192,)},
         "bn": {"gamma": (64,), "beta": (64,)}, "embed": (512, 64), "odd": (7, 5)}
LEAF = {"w": (4096, 4096)}  # 16.8M parameters in one leaf
RAGGED = {"w": (4096, 4000)}  # rows that are no whole number of blocks (contiguous chunks)

Q8 = dict(mu_dtype="8bit", nu_dtype="8bit")
FORMATS = {  # name -> (factory, param dtype); "optax": the reference step
    "optax": (lambda: optax.adamw(1e-3), jnp.float32),
    "float32": (lambda: ak.adamw(1e-3), jnp.float32),
    "8bit": (lambda: ak.adamw(1e-3, **Q8), jnp.float32),
    "4bit": (lambda: ak.adamw(1e-3, mu_dtype="4bit", nu_dtype="4bit"), jnp.float32),
    "fp8": (lambda: ak.adamw(1e-3, mu_dtype="fp8", nu_dtype="fp8"), jnp.float32),
    "bf16": (lambda: ak.adamw(1e-3), jnp.bfloat16),
    "bf16_8bit": (lambda: ak.adamw(1e-3, **Q8), jnp.bfloat16),
    "bf16_stochastic": (lambda: ak.param_rounding(ak.adamw(1e-3), "stochastic"), jnp.bfloat16),
    "bf16_kahan": (lambda: ak.param_rounding(ak.adamw(1e-3), "kahan"), jnp.bfloat16),
    "bf16_stochastic_8bit": (lambda: ak.param_rounding(ak.adamw(1e-3, **Q8), "stochastic"),
                             jnp.bfloat16),
    "bf16_nearest_8bit": (lambda: ak.param_rounding(ak.adamw(1e-3, **Q8), "nearest"),
                          jnp.bfloat16),
    "bf16_kahan_8bit": (lambda: ak.param_rounding(ak.adamw(1e-3, **Q8), "kahan"), jnp.bfloat16),
    "fused_8bit": (lambda: ak.fused_adamw(1e-3, **Q8), jnp.float32),
    "fused_8bit_per_leaf": (lambda: ak.fused_adamw(1e-3, multi_tensor=False, **Q8), jnp.float32),
}


def tree(which: str, dtype) -> dict:
  if which == "transformer":
    return _targets.transformer_shapes(dtype=dtype)
  return shapes({"small": SMALL, "leaf": LEAF, "ragged": RAGGED}[which], dtype)


def offloaded(name: str) -> tuple:
  """``"FORMAT:CHUNK_BYTES"`` (``"none"``: None) in ``mode="state"``, or
  ``"FORMAT:compute"`` (``"compute-none"``: unstreamed): the format's ``ak.offload`` (its
  one-pass ``step`` is what compiles); with a ``":update"`` suffix its optax form,
  ``update`` + ``optax.apply_updates``."""
  fmt, chunk, *form = name.split(":")
  factory, dtype = FORMATS[fmt]
  mode = "compute" if chunk.startswith("compute") else "state"
  chunk = chunk.removeprefix("compute").removeprefix("-") or "auto"
  chunk_bytes = None if chunk == "none" else chunk if chunk == "auto" else int(chunk)
  tx = ak.offload(factory(), mode=mode, chunk_bytes=chunk_bytes)
  if form == ["update"]:
    tx = optax.GradientTransformationExtraArgs(tx.init, tx.update)
  return tx, dtype


def compile_job(what: str, name: str, which: str, target: str) -> dict:
  if what == "registry":
    from registry import REGISTRY  # noqa: PLC0415 - tests/ is on the path only here
    tx, dtype = REGISTRY[name](1e-3), jnp.float32
  elif what == "offload":
    tx, dtype = offloaded(name)
  else:
    factory, dtype = FORMATS[name]
    tx = factory()
  params = tree(which, dtype)
  compiled, abstract_params, state = _targets.compile_step(tx, params, target)
  return dict(figures=dataclasses.asdict(_targets.figures(compiled)),
              cpu_kernels=[c for c in _targets.custom_calls(compiled)
                           if c.startswith("adamkit_cpu")],
              devices=len(_targets.devices(target)), params=_targets.params_count(params),
              params_bytes=_targets.per_device_bytes(abstract_params),
              state_bytes=_targets.per_device_bytes(state),
              state_host_bytes=_targets.host_bytes(state))


def main(jobs_file: str, out_file: str) -> None:
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  assert len(jax.devices("cpu")) == 1, jax.devices("cpu")
  out = {}
  for job in json.load(open(jobs_file)):
    try:
      _targets.devices(job[3])
    except RuntimeError as e:  # the target's package is missing: the test skips, saying so
      out["|".join(job)] = {"skip": str(e)}
      continue
    start = time.perf_counter()
    try:
      out["|".join(job)] = compile_job(*job)
      out["|".join(job)]["seconds"] = round(time.perf_counter() - start, 2)
    except Exception as e:  # noqa: BLE001 - reported to the test, which fails with it
      out["|".join(job)] = {"error": f"{type(e).__name__}: {e}"}
  json.dump(out, open(out_file, "w"))


if __name__ == "__main__":
  main(*sys.argv[1:])
