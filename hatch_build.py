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
(``adamkit/_cpu/libadamkit_cpu-jaxlib<version>.so``, ignored by git), where the package looks for it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import pathlib
import subprocess
import sys

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

SOURCE = pathlib.Path("adamkit") / "_cpu" / "adam_kernels.cc"


def _build_module(root: pathlib.Path):
  """adamkit/_cpu/build.py, loaded by path: importing the package would need optax."""
  spec = importlib.util.spec_from_file_location("_adamkit_cpu_build",
                                                root / "adamkit" / "_cpu" / "build.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def compile_kernel(root: pathlib.Path) -> tuple[pathlib.Path | None, str | None]:
  """Compiles the kernel in place; returns ``(library, None)``, or ``(None, the reason it
  was not built)``. The library's name carries the build environment's jaxlib version."""
  if os.environ.get("ADAMKIT_NO_KERNEL"):
    return None, "ADAMKIT_NO_KERNEL is set"
  try:
    import jax  # noqa: PLC0415 - only the build environment needs it
    include = jax.ffi.include_dir()
    jaxlib = importlib.metadata.version("jaxlib")
  except Exception as e:  # noqa: BLE001 - any failure means: no kernel
    return None, f"jax (for the XLA FFI headers) is not importable: {e}"
  build = _build_module(root)
  library = pathlib.Path("adamkit") / "_cpu" / build.library_name(jaxlib)
  cmd = build.compile_command(root / SOURCE, root / library, include)
  try:
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
  except OSError as e:
    return None, f"no C++ compiler: {e}"
  if done.returncode != 0:
    return None, f"compiling failed:\n{done.stderr[-2000:]}"
  return library, None


class CustomBuildHook(BuildHookInterface):
  def initialize(self, version, build_data):
    root = pathlib.Path(self.root)
    library, why = compile_kernel(root)
    if why is not None:
      print(f"adamkit: building without the CPU kernel ({why}); "
            "ak.fused_adam will use its pure-JAX path.", file=sys.stderr)
      return
    # A compiled library makes the wheel platform-specific.
    build_data["pure_python"] = False
    build_data["infer_tag"] = True
    build_data["force_include"][str(root / library)] = str(library)
