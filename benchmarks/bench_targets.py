"""Device memory and XLA's memory traffic of the quantized steps on TPU and GPU targets,
compiled without the hardware (deviceless ahead-of-time compiles, ``adamkit._targets``).

    JAX_PLATFORMS=cpu ALLOW_MULTIPLE_LIBTPU_LOAD=1 python benchmarks/bench_targets.py
    ... bench_targets.py --targets v5e:1x1 --trees leaf --configs "ak.adamw 8bit,ak.adamw 4bit"

Needs ``jax[tpu]`` (TPU targets) and ``jax-cuda13-plugin`` with a CUDA 13 toolkit (``h100``).
Each row is one step (update + ``optax.apply_updates``, params and state donated, as users
jit it) of a float32 model: a single 4096 x 4096 leaf (16.8M parameters) or a
transformer-shaped tree (~23M parameters, leaves of many sizes, norms under
``min_size``), FSDP-sharded over a multi-device target. Per device, in bytes per parameter
of the model (all devices together): the state, XLA's temporaries (the issue's bound: 0.25)
and the peak (arguments + outputs - donated + temporaries); and XLA's estimate of the bytes
accessed (TPU only), against ``optax.adamw`` float32 on the same target (the bound: 2x).
These are compile-time figures, not measurements on a device.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from accelerator import CONTENDERS
from common import table, write_json

import adamkit as ak
from adamkit import _targets

# The device benchmark's contenders (one list), their float32 rows: these figures are for a
# float32 model
CONFIGS = {name: factory for name, (factory, dtype) in CONTENDERS.items()
           if dtype == jnp.float32 and not name.startswith("offload")}
BASE = "optax.adamw f32"


def leaf_tree() -> dict:
  return {"w": jax.ShapeDtypeStruct((4096, 4096), jnp.float32)}


TREES = {"leaf": leaf_tree, "transformer": _targets.transformer_shapes}


def row(target: str, tree: str, config: str, base: float | None) -> tuple[list, dict]:
  t = time.perf_counter()
  r = ak.memory_report(CONFIGS[config](), TREES[tree](), target)
  f = r.step
  ba = f.bytes_accessed
  ratio = ba / base if ba is not None and base else None
  fmt = lambda x: "-" if x is None else x  # noqa: E731
  cells = [target, tree, config, r.per_param(r.state_bytes), r.per_param(f.temporaries),
           r.per_param(f.peak), fmt(None if ba is None else ba / 2**20), fmt(ratio),
           time.perf_counter() - t]
  raw = {"target": target, "tree": tree, "config": config, "params": r.params,
         "devices": r.devices, "state": r.state_bytes, "temporaries": f.temporaries,
         "peak": f.peak, "bytes_accessed": ba}
  return cells, raw


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--targets", default="v5e:1x1,v5e:2x2,h100")
  parser.add_argument("--trees", default="leaf,transformer")
  parser.add_argument("--configs", default=",".join(CONFIGS))
  args = parser.parse_args(argv)
  configs = args.configs.split(",")
  rows, raws = [], []
  for target in args.targets.split(","):
    for tree in args.trees.split(","):
      base = None
      for config in [BASE] + [c for c in configs if c != BASE]:
        if config == BASE:
          base = row(target, tree, config, None)[1]["bytes_accessed"]
          if BASE not in configs:
            continue
        cells, raw = row(target, tree, config, base)
        rows.append(cells)
        raws.append(raw)
        print(" ".join(str(c) for c in cells), flush=True)
  print(table("deviceless step figures per device (B/param: bytes per parameter of the model)",
              ["target", "tree", "step", "state B/param", "temp B/param", "peak B/param",
               "bytes accessed MiB", "vs optax f32", "compile s"], rows))
  write_json("targets", {"rows": raws})


if __name__ == "__main__":
  main()
