"""How the CPU kernels are compiled: used by ``adamkit._kernels.build_cpu_kernel`` and
by the install-time build hook (``hatch_build.py``), which loads this file by path. Standard
library only, so the build environment needs no adamkit dependency but jax's headers."""

from __future__ import annotations

import os


def compile_command(source: str, output: str, include_dir: str,
                    cxx: str | None = None) -> list[str]:
  """The compiler invocation for ``source`` -> shared library ``output``.

  -fno-math-errno lets the compiler vectorize sqrt; no -ffast-math and no FMA contraction,
  so each operation rounds as XLA's does. -march stays at the platform default so the
  library runs on any machine of the architecture.
  """
  return [cxx or os.environ.get("CXX", "c++"), "-O3", "-std=c++17", "-shared", "-fPIC",
          "-fno-math-errno", "-ffp-contract=off", "-w", f"-I{include_dir}", str(source),
          "-o", str(output)]
