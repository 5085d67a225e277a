"""The C++ kernel's stochastic rounding to bfloat16 is unbiased where the gap between the
two neighbours is a float32 subnormal (issue 32: |x| under about 3e-36).

The kernel decides from the integer bit patterns (round up when the top 16 random bits are
below ``bits(|x|) & 0xFFFF``), so P(up) is the dropped fraction exactly; float arithmetic
on the gap, which XLA's CPU threads flush to zero, always rounded down there. Driven through
the rounded step with scalars that make the float32 sum the gradient itself (b1 = b2 = 0,
eps = 1, lr = -1: ``w + g`` with w = 0), 2^16 elements (each its own counter) per key.
"""

import jax.numpy as jnp
import numpy as np
import pytest

N, KEYS = 1 << 16, 4


def _rounded(x: float) -> np.ndarray:
  from adamkit._cpu import ffi
  s = jnp.array([0, 1, 0, 0, 1, -1, 0, 1, 1], jnp.float32)  # b1 1-b1 b2 1-b2 eps lr wd c1 c2
  out = []
  for k in range(KEYS):
    p, g = jnp.zeros(N, jnp.bfloat16), jnp.full(N, x, jnp.float32)
    state = (jnp.zeros(N, jnp.float32), jnp.zeros(N, jnp.float32))
    new, _, _ = ffi.dense_step_rounded(ffi.Variant("hat"), s, "stochastic", [p], [g], state,
                                       keys=jnp.array([k, 0xADA3], jnp.uint32))
    out.append(np.asarray(new[0].astype(jnp.float32), np.float64))
  return np.concatenate(out)


@pytest.mark.parametrize("x", [1e-37, 2.5e-37, 3e-36, 1.0001, -7e-37])
def test_kernel_stochastic_bf16_mean_is_x(kernel, x):
  """float64 NumPy reference: the neighbours from the float32 bits, P(up) = the dropped
  16 bits / 2^16; every result is a neighbour, the fraction rounded up and the mean are
  within 5 standard deviations of it (the old float rule: always down, mean 0.99917 x)."""
  bits = int(np.float32(abs(x)).view(np.uint32))
  lo = np.uint32(bits & 0xFFFF0000).view(np.float32).astype(np.float64)
  hi = np.uint32((bits & 0xFFFF0000) + 0x10000).view(np.float32).astype(np.float64)
  p = (bits & 0xFFFF) / 65536.0
  r = np.abs(_rounded(x))
  assert np.all(np.sign(_rounded(x)) == np.sign(x))
  assert set(np.unique(r)) <= {lo, hi}
  up = np.mean(r == hi)
  sd = np.sqrt(p * (1 - p) / r.size)
  assert abs(up - p) <= 5 * sd, (up, p)
  xf = float(np.float32(abs(x)))
  assert abs(r.mean() - xf) <= 5 * sd * (hi - lo), r.mean() / xf


def test_kernel_sum_below_the_normals_is_flushed(kernel):
  """At 1e-39 (a float32 subnormal) the kernel's float32 sum is already 0 (XLA's CPU threads
  flush subnormals, as its own elementwise step does), so every draw is 0: the rounding
  never sees a subnormal x, and E[SR(x)] = x holds for every x it sees."""
  np.testing.assert_array_equal(_rounded(1e-39), 0.0)
