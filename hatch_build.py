"""Hatch build hook: compiles adamkit's CPU kernels when the wheel is built.

Enabled from pyproject.toml with::

  [build-system]
  requires = ["hatchling>=1.18", "jax>=0.10"]   # jaxlib ships the XLA FFI headers

  [tool.hatch.build.targets.wheel.hooks.custom]
  path = "hatch_build.py"

The kernel is optional: without a C++ compiler (or with ``ADAMKIT_NO_KERNEL=1``) the hook
prints why and builds a pure-Python wheel, and every adamkit operation uses its pure-JAX
path.
For an editable install the library is written next to its source
(``adamkit/_cpu/libadamkit_cpu.so``, ignored by git), where the package looks for it.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

SOURCE = pathlib.Path("adamkit") / "_cpu" / "adam_kernels.cc"
LIBRARY = pathlib.Path("adamkit") / "_cpu" / "libadamkit_cpu.so"


def _build_module(root: pathlib.Path):
  """adamkit/_cpu/build.py, loaded by path: importing the package would need optax."""
  spec = importlib.util.spec_from_file_location("_adamkit_cpu_build",
                                                root / "adamkit" / "_cpu" / "build.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def compile_kernel(root: pathlib.Path) -> str | None:
  """Compiles the kernel in place; returns None, or the reason it was not built."""
  if os.environ.get("ADAMKIT_NO_KERNEL"):
    return "ADAMKIT_NO_KERNEL is set"
  try:
    import jax  # noqa: PLC0415 - only the build environment needs it
    include = jax.ffi.include_dir()
  except Exception as e:  # noqa: BLE001 - any failure means: no kernel
    return f"jax (for the XLA FFI headers) is not importable: {e}"
  cmd = _build_module(root).compile_command(root / SOURCE, root / LIBRARY, include)
  try:
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
  except OSError as e:
    return f"no C++ compiler: {e}"
  if done.returncode != 0:
    return f"compiling failed:\n{done.stderr[-2000:]}"
  return None


class CustomBuildHook(BuildHookInterface):
  def initialize(self, version, build_data):
    root = pathlib.Path(self.root)
    why = compile_kernel(root)
    if why is not None:
      print(f"adamkit: building without the CPU kernel ({why}); "
            "ak.fused_adam will use its pure-JAX path.", file=sys.stderr)
      return
    # A compiled library makes the wheel platform-specific.
    build_data["pure_python"] = False
    build_data["infer_tag"] = True
    build_data["force_include"][str(root / LIBRARY)] = str(LIBRARY)
