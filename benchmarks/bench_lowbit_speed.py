"""Low-bit optimizer states, section "speed": one AdamW step on 16M parameters, on CPU.

One float32 leaf of 4096 x 4096, AdamW (lr 1e-3, betas 0.9/0.999, eps 1e-8, weight decay
0.01 on every parameter), gradients fixed. Rows, interleaved in a shuffled order per round
(see common.py) and reported as medians:

* ``ak.fused_adamw`` with 8-bit moments on its C++ kernel (dequantize, update, requantize
  in one pass per block of 256: read p, g and the 1-byte codes, write p and the codes, 16
  bytes per parameter) and in float32 (28 bytes);
* ``torch.optim.AdamW(fused=True)`` in float32, the reference of the ratios, and
  ``(foreach=True)``;
* ``optax.adamw`` in float32 and the chain form ``ak.adamw(mu_dtype="8bit",
  nu_dtype="8bit")`` with ``optax.apply_updates``: its direction computed by XLA from the
  old codes (fused into the parameter add), its new codes by the C++ kernel
  (``adamkit_cpu_requantize``, one pass); ``--chain-xla`` adds the same chain with the new
  codes by XLA's chunked loop (what runs without the kernel or on several devices);
* torchao ``AdamW8bit`` and bitsandbytes ``AdamW8bit``, on CPU (the ``bench`` extra).

Every JAX step is jitted with params and state donated, ``block_until_ready`` inside the
timing; ``optax.adamw`` and the chain form run again with the params donated and the state
not. The chain form is faster that way: with the state donated, its new codes must land in
the old codes' buffers while the direction (fused into ``apply_updates``, which ``update``
cannot order before the kernel) still reads them, so XLA first copies the old codes into a
temporary buffer, which on CPU is mapped afresh (page-faulted) at every call. Without the
state donated, the new codes go to fresh output buffers and nothing is copied; optax's
float32 state, which XLA updates in place when donated, goes the other way. The machine
is shared: the absolute times move with its load, the interleaved ratios much less; run
with enough repeats.

Memory of the chain form (printed after the table): the persistent state in bytes per
parameter, and the XLA temporaries of the jitted update + apply_updates
(``compiled.memory_analysis().temp_size_in_bytes``) per parameter, with the params
donated (the new codes are then the outputs) and with params and state donated (XLA
copies the old codes, which the direction still reads while the new ones are written).

  python benchmarks/bench_lowbit_speed.py              # 15 rounds
  python benchmarks/bench_lowbit_speed.py --reps 30 --no-anchors   # without torchao / bnb
  python benchmarks/bench_lowbit_speed.py --xla        # adds the fused 8-bit step on XLA
  python benchmarks/bench_lowbit_speed.py --chain-xla  # adds the chain form without the kernel
  python benchmarks/bench_lowbit_speed.py --huge-pages # every contender's buffers on 2 MiB pages

``--huge-pages`` runs the whole benchmark in a process whose heap hands out 2 MiB
pages (``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``: glibc's malloc advises transparent huge
pages for its large blocks; Linux with transparent huge pages in ``madvise`` or
``always`` mode). XLA's CPU buffers and torch's tensors come from that heap alike, so every
row, the reference's included, runs on the same pages.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import warnings
from unittest import mock

# torch's OpenMP workers otherwise spin after each step and steal the two cores from the
# next contender's threads (see bench_dense.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402

import adamkit as ak  # noqa: E402
from adamkit import _quant_ops  # noqa: E402

try:
  import torch  # noqa: E402
except ImportError:  # optional: the `bench` extra
  torch = None

LR, B1, B2, EPS, WD = 1e-3, 0.9, 0.999, 1e-8, 0.01
SHAPE = (4096, 4096)
REFERENCE = "torch AdamW fused f32"


def jax_runner(step, params, state, grads, kernel=True, donate=(0, 1)):
  """``step`` jitted with params and state donated (``donate=(0,)``: params only;
  ``kernel=False``: compiled with the chain form's kernel turned off, its XLA loop
  instead)."""
  params = jax.tree.map(jnp.copy, params)
  fn = jax.jit(step, donate_argnums=donate)
  if not kernel:
    with mock.patch.object(_quant_ops, "_on_kernel", lambda *a: False):
      fn = fn.lower(params, state, grads).compile()
  return common.stateful_runner(fn, (params, state), (grads,))


def fused_runner(opt, params, grads):
  p = jax.tree.map(jnp.copy, params)
  return jax_runner(lambda p, s, g: opt.step(p, s, grads=g), p, opt.init(p), grads)


def optax_step(tx):
  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s
  return step


def optax_runner(tx, params, grads, kernel=True, donate=(0, 1)):
  p = jax.tree.map(jnp.copy, params)
  return jax_runner(optax_step(tx), p, tx.init(p), grads, kernel, donate)


def chain_memory(tx, params) -> dict:
  """Bytes per parameter of ``tx``'s state, and of the XLA temporaries of its jitted update
  + apply_updates, params donated / params and state donated."""
  return step_memory(tx.init, optax_step(tx), params)


def fused_memory(opt, params) -> dict:
  """:func:`chain_memory` of a fused step's jitted ``step``."""
  return step_memory(opt.init, lambda p, s, g: opt.step(p, s, grads=g), params)


