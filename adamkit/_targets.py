"""Deviceless compilation: what a step costs on a TPU or GPU, from a machine without one.

JAX compiles for a TPU topology (``libtpu``, ``pip install "jax[tpu]"``) or an NVIDIA GPU
(``jax-cuda13-plugin`` and a local CUDA 13 toolkit for ``ptxas``) without the accelerator
(``jax.experimental.topologies``): the compiled program's ``memory_analysis()`` (per
device: arguments, outputs, aliased bytes, XLA temporaries, host-memory arguments) and, on
TPU, ``cost_analysis()`` (XLA's estimate of flops and bytes accessed) are XLA's own figures
for that target. They are compile-time figures, not measurements on hardware.

Target names (:data:`TARGETS` lists the fixed ones):

* a TPU topology ``"<chip>:<AxB[xC]>"`` as ``get_topology_desc`` takes it, e.g.
  ``"v5e:1x1"`` (one chip), ``"v5e:2x2"`` (4 chips), ``"v4:2x2x1"``;
* ``"h100"`` / ``"h100:N"``: one or ``N`` NVIDIA H100 80GB GPUs;
* ``"cpu"``: this process's CPU devices (a real compile, for comparison).

An unknown name, or a target whose package is missing, raises an error that names the
accepted names or the package: nothing falls back to another platform.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

# The XLA GPU target description of an NVIDIA H100 80GB HBM3 (SM 9.0, 132 SMs), as XLA's
# own GPU specs give it; the compiler needs no device to read it.
_H100 = """gpu_device_info { threads_per_block_limit: 1024 threads_per_warp: 32
  shared_memory_per_block: 49152 shared_memory_per_core: 233472 threads_per_core_limit: 2048
  core_count: 132 fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: 3352320000000 l2_cache_size: 52428800
  clock_rate_ghz: 1.98 device_memory_size: 84929347584 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 } registers_per_core_limit: 65536
  registers_per_block_limit: 65536 }
runtime_version { major: 13 } platform_name: "CUDA" dnn_version_info { major: 9 minor: 7 }
device_description_str: "NVIDIA H100 80GB HBM3" """

TARGETS = ("cpu", "v5e:1x1", "v5e:2x2", "h100", "h100:2")  # the names the docs and tests use
_TPU_NAME = re.compile(r"^v\d+[a-z]*:\d+(x\d+)*$")
_GPU_NAME = re.compile(r"^h100(:\d+)?$")
_ACCEPTED = ("'cpu', a TPU topology such as 'v5e:1x1', 'v5e:2x2' or 'v4:2x2x1' (needs "
             "libtpu: pip install 'jax[tpu]'), 'h100' or 'h100:N' (needs jax-cuda13-plugin "
             "and a CUDA 13 toolkit)")


def _missing(package: str, target: str, hint: str) -> RuntimeError:
  return RuntimeError(f"target {target!r} needs {package}, which is not installed here: "
                      f"{hint}. Accepted targets: {_ACCEPTED}.")


@functools.cache
def devices(target: str) -> tuple:
  """The devices of ``target`` (deviceless ones for TPU and GPU names)."""
  if not isinstance(target, str):
    raise TypeError(f"`target` must be a string ({_ACCEPTED}), got {type(target).__name__}.")
  from jax.experimental import topologies  # noqa: PLC0415 - only deviceless callers need it

  if target == "cpu":
    return tuple(jax.devices("cpu"))
  if _TPU_NAME.match(target):
    if importlib.util.find_spec("libtpu") is None:
      raise _missing("libtpu", target, "pip install 'jax[tpu]' (it pins the matching libtpu)")
    return tuple(topologies.get_topology_desc(target, platform="tpu").devices)
  if _GPU_NAME.match(target):
    if not any(importlib.util.find_spec(m) is not None
               for m in ("jax_cuda13_plugin", "jax_cuda12_plugin")):
      raise _missing("jax-cuda13-plugin", target,
                     "pip install jax-cuda13-plugin==<your jax version>")
    n = int(target.partition(":")[2] or 1)
    topo = topologies.get_topology_desc(platform="cuda", target_config=_H100,
                                        topology=f"1x1x{n}")
    return tuple(topo.devices)
  raise ValueError(f"Unknown target {target!r}; accepted: {_ACCEPTED}.")


def platform(target: str) -> str:
  """The platform a step compiled for ``target`` runs on: "cpu", "tpu" or "gpu"."""
  p = devices(target)[0].platform
  return "gpu" if p in ("cuda", "rocm") else p


def mesh(target: str, axis: str = "fsdp") -> jax.sharding.Mesh:
  """A one-axis mesh over all of ``target``'s devices."""
  devs = devices(target)
  return jax.sharding.Mesh(np.array(devs).reshape(len(devs)), (axis,))


