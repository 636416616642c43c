"""GPUs that are not here: devices XLA:GPU compiles for from a ``GpuTargetConfig`` text.

``jaxdev.make_mesh(axes, devices, target="h100")`` builds its mesh of such devices
(``jax.experimental.topologies``; needs the CUDA plugin, ``pip install 'jaxdev[cuda12]'``,
but no GPU). Steps lower and compile on it, so memory plans are XLA:GPU's own; nothing is
ever allocated or run there. The shipped texts and where they come from: ``targets/``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import importlib.util
import os
import re
from typing import Any

import jax

from ._errors import PlacementError, ShardingError, UsageError, short

TARGETS = {"h100": "h100_sxm", "h200": "h200", "a100-80gb": "a100_sxm_80"}
"""Target names jaxdev ships a ``GpuTargetConfig`` for (``h100`` is the SXM part)."""

DEFAULT_FRACTION = 0.75
"""JAX's default ``XLA_CLIENT_MEM_FRACTION``: the share of a GPU its allocator takes."""

_FRACTION_VARS = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")  # JAX's order


@dataclasses.dataclass(frozen=True)
class Target:
    """A GPU described by an XLA ``GpuTargetConfig`` text.

    Attributes:
      name: what the user passed (``'h100'``, or the path of a text).
      config: the textproto.
      kind: its ``device_description_str`` (``'NVIDIA H100 80GB HBM3'``).
      memory: its ``device_memory_size``, bytes per device.
    """

    name: str
    config: str = dataclasses.field(repr=False)
    kind: str
    memory: int

    def limit(self) -> tuple[int, str]:
        """``(bytes per device, source)``: what JAX's allocator would take on the real GPU.

        ``device_memory_size`` times ``XLA_CLIENT_MEM_FRACTION`` (or its deprecated alias
        ``XLA_PYTHON_CLIENT_MEM_FRACTION``, read as JAX reads them; JAX's default 0.75, as
        ``memory_stats()['bytes_limit']`` reports on the GPU; the rest is left to the CUDA
        context, cuBLAS/cuDNN workspaces and NCCL); the whole memory under
        ``XLA_PYTHON_CLIENT_ALLOCATOR=platform``, which has no pool.

        Raises:
          UsageError: the fraction variable is not a number in (0, 1].
        """
        if os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR", "").lower() == "platform":
            return self.memory, f"device_memory_size of target {self.name!r} (platform allocator)"
        var = next((v for v in _FRACTION_VARS if os.environ.get(v)), None)
        try:
            fraction = float(os.environ[var]) if var else DEFAULT_FRACTION
        except ValueError:
            fraction = -1.0
        if not 0 < fraction <= 1:
            raise UsageError(
                f"{var}={os.environ[var]!r} is not a fraction of the GPU's memory: set it to a "
                "number in (0, 1] (JAX's default is 0.75), or unset it."
            )
        return int(self.memory * fraction), (
            f"{fraction:g} of the device_memory_size of target {self.name!r}, as JAX's "
            f"allocator takes it ({var or 'XLA_CLIENT_MEM_FRACTION unset: JAX default'})"
        )


_BY_DEVICE: dict[jax.Device, Target] = {}  # every target device jaxdev made


def load_target(target: str) -> Target:
    """The :class:`Target` named ``target`` (a key of :data:`TARGETS`) or read from a path.

    Raises:
      UsageError: not a name, an unknown one, or a file that is not a ``GpuTargetConfig`` text.
    """
    if not isinstance(target, str) or not target:  # before the cache: a list is unhashable
        raise UsageError(f"`target` must be a GPU name or a path, got {target!r}.")
    return _load_target(target)