def step_memory(init, step, params) -> dict:
  shapes = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)
  state = jax.eval_shape(init, shapes)
  n = sum(p.size for p in jax.tree.leaves(params))
  out = {"state": sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state)) / n}
  for name, donate in (("temp, params donated", (0,)), ("temp, params and state donated", (0, 1))):
    compiled = jax.jit(step, donate_argnums=donate).lower(shapes, state, shapes).compile()
    out[name] = compiled.memory_analysis().temp_size_in_bytes / n
  return out


def torch_runner(make_opt):
  gen = torch.Generator().manual_seed(0)
  p = torch.nn.Parameter(torch.randn(SHAPE, generator=gen))
  p.grad = 0.1 * torch.randn(SHAPE, generator=gen)
  opt = make_opt([p])

  def run():
    t = time.perf_counter()
    opt.step()
    return time.perf_counter() - t
  return run


def anchors() -> dict:
  """torchao's and bitsandbytes' AdamW8bit where they import (the `bench` extra)."""
  makers = {}
  try:
    from torchao.optim import AdamW8bit as AoAdamW8bit  # noqa: PLC0415
    makers["torchao AdamW8bit"] = lambda ps: AoAdamW8bit(ps, lr=LR, betas=(B1, B2), eps=EPS,
                                                         weight_decay=WD)
  except ImportError as e:
    print(f"(torchao row skipped: {e})")
  try:
    import bitsandbytes as bnb  # noqa: PLC0415
    makers["bitsandbytes AdamW8bit"] = lambda ps: bnb.optim.AdamW8bit(
        ps, lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD)
  except ImportError as e:
    print(f"(bitsandbytes row skipped: {e})")
  return makers


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--reps", type=int, default=15)
  ap.add_argument("--no-anchors", action="store_true", help="skip torchao and bitsandbytes")
  ap.add_argument("--xla", action="store_true", help="add the fused 8-bit step on XLA")
  ap.add_argument("--chain-xla", action="store_true",
                  help="add the chain form with its new codes by XLA's loop (no kernel)")
  ap.add_argument("--huge-pages", action="store_true",
                  help="run with glibc's malloc on 2 MiB pages (every contender alike)")
  args = ap.parse_args()
  huge = "glibc.malloc.hugetlb=1" in os.environ.get("GLIBC_TUNABLES", "")
  if args.huge_pages and not huge:
    thp = "/sys/kernel/mm/transparent_hugepage/enabled"
    if not os.path.exists(thp) or "[never]" in open(thp).read():
      sys.exit("--huge-pages: this machine has no transparent huge pages (" + thp + ")")
    env = dict(os.environ, GLIBC_TUNABLES="glibc.malloc.hugetlb=1")
    # glibc reads its tunables at start: this process becomes one started with them
    os.execve(sys.executable, [sys.executable, *sys.argv], env)
  if not ak.cpu_kernel_available():
    ak.build_cpu_kernel()

  key = jax.random.key(0)
  params = {"w": jax.random.normal(key, SHAPE, jnp.float32)}
  grads = {"w": 0.1 * jax.random.normal(jax.random.fold_in(key, 1), SHAPE, jnp.float32)}
  fused = lambda **kw: ak.fused_adamw(LR, B1, B2, EPS, weight_decay=WD, weight_decay_mask=None,
                                      **kw)
  runners = {
      "ak.fused_adamw 8bit (kernel)": fused_runner(
          fused(mu_dtype="8bit", nu_dtype="8bit", backend="kernel"), params, grads),
      "ak.fused_adamw f32 (kernel)": fused_runner(fused(backend="kernel"), params, grads),
      "optax.adamw f32": optax_runner(optax.adamw(LR, B1, B2, EPS, weight_decay=WD), params, grads),
  }
  if args.xla:
    runners["ak.fused_adamw 8bit (pure JAX)"] = fused_runner(
        fused(mu_dtype="8bit", nu_dtype="8bit", backend="xla"), params, grads)
  notes = []
  chain = ak.adamw(LR, B1, B2, EPS, weight_decay=WD, weight_decay_mask=None,
                   mu_dtype="8bit", nu_dtype="8bit")
  runners['ak.adamw(mu_dtype="8bit", nu_dtype="8bit") chain'] = optax_runner(chain, params, grads)
  # The same two steps with the params donated and the state not: XLA then writes the new
  # state into fresh buffers (optax: 8 bytes per parameter; the chain: its new codes, 2),
  # and the chain's direction reads the old codes where they are (no copy, see the docstring)
  runners["optax.adamw f32, state not donated"] = optax_runner(
      optax.adamw(LR, B1, B2, EPS, weight_decay=WD), params, grads, donate=(0,))
  runners["ak.adamw 8bit chain, state not donated"] = optax_runner(chain, params, grads,
                                                                   donate=(0,))
  if args.chain_xla:
    runners["ak.adamw 8bit chain, XLA loop (no kernel)"] = optax_runner(chain, params, grads,
                                                                        kernel=False)
  if torch is not None:
    runners[REFERENCE] = torch_runner(lambda ps: torch.optim.AdamW(
        ps, lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD, fused=True))
    runners["torch AdamW foreach f32"] = torch_runner(lambda ps: torch.optim.AdamW(
        ps, lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD, foreach=True))
    if not args.no_anchors:
      with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, make in anchors().items():
          runners[name] = torch_runner(make)
  else:
    notes.append("torch not installed: its rows and the anchors skipped")

  cpu = {k: [] for k in runners}
  runners = {k: common.with_cpu_time(run, cpu[k]) for k, run in runners.items()}
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    times = common.interleave(runners, args.reps, warmup=3, shuffle=True)
  del runners
  gc.collect()
  med = {k: common.median_ms(v) for k, v in times.items()}
  med_cpu = {k: common.median_ms(v[-args.reps:]) for k, v in cpu.items()}
  ref, ref_cpu = med.get(REFERENCE), med_cpu.get(REFERENCE)
  base = med["optax.adamw f32"]
  rows = [[name, ms, ms / ref if ref else "-", ms / base, med_cpu[name],
           med_cpu[name] / ref_cpu if ref_cpu else "-"] for name, ms in med.items()]
  pages = ", 2 MiB pages (glibc.malloc.hugetlb=1)" if huge else ""
  print(common.table(f"AdamW step, {SHAPE[0]}x{SHAPE[1]} = 16.8M float32 parameters, "
                     f"median of {args.reps} interleaved rounds{pages}",
                     ["contender", "ms", f"x {REFERENCE}", "x optax.adamw f32", "CPU ms",
                      "CPU x torch fused"], rows))
  for note in notes:
    print(f"\n({note})")
  memory = chain_memory(chain, params)
  print("\nak.adamw 8-bit chain form, bytes per parameter: " +
        ", ".join(f"{k} {v:.3g}" for k, v in memory.items()))
  # The fused step where the kernel does not run (other devices, several devices, 4-bit):
  # XLA's loop over chunks, each overwritten in place (multi-tensor buffer and per leaf).
  fused_xla = {}
  for kind in ("8bit", "4bit"):
    for multi_tensor in (True, False):
      name = f"{kind}, multi_tensor={multi_tensor}"
      fused_xla[name] = fused_memory(ak.fused_adamw(
          LR, B1, B2, EPS, weight_decay=WD, weight_decay_mask=None, mu_dtype=kind,
          nu_dtype=kind, multi_tensor=multi_tensor, backend="xla"), params)
      print(f"ak.fused_adamw {name}, XLA path, bytes per parameter: " +
            ", ".join(f"{k} {v:.3g}" for k, v in fused_xla[name].items()))
  # bf16 params without a master copy and quantized moments: the one-pass forms
  bf16 = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
  for method in ("kahan", "stochastic"):
    for kind in ("8bit", "4bit"):
      name = f"bf16 params, {method}, {kind}"
      opt_kw = dict(weight_decay=WD, weight_decay_mask=None, mu_dtype=kind, nu_dtype=kind)
      fused_xla[name + ", chain"] = chain_memory(
          ak.param_rounding(ak.adamw(LR, B1, B2, EPS, **opt_kw), method), bf16)
      fused_xla[name + ", fused"] = fused_memory(
          ak.fused_adamw(LR, B1, B2, EPS, param_rounding=method, **opt_kw), bf16)
      for form in ("chain", "fused"):
        print(f"{name}, {form} form, bytes per parameter: " +
              ", ".join(f"{k} {v:.3g}" for k, v in fused_xla[f"{name}, {form}"].items()))
  print(f"load average (1, 5, 15 min): {os.getloadavg()}")
  path = common.write_json("bench_lowbit_speed" + ("_huge_pages" if huge else ""), {
      "shape": SHAPE, "reps": args.reps, "median_ms": med, "median_cpu_ms": med_cpu,
      "samples_s": times, "notes": notes, "chain_bytes_per_param": memory,
      "fused_xla_bytes_per_param": fused_xla, "huge_pages": huge,
      "load_average": os.getloadavg()})
  print(f"\nwritten: {path}")


if __name__ == "__main__":
  main()