def fsdp_spec(shape: tuple, n: int, axis: str = "fsdp") -> P:
  """FSDP's layout: the first axis of ``shape`` that ``n`` divides is split over ``axis``
  (the largest such axis if several), else the array is replicated."""
  if n == 1:
    return P()
  fits = [a for a, d in enumerate(shape) if d % n == 0 and d >= n]
  if not fits:
    return P()
  a = max(fits, key=lambda i: shape[i])
  return P(*([None] * a + [axis]))


def abstract(tree: Any, target: str, *, shard: str = "fsdp") -> Any:
  """``tree`` (arrays or ``ShapeDtypeStruct`` shapes) as ``ShapeDtypeStruct`` shapes placed on
  ``target``'s mesh: ``shard="fsdp"`` splits each leaf's largest divisible axis over all
  devices (:func:`fsdp_spec`), ``"replicated"`` copies it to each."""
  if shard not in ("fsdp", "replicated"):
    raise ValueError(f"`shard` must be 'fsdp' or 'replicated', got {shard!r}.")
  m = mesh(target)
  n = m.devices.size if shard == "fsdp" else 1

  def place(x):
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype,
                                sharding=NamedSharding(m, fsdp_spec(np.shape(x), n)))
  return jax.tree.map(place, tree)


def abstract_state(init: Callable, params: Any, *, shard: str = "fsdp") -> Any:
  """``init(params)``'s state as ``ShapeDtypeStruct`` shapes on the params' mesh, laid out by the
  same rule as the params (``shard``: see :func:`abstract`; every state leaf, a flat or a
  quantized buffer too, as an FSDP setup shards it), in the memory kind ``init`` compiled
  for the params' target gives it (an offloaded state's is host memory)."""
  m = next(x.sharding.mesh for x in jax.tree.leaves(params))
  n = m.devices.size if shard == "fsdp" else 1
  compiled = jax.jit(init).trace(params).lower().compile()
  kinds = jax.tree.map(lambda s: s.memory_kind, compiled.output_shardings)
  shapes = jax.eval_shape(init, params)
  return jax.tree.map(
      lambda a, kind: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(
          m, fsdp_spec(a.shape, n), memory_kind=kind)), shapes, kinds)


def step_fn(tx: optax.GradientTransformation) -> Callable:
  """``(params, state, grads) -> (params, state)``: a fused step's one-pass ``step`` where
  ``tx`` has one, else ``tx.update`` and ``optax.apply_updates``."""
  if hasattr(tx, "step"):
    return lambda p, s, g: tx.step(p, s, grads=g)

  def step(p, s, g):
    updates, s = tx.update(g, s, p)
    return optax.apply_updates(p, updates), s
  return step


def compile_step(tx: optax.GradientTransformation, params: Any, target: str, *,
                 shard: str = "fsdp", donate: bool = True):
  """``tx``'s step on ``params`` (arrays or shapes) compiled for ``target``, jitted as
  users jit it: params and state donated (``donate=True``), gradients an argument laid out
  as the params. Returns ``(compiled, abstract params, abstract state)``."""
  p = abstract(params, target, shard=shard)
  s = abstract_state(tx.init, p, shard=shard)
  return _compile(tx, p, s, donate), p, s


def _compile(tx: optax.GradientTransformation, p: Any, s: Any, donate: bool):
  jitted = jax.jit(step_fn(tx), donate_argnums=(0, 1) if donate else ())
  return jitted.trace(p, s, p).lower().compile()


