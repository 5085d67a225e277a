"""ak.offload of a fused step (ak.fused_adam / ak.fused_adamax): placement, trajectories.

The offloaded fused step must follow the same trajectory as the fused step without offload
(bit for bit: the same arithmetic, only the memories differ) and as the named optimizer's
chain ``update`` + ``optax.apply_updates`` (to float32 rounding), with the state in host
memory and the params in device memory after every donated step.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_offload import HOST, SUPPORTED, kinds

import adamkit as ak
from adamkit import _backend

pytestmark = pytest.mark.skipif(not SUPPORTED, reason="ak.offload unsupported here")
STEPS = 4
LR = 0.05


def make_params():
  # "bias" is spared by the default (MindSpore) decay mask; the kernel sees both flags.
  w = jnp.linspace(-1.0, 1.0, 48, dtype=jnp.float32).reshape(8, 6)
  return {"dense": {"kernel": w, "bias": jnp.full((6,), 0.25, jnp.float32)},
          "head": jnp.cos(jnp.arange(10, dtype=jnp.float32))}


def grads_at(params, t):
  return jax.tree.map(lambda p: jnp.sin(3.0 * p + 0.5 * t) + 0.1 * p, params)


def run_fused(opt, steps=STEPS, check_placement=False, params=None):
  """``steps`` jitted donated steps of ``opt``; checks placement after each if asked."""
  step = jax.jit(opt.step, donate_argnums=(0, 1))
  params = make_params() if params is None else jax.tree.map(jnp.copy, params)
  state = opt.init(params)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for t in range(steps):
      old = jax.tree.leaves((params, state))
      params, state = step(params, state, grads=grads_at(params, jnp.float32(t)))
      if check_placement:
        assert kinds(state) == {HOST}, f"step {t}: state in {kinds(state)}"
        assert kinds(params) == {"device"}, f"step {t}: params in {kinds(params)}"
        assert all(x.is_deleted() for x in old), f"step {t}: an input was not donated"
  donation = [w for w in caught if "donated buffers were not usable" in str(w.message)]
  assert not donation, [str(w.message) for w in donation]
  return params, state


def run_chain(tx, steps=STEPS):
  params = make_params()
  state = tx.init(params)
  for t in range(steps):
    updates, state = tx.update(grads_at(params, jnp.float32(t)), state, params)
    params = optax.apply_updates(params, updates)
  return params


CASES = {
    "adam": (ak.fused_adam, ak.adam, dict()),
    "adam-decay-corrected": (ak.fused_adam, ak.adam,
                             dict(weight_decay=0.1, eps_mode="corrected")),
    "adamax": (ak.fused_adamax, ak.adamax, dict(weight_decay=0.1)),
    "adam-amsgrad": (ak.fused_adam, ak.adam, dict(amsgrad=True, weight_decay=0.1)),
    "adamw-amsgrad": (ak.fused_adamw, ak.adamw, dict(amsgrad=True, weight_decay=0.1)),
    "adamw-paddle": (ak.fused_adamw, ak.adamw, dict(weight_decay=0.1, weight_decay_mask=None)),
}


@pytest.mark.parametrize("backend", ["kernel", "xla"])
@pytest.mark.parametrize("mode", ["compute", "state"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_trajectory_and_placement(case, mode, backend, request):
  if backend == "kernel":
    request.getfixturevalue("kernel")
  fused, chain, kw = CASES[case]
  got, state = run_fused(ak.offload(fused(LR, backend=backend, **kw), mode=mode),
                         check_placement=True)
  plain, plain_state = run_fused(fused(LR, backend=backend, **kw))
  reference = run_chain(chain(LR, **kw))
  for a, b in zip(jax.tree.leaves((got, state)), jax.tree.leaves((plain, plain_state))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(reference)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6, atol=1e-7)
  assert int(state.count) == STEPS


@pytest.mark.parametrize("backend", ["kernel", "xla"])
@pytest.mark.parametrize("mode", ["compute", "state"])
@pytest.mark.parametrize("multi_tensor", [True, False])
def test_quantized_moments_offloaded(mode, backend, multi_tensor, request):
  """8-bit moments (issue 19): with mode="state" codes and scales live in host memory, and
  the trajectory is the one without offload bit for bit; mode="compute" refuses them,
  naming mode="state" (JAX types the arrays the XLA codec makes inside a host computation
  as device memory, and one rule for both backends keeps the choice of backend
  invisible)."""
  if backend == "kernel":
    request.getfixturevalue("kernel")
  q = ak.Quantized("8bit", block_size=16, min_size=0)
  make = lambda: ak.fused_adamw(LR, weight_decay=0.1, amsgrad=True, mu_dtype=q, nu_dtype=q,  # noqa: E731
                                multi_tensor=multi_tensor, backend=backend)
  if mode == "compute":
    with pytest.raises(ValueError, match="mode='state'"):
      run_fused(ak.offload(make(), mode=mode), check_placement=True)
    return
  got, state = run_fused(ak.offload(make(), mode=mode), check_placement=True)
  plain, plain_state = run_fused(make())
  assert any(x.dtype == jnp.uint8 for x in jax.tree.leaves(state))
  for a, b in zip(jax.tree.leaves((got, state)), jax.tree.leaves((plain, plain_state))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("multi_tensor", [True, False])
def test_compute_mode_runs_the_kernel_on_the_host(kernel, multi_tensor):
  """On CPU the C++ kernel itself runs inside the host-compute region (not a fallback).
  Forced: with 8 devices in the process "auto" keeps traced arrays on XLA (their placement
  is unknown; tests/test_backend.py checks that rule)."""
  opt = ak.offload(ak.fused_adam(LR, multi_tensor=multi_tensor, backend="kernel"), mode="compute")
  params = {"w": jnp.ones((_backend.MIN_LEAF,), jnp.float32)}
  state = opt.init(params)
  jaxpr = jax.make_jaxpr(opt.step)(params, state, grads=params).jaxpr
  (region,) = [e for e in jaxpr.eqns if e.primitive.name == "compute_on"]
  inner = region.params["jaxpr"]
  inner = getattr(inner, "jaxpr", inner)
  assert "ffi_call" in {e.primitive.name for e in inner.eqns}
  assert "ffi_call" not in {e.primitive.name for e in jaxpr.eqns}
  # ... and runs: the same numbers as without offload.
  got, _ = run_fused(opt, steps=2, check_placement=True, params=params)
  want, _ = run_fused(ak.fused_adam(LR, multi_tensor=multi_tensor, backend="kernel"), steps=2,
                      params=params)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
