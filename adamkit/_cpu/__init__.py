"""adamkit's native CPU backend: C++ kernels called through ``jax.ffi``.

Three modules, one job each:

* :mod:`adamkit._cpu.build`: how ``adam_kernels.cc`` is compiled (standard library only at
  import, so the install-time hook ``hatch_build.py`` can load it by path);
* :mod:`adamkit._cpu.load`: where the shared library is looked for, loading it and
  registering its handlers with XLA's CPU platform (once, thread-safe);
* :mod:`adamkit._cpu.ffi`: the calling convention of each kernel (operands, attributes,
  the nine float32 scalars) and the checks of every buffer against its own shape.

Nothing above :mod:`adamkit._backend` imports this package, and ``_backend`` imports it
only where it exists: deleting ``adamkit/_cpu/`` leaves a working pure-JAX library.
"""