@functools.lru_cache(maxsize=16)
def _load_target(target: str) -> Target:
    if name := TARGETS.get(target.lower()):
        text = (importlib.resources.files("jaxdev") / "targets" / f"{name}.txtpb").read_text()
    elif os.path.isdir(target):
        raise UsageError(f"`target`={target!r} is a directory: pass the path of one text in it.")
    elif os.path.isfile(target):
        try:
            with open(target, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as err:
            raise UsageError(
                f"`target`={target!r}: cannot read the file as an XLA GpuTargetConfig text "
                f"({err}). Pass a readable text file such as h100_sxm.txtpb."
            ) from err
    else:
        raise UsageError(
            f"`target`={target!r} is neither a GPU jaxdev knows ({', '.join(TARGETS)}) nor an "
            "existing file. Pass one of those names, or the path of an XLA GpuTargetConfig "
            "text (e.g. xla/tools/hlo_opt/gpu_specs/*.txtpb in openxla/xla)."
        )
    memory = re.search(r"device_memory_size:\s*(\d+)", text)
    kind = re.search(r'device_description_str:\s*"([^"]*)"', text)
    if memory is None or "gpu_device_info" not in text:
        raise UsageError(
            f"`target`={target!r}: the file is not an XLA GpuTargetConfig text (no "
            "gpu_device_info with a device_memory_size). Use a text such as "
            "xla/tools/hlo_opt/gpu_specs/h100_sxm.txtpb of openxla/xla."
        )
    return Target(target, text, kind[1] if kind else "GPU", int(memory[1]))


def topology(devices: Any, count: int | None) -> str:
    """XLA's ``'slices x hosts x devices'`` for ``devices`` (8, ``'8'``, ``'2x8'``,
    ``'1x2x8'``; None: ``count``).

    A count ``n`` is one host of ``n`` when ``n <= 8`` or ``n`` is no multiple of 8, else
    hosts of 8 (an HGX board).

    Raises:
      ShardingError: ``devices`` is malformed or does not give ``count`` devices.
    """
    want = count if devices is None else devices
    if isinstance(want, str) and re.fullmatch(r"[1-9]\d*", want.strip()):
        want = int(want)
    if isinstance(want, int) and not isinstance(want, bool) and want >= 1:
        hosts, per = (1, want) if want <= 8 or want % 8 else (want // 8, 8)
    elif isinstance(want, str) and re.fullmatch(r"(1x)?[1-9]\d*x[1-9]\d*", want.strip()):
        hosts, per = map(int, want.strip().split("x")[-2:])
    else:
        raise ShardingError(
            f"`devices`={devices!r}: with `target=`, give the device count (8) or hosts x "
            "devices per host ('2x8', '32x8', XLA's '1x2x8'), or leave it out for the axes' "
            "product."
        )
    if count is not None and hosts * per != count:
        raise ShardingError(
            f"`devices`={devices!r} gives {hosts * per} target devices ({hosts} host(s) x "
            f"{per}) but the mesh axes multiply to {count}: make them agree, e.g. "
            f"`devices={count}` or axes whose sizes multiply to {hosts * per}."
        )
    return f"1x{hosts}x{per}"


@functools.lru_cache(maxsize=16)
def target_devices(target: Target, topo: str) -> tuple[jax.Device, ...]:
    """The devices of ``topo`` (``'1x2x8'``) XLA:GPU compiles for as ``target`` (cached).

    Raises:
      UsageError: the CUDA plugin is missing, or installed but not started without a GPU.
    """
    from jax.experimental import topologies

    try:
        desc = topologies.get_topology_desc(
            platform="cuda", target_config=target.config, topology=topo
        )
    except NotImplementedError as err:  # no cuda topology: plugin missing or failed to start
        fix = "pip install 'jaxdev[cuda12]' (the CUDA 12 plugin; no GPU is needed)"
        find = importlib.util.find_spec  # the package first: a missing parent raises
        if find("jax_plugins") and find("jax_plugins.xla_cuda12"):
            fix = (
                "JAX tried to start the CUDA backend, which fails without a GPU: set "
                "JAX_PLATFORMS=cpu before JAX starts (or jax.config.update('jax_platforms', "
                "'cpu') first thing)"
            )
        raise UsageError(
            f"`target`={target.name!r}: compiling for a GPU needs JAX's CUDA plugin ({err}). "
            f"Fix: {fix}."
        ) from err
    except jax.errors.JaxRuntimeError as err:  # XLA could not parse the text
        raise UsageError(
            f"`target`={target.name!r}: XLA cannot read the file as a GpuTargetConfig text "
            f"({short(str(err), 200)}). Fix the text (XLA logs the line), or start from a "
            "shipped one (jaxdev/targets/)."
        ) from err
    devices = tuple(desc.devices)
    _BY_DEVICE.update(dict.fromkeys(devices, target))
    return devices


def _first(where: Any) -> Any:
    """The first device of a mesh, sharding, device or devices (None: none there)."""
    if where is None or isinstance(where, jax.Device):
        return where
    if isinstance(where, jax.sharding.Sharding):
        return next(iter(where.device_set), None)
    flat = getattr(where, "devices", where)  # a mesh's devices: an array
    return next(iter(getattr(flat, "flat", flat)), None)


def target_of(devices: Any) -> Target | None:
    """The :class:`Target` of a mesh's (sharding's, devices') first device; None for here."""
    return _BY_DEVICE.get(_first(devices))


def is_target(devices: Any) -> bool:
    """Whether a mesh's (sharding's, devices') devices are compile-only: a jaxdev target or
    ``topologies`` devices."""
    first = _first(devices)
    return first in _BY_DEVICE or "CompileOnly" in type(getattr(first, "client", None)).__name__


def refuse(what: str, where: Any) -> None:
    """Raise :func:`not_here` for ``what`` when ``where`` (mesh, sharding, device) is a target."""
    if is_target(where):
        raise not_here(what, where)


def not_here(what: str, devices: Any = None) -> PlacementError:
    """The error for allocating or running on target devices (``what``: the attempt)."""
    t = None if devices is None else target_of(devices)
    where = f"target {t.name!r} ({t.kind})" if t else "a target's devices (compile-only)"
    return PlacementError(
        f"{what} on {where}: a target mesh is for compiling and planning only (lower, "
        "jaxdev.memory.plan / fit_memory / explain_memory), nothing can be allocated or run "
        "on it. Plan with jax.ShapeDtypeStruct leaves (jax.eval_shape), or build the mesh "
        "without `target=` to run here."
    )