@dataclasses.dataclass(frozen=True)
class Figures:
  """XLA's compile-time figures of one program, per device (bytes).

  ``peak``: what device memory holds at once by XLA's accounting, arguments + outputs -
  aliased (donated) bytes + temporaries; host-memory arguments are apart
  (``host_arguments``). ``bytes_accessed`` / ``flops``: ``cost_analysis()``'s estimate
  (``None`` where the backend gives none, the GPU one)."""

  arguments: int
  outputs: int
  aliased: int
  temporaries: int
  host_arguments: int
  host_temporaries: int
  bytes_accessed: float | None
  flops: float | None

  @property
  def peak(self) -> int:
    return self.arguments + self.outputs - self.aliased + self.temporaries


def figures(compiled) -> Figures:
  """The :class:`Figures` of a compiled program."""
  m = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) and cost else cost
  get = (lambda k: None) if not cost else (lambda k: cost.get(k))
  return Figures(
      arguments=int(m.argument_size_in_bytes), outputs=int(m.output_size_in_bytes),
      aliased=int(m.alias_size_in_bytes), temporaries=int(m.temp_size_in_bytes),
      host_arguments=int(getattr(m, "host_argument_size_in_bytes", 0)),
      host_temporaries=int(getattr(m, "host_temp_size_in_bytes", 0)),
      bytes_accessed=get("bytes accessed"), flops=get("flops"))


def custom_calls(compiled) -> list[str]:
  """The custom-call targets of a compiled program (a CPU kernel must never be among a
  TPU or GPU program's)."""
  return sorted(set(re.findall(r'custom_call_target="([^"]+)"', compiled.as_text())))


def per_device_bytes(tree: Any) -> int:
  """Bytes of ``tree``'s arrays (or shapes with shardings) held by one device."""
  total = 0
  for x in jax.tree.leaves(tree):
    shape = np.shape(x)
    sharding = getattr(x, "sharding", None)
    if sharding is not None:
      shape = sharding.shard_shape(shape)
    total += math.prod(shape) * jnp.dtype(x.dtype).itemsize
  return total


def host_bytes(tree: Any) -> int:
  """Bytes of ``tree``'s leaves placed in host memory (``pinned_host``/``unpinned_host``),
  per device."""
  return per_device_bytes([x for x in jax.tree.leaves(tree) if getattr(
      getattr(x, "sharding", None), "memory_kind", None) in ("pinned_host", "unpinned_host")])


def params_count(params: Any) -> int:
  return sum(math.prod(np.shape(x)) for x in jax.tree.leaves(params))


@dataclasses.dataclass(frozen=True)
class MemoryReport:
  """What :func:`adamkit.memory_report` found: the state's bytes and the step's device
  figures on one target (per device; :meth:`per_param`: bytes per parameter of the model,
  all devices together). ``step`` is ``None`` where the step does not fit the target's
  memory: XLA refuses to compile it, and ``does_not_fit`` gives XLA's reason."""

  target: str
  devices: int
  params: int
  param_bytes: int
  state_bytes: int
  state_host_bytes: int
  step: Figures | None
  does_not_fit: str | None = None

  @property
  def fits(self) -> bool:
    return self.step is not None

  def per_param(self, nbytes: int) -> float:
    return nbytes * self.devices / max(self.params, 1)

  def __str__(self) -> str:
    mib = lambda b: f"{b / 2**20:,.1f} MiB"
    pp = lambda b: f"{self.per_param(b):.2f} B/param"
    f = self.step
    lines = [
        f"target {self.target} ({self.devices} device{'s' * (self.devices > 1)}), "
        f"{self.params:,} params; per device:",
        f"  params          {mib(self.param_bytes):>14}  ({pp(self.param_bytes)})",
        f"  state           {mib(self.state_bytes):>14}  ({pp(self.state_bytes)}; "
        f"{mib(self.state_host_bytes)} of it in host memory)",
    ]
    if f is None:
      return "\n".join(lines + [f"  step: does not fit ({self.does_not_fit})"])
    lines += [
        f"  step temporaries{mib(f.temporaries):>14}  ({pp(f.temporaries)})",
        f"  step peak       {mib(f.peak):>14}  ({pp(f.peak)}: arguments + outputs - donated "
        "+ temporaries)",
    ]
    if f.bytes_accessed is not None:
      lines.append(f"  bytes accessed  {mib(f.bytes_accessed):>14}  (XLA's estimate)")
    return "\n".join(lines)


