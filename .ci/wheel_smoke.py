"""Run by .ci/run inside a fresh virtual environment where only the built wheel provides
adamkit: ``python wheel_smoke.py with-kernel|without-kernel``. Checks that the installed
package (not the checkout) imports, carries its data and type marker, trains, and has the
CPU kernel exactly when the wheel was built with a C++ compiler."""

import sys
import sysconfig
from importlib.resources import files

import jax
import jax.numpy as jnp
import optax

import adamkit as ak

expect_kernel = {"with-kernel": True, "without-kernel": False}[sys.argv[1]]
where = files("adamkit")
assert str(where).startswith(sysconfig.get_paths()["purelib"]) or \
    str(where).startswith(sysconfig.get_paths()["platlib"]), f"adamkit imported from {where}"
assert (where / "py.typed").is_file()
assert (where / "_data" / "ms_adam_weight_decay.npz").is_file()
has_library = any(f.name.startswith("libadamkit_cpu") and f.name.endswith(".so")
                  for f in (where / "_cpu").iterdir())
assert has_library == expect_kernel, f"kernel library shipped: {has_library}"
available = getattr(ak, "cpu_kernel_available", lambda: has_library)()
assert available == expect_kernel, f"cpu kernel available: {available}"

params = {"w": jnp.array([1.0, -2.0, 3.0])}
grads = {"w": jnp.array([0.5, -0.5, 0.5])}
tx = ak.adam(0.1)
updates, _ = tx.update(grads, tx.init(params), params)
expected = optax.apply_updates(params, updates)
opt = ak.fused_adam(0.1)  # the kernel when shipped, plain JAX otherwise: same numbers
new, _ = jax.jit(opt.step)(params, opt.init(params), grads=grads)
assert jnp.allclose(new["w"], expected["w"], atol=1e-6), (new, expected)
print(f"wheel smoke ({sys.argv[1]}): adamkit {ak.__version__} from {where}, "
      f"kernel {'on' if available else 'off'}: ok")
