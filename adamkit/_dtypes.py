"""The dtype adamkit computes in. Imports nothing from adamkit, so every module can use it."""

import jax.numpy as jnp


def compute_dtype(x) -> jnp.dtype:
  """float32, or float64 for float64 leaves: low-precision leaves are computed in f32.

  Written out rather than ``jnp.promote_types``, which refuses bf16 + f32 under
  ``jax_numpy_dtype_promotion="strict"``.
  """
  dtype = jnp.dtype(x.dtype)
  if jnp.issubdtype(dtype, jnp.complexfloating):  # complex64 / complex128 compute as stored
    return dtype
  return jnp.dtype(jnp.float64) if dtype.itemsize > 4 else jnp.dtype(jnp.float32)
