"""How the CPU kernels are compiled.

Used by :func:`build_cpu_kernel` (``python -m adamkit._kernels``) and by the install-time
build hook (``hatch_build.py``), which loads this file by path: standard library only at
import, so the build environment needs no adamkit dependency but jax's headers.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

SOURCE = pathlib.Path(__file__).parent / "adam_kernels.cc"


def library_name(jaxlib_version: str) -> str:
  """The library's file name for a jaxlib version: a kernel compiled against one jaxlib's
  XLA FFI headers may not register with another's (jaxlib 0.12 refuses handlers built for
  0.10), so two environments of other JAX versions can share one checkout, each loading its
  own build."""
  return f"libadamkit_cpu-jaxlib{jaxlib_version}.so"

# -fsanitize flags of the sanitizer build (tests/test_sanitizer.py): every out-of-bounds
# access and undefined operation in a kernel aborts with a report.
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all",
            "-fno-omit-frame-pointer", "-g"]


def compile_command(source: str | os.PathLike, output: str | os.PathLike, include_dir: str,
                    cxx: str | None = None, *, sanitize: bool = False) -> list[str]:
  """The compiler invocation for ``source`` -> shared library ``output``.

  -fno-math-errno lets the compiler vectorize sqrt; no -ffast-math and no FMA contraction,
  so each operation rounds as XLA's does. -march stays at the platform default so the
  library runs on any machine of the architecture. ``sanitize``: an AddressSanitizer and
  UndefinedBehaviorSanitizer build (-O1, for tests).
  """
  opt = ["-O1", *SANITIZE] if sanitize else ["-O3"]
  return [cxx or os.environ.get("CXX", "c++"), *opt, "-std=c++17", "-shared", "-fPIC",
          "-fno-math-errno", "-ffp-contract=off", "-w", f"-I{include_dir}", str(source),
          "-o", str(output)]


def build_cpu_kernel(output: str | os.PathLike | None = None, *, compiler: str | None = None,
                     verbose: bool = False, sanitize: bool = False) -> pathlib.Path:
  """The compiler run behind :func:`adamkit.build_cpu_kernel` (see it for what is built
  and when), plus ``sanitize`` for the sanitizer test.

  Args:
    output: where to write the library (default: where it is looked for, see
      ``ADAMKIT_CPU_KERNEL``).
    compiler: the C++ compiler (default ``$CXX`` or ``c++``).
    verbose: print the command.
    sanitize: build with AddressSanitizer and UBSan (for tests; load it with libasan
      preloaded).

  Returns:
    The library's path.

  Raises:
    RuntimeError: no compiler, or compiling failed.
  """
  import jax  # noqa: PLC0415 - only here: the build hook loads this module without jax

  from adamkit._cpu import load  # noqa: PLC0415

  out = pathlib.Path(output) if output else load.kernel_path()
  cmd = compile_command(SOURCE, out, jax.ffi.include_dir(), compiler, sanitize=sanitize)
  if verbose:
    print(" ".join(cmd), file=sys.stderr)
  try:
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
  except OSError as e:
    raise RuntimeError(f"No C++ compiler ({cmd[0]!r}): {e}") from e
  if done.returncode != 0:
    raise RuntimeError(f"Compiling the adamkit CPU kernel failed:\n{done.stderr}")
  load.forget(out)
  return out
