"""Prefetch to device: place the next batches in a background thread.

Host-to-device transfers (and the loader's own host work) overlap with the
computation on the current batch.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

from jax.sharding import Mesh, NamedSharding, Sharding

from ._batches import shard_batch
from ._errors import ShardingError
from ._mesh import batch_sharding, check_mesh
from ._placement import Target, as_sharding, to_device


class _Failure(NamedTuple):
    error: BaseException


_END = object()


class Prefetcher(Iterator[Any]):
    """Iterator over placed elements, filled by a background thread.

    Made by :func:`prefetch_to_device`. Use it as a context manager (or call
    :meth:`close`) to stop the thread when leaving a loop early.
    """

    def __init__(self, iterator: Iterable[Any], size: int, place: Callable[[Any], Any]):
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=size)
        self._stop = threading.Event()
        self._done = False
        self.thread = threading.Thread(
            target=self._produce,
            args=(iter(iterator), place),
            name="jaxdev-prefetch",
            daemon=True,
        )
        self.thread.start()

    def _produce(self, it: Iterator[Any], place: Callable[[Any], Any]) -> None:
        try:
            for item in it:
                if self._stop.is_set() or not self._put(place(item)):
                    return
        except BaseException as err:  # handed to the consumer, re-raised there
            if hasattr(err, "add_note"):
                err.add_note("(raised in the background thread of jaxdev.prefetch_to_device)")
            self._put(_Failure(err))
            return
        self._put(_END)

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        item = self._queue.get()
        if item is _END:
            self.close()
            raise StopIteration
        if isinstance(item, _Failure):
            self.close()
            raise item.error
        return item

    def close(self, timeout: float = 5.0) -> None:
        """Stop the background thread and drop the elements still queued.

        Waits up to ``timeout`` seconds for the thread; a thread stuck inside
        the source iterator's ``next`` cannot be interrupted and finishes
        that call in the background (it is a daemon thread). The source
        iterator itself is not closed.
        """
        self._done = True
        self._stop.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self.thread is not threading.current_thread():
            self.thread.join(timeout)

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        self._stop.set()


def prefetch_to_device(
    iterator: Iterable[Any],
    size: int = 2,
    target: Target | None = None,
    *,
    pad: bool = False,
) -> Prefetcher:
    """Place the next ``size`` elements of ``iterator`` on device in a background thread.

    Host-to-device transfers (and the loader's own host work) overlap with
    the computation on the current element. Unlike flax's
    ``jax_utils.prefetch_to_device``, which only does the pmap layout, any
    placement works. A ``NamedSharding`` that splits the leading axis (e.g.
    :func:`jaxdev.batch_sharding`, the default) sends each element through
    :func:`jaxdev.shard_batch`, so the batch checks, padding and the
    multi-process assembly apply; any other target goes through
    :func:`jaxdev.to_device`.

    Order is preserved and no element is dropped; an exception raised by the
    source iterator (or while placing) is re-raised in the consumer with its
    original traceback. At most ``size`` placed elements wait in the queue
    (plus one being placed), so device memory stays bounded.

    Args:
      iterator: an iterable of pytrees (batches).
      size: how many placed elements may wait; 2 overlaps one transfer with
        one step.
      target: a batch sharding (``jaxdev.batch_sharding(mesh)``), another
        ``Sharding``, a device or spec; default
        ``jaxdev.batch_sharding(jaxdev.data_mesh())``. A bare ``Mesh`` is
        refused: as a target it would mean "replicate every batch".
      pad: pad each batch to a multiple of the devices of a batch sharding
        (elements become :class:`Padded`).

    Returns:
      A :class:`Prefetcher`: an iterator and context manager with ``close()``.

    Raises:
      ShardingError: ``size`` is not a positive int, ``target`` is a bare
        ``Mesh``, or ``pad`` with a target that does not split the batch.

    Example:
      >>> import numpy as np, jaxdev
      >>> mesh = jaxdev.data_mesh()
      >>> batches = (np.full((mesh.size, 2), i) for i in range(3))
      >>> with jaxdev.prefetch_to_device(batches, 2, jaxdev.batch_sharding(mesh)) as it:
      ...     [int(b[0, 0]) for b in it]
      [0, 1, 2]
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ShardingError(f"`size` must be an int >= 1 (elements to keep ready), got {size!r}.")
    return Prefetcher(iterator, size, _placer(target, pad))


def _placer(target: Target | None, pad: bool) -> Callable[[Any], Any]:
    """The function that places one element for ``target``."""
    if isinstance(target, Mesh):
        raise ShardingError(
            "`target` is a Mesh, which as a placement target means a full copy of every "
            "batch on each device. To split each batch over the mesh pass "
            "`jaxdev.batch_sharding(mesh)`; to replicate, `jaxdev.replicated_sharding(mesh)`."
        )
    s = batch_sharding(check_mesh(None)) if target is None else as_sharding(target)
    axis = _leading_axis(s)
    if axis is not None:
        return lambda item: shard_batch(item, s.mesh, pad=pad, axis=axis)
    if pad:
        raise ShardingError(
            "`pad=True` needs a `target` that splits the batch's leading axis, such as "
            f"`jaxdev.batch_sharding(mesh)`; got {target!r}."
        )
    return lambda item: to_device(item, s)


def _leading_axis(s: Sharding) -> Any:
    """The mesh axis (or axes) ``s`` splits the leading dimension over, else None."""
    if isinstance(s, NamedSharding) and len(s.spec) and s.spec[0] is not None:
        return s.spec[0]
    return None
