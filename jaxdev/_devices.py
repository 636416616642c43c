"""What devices exist here: d2l's ``cpu()``/``gpu()``/``try_gpu()``, specs, fake CPUs.

Indexes count this process's local devices of one platform (``jax.local_devices``).
"""

from __future__ import annotations

import operator
import os
import re
from collections.abc import Iterable
from typing import Any

import jax

from ._errors import (
    BackendStartedError,
    DeviceNotFoundError,
    DeviceSpecError,
    available_devices,
    device_name,
    format_devices,
)

DeviceSpec = jax.Device | int | str
"""A ``jax.Device``, a local device index, or a string ``platform[:index]``."""

_PLATFORMS = {"cpu": "cpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}
_SPEC_RE = re.compile(r"^\s*(?P<platform>[A-Za-z]+)\s*(?::\s*(?P<index>[+-]?\d+)\s*)?$")


def _platform_devices(platform: str) -> list[jax.Device]:
    """Local devices of ``platform`` (``[]`` when JAX has no such backend)."""
    try:
        return list(jax.local_devices(backend=platform))
    except RuntimeError:  # JAX: "Unknown backend" / backend failed to start.
        return []


def _local_devices() -> list[jax.Device]:
    """``jax.local_devices()``, or a clear error for JAX's bare AssertionError."""
    try:
        return list(jax.local_devices())
    except (AssertionError, RuntimeError) as e:
        wanted = os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms or "(auto)"
        raise DeviceNotFoundError(
            f"JAX could not start the platforms requested by JAX_PLATFORMS={wanted!r}"
            f"{': ' + ' '.join(str(e).split())[:300] if str(e) else ''}. For a GPU install "
            "jax[cuda12] (pip install -e '.[cuda12]') and check the driver; to fall back to "
            "the CPU set JAX_PLATFORMS='cuda,cpu' or JAX_PLATFORMS=cpu."
        ) from None


def _check_index(i: Any, arg: str) -> int:
    """Return ``i`` as a non-negative int or raise naming ``arg``."""
    if isinstance(i, bool):
        raise DeviceSpecError(f"`{arg}` must be a device index (int), got the bool {i!r}.")
    try:
        i = operator.index(i)
    except TypeError:
        raise DeviceSpecError(
            f"`{arg}` must be a device index (int), got {type(i).__name__} {i!r}."
        ) from None
    if i < 0:
        raise DeviceSpecError(
            f"`{arg}` must be >= 0, got {i}. Negative indexes are refused because "
            "`jax.devices()[-1]` would silently pick the last device. " + available_devices()
        )
    return i


def _pick(platform: str, i: Any, arg: str = "i") -> jax.Device:
    """Return local device ``i`` of ``platform`` or raise with what exists."""
    i = _check_index(i, arg)
    devices = _platform_devices(platform)
    if not devices:
        hint = (
            " For a GPU install `jax[cuda12]` (pip install -e '.[cuda12]'), or use "
            "`try_gpu()` to fall back to the CPU."
            if platform == "gpu"
            else ""
        )
        started = ", ".join(sorted({d.platform for d in _local_devices()}))
        raise DeviceNotFoundError(
            f"No {platform} device: JAX started the platforms [{started}].{hint} "
            + available_devices()
        )
    return _nth(devices, i, arg, f"{platform} ")


def _nth(devices: list[jax.Device], i: int, arg: str, what: str = "") -> jax.Device:
    """``devices[i]``, or DeviceNotFoundError naming ``arg``, the devices and the valid range."""
    if i >= len(devices):
        raise DeviceNotFoundError(
            f"`{arg}`={i} is out of range: this process has {len(devices)} {what}"
            f"device(s) [{format_devices(devices)}], valid indexes 0..{len(devices) - 1}. "
            + available_devices()
        )
    return devices[i]


def cpu(i: int = 0) -> jax.Device:
    """Return local CPU device ``i`` (d2l's ``cpu()``).

    Raises:
      DeviceSpecError: ``i`` is negative or not an int.
      DeviceNotFoundError: ``i`` is past the last CPU device.

    Example:
      >>> import jaxdev
      >>> jaxdev.d2l.cpu().platform
      'cpu'
    """
    return _pick("cpu", i)


def gpu(i: int = 0) -> jax.Device:
    """Return local GPU ``i``, strictly (d2l's ``gpu(i)``).

    Raises:
      DeviceSpecError: ``i`` is negative or not an int.
      DeviceNotFoundError: no GPU backend, or ``i`` past the last GPU (the devices listed).

    Example:
      >>> import jaxdev
      >>> try:
      ...     d = jaxdev.d2l.gpu(0)
      ... except jaxdev.DeviceNotFoundError:
      ...     d = jaxdev.d2l.cpu()
    """
    return _pick("gpu", i)


def num_gpus() -> int:
    """Return the number of local GPUs; 0 when there is no GPU backend. Never raises.

    Example:
      >>> import jaxdev
      >>> jaxdev.d2l.num_gpus() >= 0
      True
    """
    return len(_platform_devices("gpu"))


def try_gpu(i: int = 0) -> jax.Device:
    """Return ``gpu(i)`` if it exists, otherwise ``cpu()`` (d2l's ``try_gpu``; ``i`` >= 0 always).

    Example:
      >>> import jaxdev
      >>> jaxdev.d2l.try_gpu(10).platform in ("cpu", "gpu")
      True
    """
    i = _check_index(i, "i")
    return gpu(i) if i < num_gpus() else cpu()


def try_all_gpus() -> list[jax.Device]:
    """Return every local GPU, or ``[cpu()]`` if there is none (d2l's promise).

    Example:
      >>> import jaxdev
      >>> len(jaxdev.d2l.try_all_gpus()) >= 1
      True
    """
    return _platform_devices("gpu") or [cpu()]


def device(spec: DeviceSpec) -> jax.Device:
    """Return the device a spec names: a ``jax.Device``, an int index, or ``platform[:index]``.

    Platforms: ``cpu``, ``gpu`` (``cuda``, ``rocm`` are aliases), ``tpu``; the index
    defaults to 0. An int indexes the default backend's local devices.

    Raises:
      DeviceSpecError: malformed spec, unknown platform, negative index.
      DeviceNotFoundError: the platform is absent or the index too large.

    Example:
      >>> import jaxdev
      >>> jaxdev.device("cpu:0") == jaxdev.d2l.cpu(0)
      True
    """
    return resolve_device(spec, "spec")


def resolve_device(spec: DeviceSpec, arg: str) -> jax.Device:
    """:func:`device` whose errors name the argument ``arg`` (``target``, ``device``...)."""
    if isinstance(spec, jax.Device):
        return spec
    if not isinstance(spec, str):
        if isinstance(spec, bool) or not hasattr(spec, "__index__"):
            raise DeviceSpecError(
                f"`{arg}` must be a jax.Device, an int or a string like 'gpu:1', "
                f"got {type(spec).__name__} {spec!r}."
            )
        return _nth(_local_devices(), _check_index(spec, arg), arg)
    match = _SPEC_RE.match(spec)
    if match is None:
        raise DeviceSpecError(
            f"`{arg}`={spec!r} is not a device spec: expected 'platform[:index]' such as "
            f"'cpu', 'cpu:3', 'gpu:1', 'cuda:1', 'tpu:0'. " + available_devices()
        )
    name = match["platform"].lower()
    if name not in _PLATFORMS:
        raise DeviceSpecError(
            f"`{arg}`={spec!r} names the unknown platform {name!r}: expected one of "
            f"{sorted(_PLATFORMS)}. " + available_devices()
        )
    index = int(match["index"]) if match["index"] is not None else 0
    return _pick(_PLATFORMS[name], index, arg=arg)


def device_list(devices: int | DeviceSpec | list[DeviceSpec] | None = None) -> list[jax.Device]:
    """Return a list of distinct local devices.

    Args:
      devices: ``None`` for every local device of the default backend, an int ``n`` for
        the first ``n``, a platform name, or a list of device specs.

    Raises:
      DeviceSpecError: a malformed spec, a device twice, an empty list, or ``n < 1``.
      DeviceNotFoundError: more devices asked than exist.

    Example:
      >>> import jaxdev
      >>> jaxdev.device_list(1) == [jaxdev.device(0)]
      True
    """
    if devices is None:
        return _local_devices()
    if isinstance(devices, str) and ":" not in devices:
        if (name := _PLATFORMS.get(devices.strip().lower())) is not None:  # none: _pick raises
            return _platform_devices(name) or [_pick(name, 0, arg="devices")]
    if isinstance(devices, (str, jax.Device)):
        return [resolve_device(devices, "devices")]
    if isinstance(devices, int) and not isinstance(devices, bool):
        local = _local_devices()
        if devices < 1:
            raise DeviceSpecError(f"`devices`={devices}: need at least 1 device.")
        if devices > len(local):
            raise DeviceNotFoundError(
                f"`devices`={devices} asks for more devices than exist: this process has "
                f"{len(local)}. For fake CPU devices call `jaxdev.testing.use_fake_cpu_devices"
                f"({devices})` before JAX starts, or set "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={devices}. "
                + available_devices()
            )
        return list(local[:devices])
    if not isinstance(devices, Iterable):
        raise DeviceSpecError(
            "`devices` must be None, a count, a platform name, a device spec or a list of "
            f"specs, got {type(devices).__name__} {devices!r}."
        )
    out = [resolve_device(d, f"devices[{i}]") for i, d in enumerate(devices)]
    if not out:
        raise DeviceSpecError(
            "`devices` is empty: a mesh, a strategy or a replication needs at least one "
            f"device. Pass None for every local device. {available_devices()}"
        )
    if len(set(out)) < len(out):
        twice = next(d for i, d in enumerate(out) if d in out[:i])
        raise DeviceSpecError(
            f"`devices` lists {device_name(twice)} twice: [{format_devices(out)}]. Each "
            "device may appear once."
        )
    return out


def backend_started() -> bool:
    """Return whether JAX's backends are initialised (start-up settings apply only before)."""
    # private: no public API tells whether the backends started without starting them
    # (jax-ml/jax#23320, open; jax.extend.backend.backends() starts them)
    from jax._src import xla_bridge

    return bool(xla_bridge.backends_are_initialized())


def use_fake_cpu_devices(n: int) -> None:
    """Ask JAX for ``n`` CPU devices, before anything touches a device.

    Sets ``jax_num_cpu_devices`` and exports ``XLA_FLAGS`` and ``JAX_NUM_CPU_DEVICES`` for
    subprocesses; a no-op when the backend already started with ``n`` CPU devices.

    Raises:
      DeviceSpecError: ``n`` is not a positive int.
      BackendStartedError: the backend started with another count.

    Example:
      >>> import jaxdev
      >>> jaxdev.testing.use_fake_cpu_devices(8)  # first line of a script  # doctest: +SKIP
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise DeviceSpecError(f"`n` must be a device count (an int >= 1), got {n!r}.")
    if backend_started():
        have = len(_platform_devices("cpu"))
        if have == n:
            return
        raise BackendStartedError(
            f"`use_fake_cpu_devices({n})` came too late: JAX's backend already started "
            f"with {have} CPU device(s). Call it before anything touches a device (first "
            f"thing in the script), or set XLA_FLAGS=--xla_force_host_platform_device_count={n} "
            "before Python starts. " + available_devices()
        )
    jax.config.update("jax_num_cpu_devices", n)
    flag = "--xla_force_host_platform_device_count"
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(flag)]
    os.environ["XLA_FLAGS"] = " ".join([*kept, f"{flag}={n}"])
    os.environ["JAX_NUM_CPU_DEVICES"] = str(n)  # a subprocess's JAX reads it before XLA_FLAGS


def describe() -> dict[str, Any]:
    """Return what JAX started here as plain data (for ``jaxdev info``).

    Versions, backend, processes, devices (with memory stats or ``None``), what was
    ``requested`` (``JAX_PLATFORMS``, ``XLA_FLAGS``...) and ``warnings``.

    Example:
      >>> import jaxdev
      >>> info = jaxdev.describe()
      >>> info["device_count"] >= 1
      True
    """
    local = _local_devices()
    platforms = sorted({d.platform for d in local})
    devices = [_describe_device(d) for d in jax.devices()]
    requested = {k: os.environ.get(k) for k in ("JAX_PLATFORMS", "XLA_FLAGS")}
    requested |= {k: getattr(jax.config, k) for k in ("jax_platforms", "jax_num_cpu_devices")}
    warnings = []
    wanted = requested["JAX_PLATFORMS"] or requested["jax_platforms"] or ""
    if any(p in wanted.lower() for p in ("cuda", "gpu", "rocm")) and "gpu" not in platforms:
        warnings.append(
            f"A GPU was requested ({wanted.strip()!r}) but JAX runs on {platforms}: install "
            "jax[cuda12] and check the driver."
        )
    count = requested["jax_num_cpu_devices"]
    have_cpu = sum(d["platform"] == "cpu" for d in devices)
    if count and count > 0 and "cpu" in platforms and have_cpu != count:
        warnings.append(f"{count} fake CPU devices were requested but JAX started {have_cpu}.")
    return {
        "jax_version": jax.__version__,
        "default_backend": jax.default_backend(),
        "platforms": platforms,
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "local_device_count": len(local),
        "device_count": jax.device_count(),
        "devices": devices,
        "requested": requested,
        "warnings": warnings,
    }


def memory_stats(device: jax.Device) -> dict[str, Any] | None:
    """``device.memory_stats()``, None where the backend reports none: the one reader."""
    try:
        return device.memory_stats()
    except Exception:  # CPU and some backends report none (some raise instead)
        return None


def _describe_device(d: jax.Device) -> dict[str, Any]:
    stats = memory_stats(d)
    return {
        "id": d.id,
        "platform": d.platform,
        "kind": d.device_kind,
        "process_index": d.process_index,
        "memory": dict(stats) if stats else None,
    }
