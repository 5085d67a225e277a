"""The 8-bit kernel's AVX-512 loops alone, without JAX: nanoseconds per parameter.

Compiles ``kernel_loop.cc`` (it includes ``adamkit/_cpu/adam_kernels.cc`` with the flags
the library is built with) and times the fused AdamW step's loop and the chain form's
requantize pass on one float32 leaf with 8-bit moments (block 256) in three settings: one
thread in cache (2^18 parameters), one thread and two threads from memory (2^24 parameters,
600 MiB written between steps so that every step starts with cold caches). Minimum and
median of the timed steps; ``codes`` is a hash of the codes after the run, the same for
every build of the loop that computes the same codes. This is the tool behind the loop's
figures in ``docs/low_memory.md`` ("Speed"); the comparisons with torch and optax are
``bench_lowbit_speed.py``'s. Needs a C++ compiler and a CPU with AVX-512 VBMI (else it says
so and stops).

    python benchmarks/bench_kernel_loop.py [--reps 40] [--kernel path/to/adam_kernels.cc]
"""

from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys
import tempfile

import jax
import numpy as np

from adamkit import _quant

HERE = pathlib.Path(__file__).parent
SOURCE = HERE.parent / "adamkit" / "_cpu" / "adam_kernels.cc"
SETTINGS = (  # (label, parameters, threads, flush)
    ("1 thread, in cache", 1 << 18, 1, 0),
    ("1 thread, from memory", 1 << 24, 1, 1),
    ("2 threads, from memory", 1 << 24, 2, 1),
)


def build(kernel: pathlib.Path, out: pathlib.Path) -> None:
  cmd = ["c++", "-O3", "-std=c++17", "-fno-math-errno", "-ffp-contract=off", "-w",
         f"-I{jax.ffi.include_dir()}", f'-DKERNEL_SOURCE="{kernel.resolve()}"',
         str(HERE / "kernel_loop.cc"), "-o", str(out), "-lpthread"]
  subprocess.run(cmd, check=True)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--reps", type=int, default=40, help="steps per setting (5 more untimed)")
  ap.add_argument("--kernel", type=pathlib.Path, default=SOURCE,
                  help="the kernel source to time (default: the library's)")
  args = ap.parse_args()
  with tempfile.TemporaryDirectory() as tmp:
    d = pathlib.Path(tmp)
    for role in _quant.ROLES:
      np.asarray(_quant.code_book("8bit", role), np.float32).tofile(d / f"book_{role}.bin")
      np.asarray(_quant._midpoints("8bit", role), np.float32).tofile(d / f"mid_{role}.bin")
    exe = d / "kernel_loop"
    build(args.kernel, exe)
    print(f"kernel: {args.kernel}")
    print("| loop | setting | min ns/param | median ns/param | codes |")
    print("|---|---|---|---|---|")
    for what in ("fused", "requantize"):
      for label, n, threads, flush in SETTINGS:
        reps = args.reps * 10 if n < (1 << 20) else args.reps
        out = subprocess.run([str(exe), what, str(n), str(reps + 5), str(threads), str(flush),
                              str(d)], check=True, capture_output=True, text=True).stdout
        if out.startswith("skipped"):
          print(out.strip())
          sys.exit(0)
        f = out.split()
        print(f"| {what} | {label} | {f[f.index('min') + 1]} | {f[f.index('median') + 1]} | "
              f"{f[f.index('codes') + 1]} |")


if __name__ == "__main__":
  main()
