"""Device memory and XLA's memory traffic of the quantized steps on TPU and GPU targets,
compiled without the hardware (deviceless ahead-of-time compiles, ``adamkit._targets``).

    JAX_PLATFORMS=cpu ALLOW_MULTIPLE_LIBTPU_LOAD=1 python benchmarks/bench_targets.py
    ... bench_targets.py --targets v5e:1x1 --trees leaf --configs 8bit,4bit

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
import optax
from common import table, write_json

import adamkit as ak

CONFIGS = {
    "optax f32": lambda: optax.adamw(1e-3),
    "ak f32": lambda: ak.adamw(1e-3),
    "8bit": lambda: ak.adamw(1e-3, mu_dtype="8bit", nu_dtype="8bit"),
    "4bit": lambda: ak.adamw(1e-3, mu_dtype="4bit", nu_dtype="4bit"),
    "fp8": lambda: ak.adamw(1e-3, mu_dtype="fp8", nu_dtype="fp8"),
}


def leaf_tree() -> dict:
  return {"w": jax.ShapeDtypeStruct((4096, 4096), jnp.float32)}


def transformer_tree(layers: int = 6, d: int = 512, vocab: int = 8192, mlp: int = 4) -> dict:
  """Shapes of a decoder-only transformer: embedding, per layer attention (fused qkv, out)
  and MLP weights with biases and norm gains, a final norm. 23.1M parameters by default."""
  f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
  tree = {"embed": f32(vocab, d), "final_norm": f32(d)}
  for i in range(layers):
    tree[f"layer{i}"] = {
        "norm1": f32(d), "norm2": f32(d), "qkv": f32(d, 3 * d), "qkv_b": f32(3 * d),
        "out": f32(d, d), "up": f32(d, mlp * d), "up_b": f32(mlp * d), "down": f32(mlp * d, d)}
  return tree


TREES = {"leaf": leaf_tree, "transformer": transformer_tree}


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
      for config in ["optax f32"] + [c for c in configs if c != "optax f32"]:
        if config == "optax f32":
          base = row(target, tree, config, None)[1]["bytes_accessed"]
          if "optax f32" not in configs:
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