def memory_report(tx: optax.GradientTransformation, params: Any, target: str = "v5e:2x2", *,
                  shard: str = "fsdp", donate: bool = True) -> MemoryReport:
  r"""The state's bytes and the step's device memory on ``target``, before buying it.

  Compiles ``tx``'s step (a fused step's ``step``, else ``update`` +
  ``optax.apply_updates``; params, state and gradients as arguments, params and state
  donated as a training step donates them) for ``target`` without its hardware, JAX's
  deviceless ahead-of-time compile, and reads XLA's ``memory_analysis()`` (and on TPU
  ``cost_analysis()``). ``params`` may be arrays or ``jax.ShapeDtypeStruct`` shapes alone:
  nothing is allocated.

  .. math::

    \text{peak} = \text{arguments} + \text{outputs} - \text{donated} +
    \text{temporaries}

  per device, XLA's accounting of device memory (host-memory arguments, an offloaded
  state's, are apart). The figures are XLA's compile-time figures, not measurements on the
  device; activations and the gradient computation are not part of the step.

  Args:
    tx: any adamkit (or optax) ``GradientTransformation``.
    params: the params tree, arrays or ``ShapeDtypeStruct`` shapes.
    target: where the step is compiled for: ``"v5e:1x1"``, ``"v5e:2x2"`` (any TPU
      topology name; needs ``jax[tpu]``), ``"h100"`` / ``"h100:N"`` (needs
      ``jax-cuda13-plugin`` and a CUDA 13 toolkit) or ``"cpu"``.
    shard: ``"fsdp"`` (each leaf's largest axis divisible by the device count is split
      over the devices) or ``"replicated"``.
    donate: donate params and state to the step.

  Returns:
    A :class:`MemoryReport`; ``print`` it for a table. Where the step needs more memory
    than the target has, XLA refuses to compile it (TPU: ``CompileTimeHbmOom``): the
    report's ``fits`` is ``False`` and ``does_not_fit`` gives XLA's figures.

  Raises:
    ValueError: an unknown target (the message lists the accepted names).
    RuntimeError: the target's compiler package is not installed (the message names it).

  Examples:
    >>> import jax, jax.numpy as jnp, adamkit as ak
    >>> params = {"w": jax.ShapeDtypeStruct((1024, 1024), jnp.float32)}
    >>> r = ak.memory_report(ak.adamw(1e-3, mu_dtype="8bit", nu_dtype="8bit"), params, "cpu")
    >>> round(r.per_param(r.state_bytes), 2)
    2.03
  """
  p = abstract(params, target, shard=shard)
  s = abstract_state(tx.init, p, shard=shard)
  step, why = None, None
  try:
    step = figures(_compile(tx, p, s, donate))
  except jax.errors.JaxRuntimeError as e:  # XLA refuses a program larger than the memory
    if "RESOURCE_EXHAUSTED" not in str(e) or "Vmem" in str(e):  # VMEM: a compile failure
      raise
    why = str(e).split("RESOURCE_EXHAUSTED:", 1)[1].strip().splitlines()[0]
  return MemoryReport(target=target, devices=len(devices(target)), params=params_count(p),
                      param_bytes=per_device_bytes(p), state_bytes=per_device_bytes(s),
                      state_host_bytes=host_bytes(s), step=step, does_not_fit=why)


def transformer_shapes(vocab: int = 8192, d_model: int = 512, layers: int = 6,
                       dtype: Any = jnp.float32) -> dict:
  """A decoder-only transformer's params as ``ShapeDtypeStruct`` shapes: a ``(vocab, d_model)``
  embedding, per layer an attention block (``qkv`` ``(d, 3d)``, ``out`` ``(d, d)``), an MLP
  (``(d, 4d)``, ``(4d, d)``) and two norms' scales, and a final norm. The defaults give
  23.1M parameters, the tree the accelerator tier and ``benchmarks/accelerator.py`` use."""
  s = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)
  layer = lambda: {"attn": {"qkv": s(d_model, 3 * d_model), "out": s(d_model, d_model)},
                   "mlp": {"up": s(d_model, 4 * d_model), "down": s(4 * d_model, d_model)},
                   "norm1": {"scale": s(d_model)}, "norm2": {"scale": s(d_model)}}
  return {"embed": s(vocab, d_model), "layers": [layer() for _ in range(layers)],
          "final_norm": {"scale": s(d_model)}}
