"""Prefetch to device: place the next batches in a background thread."""

from __future__ import annotations

import atexit
import collections
import contextlib
import functools
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

from jax.sharding import Mesh, NamedSharding

from . import _timeline
from ._batches import shard_batch
from ._errors import ShardingError, UsageError
from ._mesh import batch_sharding, check_mesh
from ._placement import Target, as_sharding, to_device


class _Failure(NamedTuple):
    error: BaseException


_END = object()


class _Channel:
    """A bounded queue whose ``close`` wakes every waiter at once (reentrant: finalizer-safe)."""

    def __init__(self, size: int):
        self._items: collections.deque[Any] = collections.deque()
        self._size = size
        self._cond = threading.Condition(threading.RLock())
        self.closed = False
        self.placing = False  # the thread is placing an element (inside JAX)

    def put(self, item: Any) -> bool:
        """Queue ``item`` once there is room; False (item dropped) once closed."""
        with self._cond:
            self._cond.wait_for(lambda: len(self._items) < self._size or self.closed)
            if self.closed:
                return False
            self._items.append(item)
            self._cond.notify_all()
            return True

    def get(self) -> Any:
        """The next item, waiting for it; ``_END`` once closed."""
        with self._cond:
            self._cond.wait_for(lambda: self._items or self.closed)
            if self.closed:
                return _END
            item = self._items.popleft()
            self._cond.notify_all()
            return item

    def close(self) -> None:
        """Drop the queued items and wake every waiter."""
        with self._cond:
            self.closed = True
            self._items.clear()
            self._cond.notify_all()


# Running threads and their channels, so that interpreter exit can stop them
# first: a daemon thread still inside JAX when Python finalizes aborts the
# process (exit code 134, "FATAL: exception not rethrown").
_RUNNING: dict[threading.Thread, _Channel] = {}
_RUNNING_LOCK = threading.Lock()
_EXIT_WAIT_S = 5.0
_EXIT_SOURCE_WAIT_S = 0.5


def _produce(it: Iterator[Any], place: Callable[[Any], Any], channel: _Channel) -> None:
    """The thread's body: it holds the channel, never the :class:`Prefetcher`."""
    try:
        for item in it:
            channel.placing = True  # before the check: _stop_all reads it after closing
            if channel.closed:
                return
            placed = place(item)
            channel.placing = False
            del item  # hold no batch while waiting on the source
            if not channel.put(placed):
                return
            del placed
        channel.put(_END)
    except BaseException as err:  # handed to the consumer, re-raised there
        err.add_note("(raised in the background thread of jaxdev.prefetch_to_device)")
        channel.put(_Failure(err))
    finally:
        with _RUNNING_LOCK:
            _RUNNING.pop(threading.current_thread(), None)


@atexit.register
def _stop_all() -> None:
    """At exit, stop every prefetch thread and wait (bounded; less if blocked on its source)."""
    with _RUNNING_LOCK:
        running = list(_RUNNING.items())
    for _, channel in running:
        channel.close()
    now = time.monotonic()
    for thread, channel in running:
        wait = _EXIT_WAIT_S if channel.placing else _EXIT_SOURCE_WAIT_S
        thread.join(max(0.0, now + wait - time.monotonic()))


class Prefetcher(Iterator[Any], contextlib.AbstractContextManager):
    """Iterator over placed elements, filled by a background thread (a context manager).

    Leaving without closing is safe: the thread stops once the Prefetcher is collected.
    """

    def __init__(self, iterator: Iterable[Any], size: int, place: Callable[[Any], Any]):
        try:
            items = iter(iterator)
        except TypeError:  # was JAX-free but bare: "'int' object is not iterable"
            raise UsageError(
                f"`iterator` must be an iterable of batches (a generator, a list, a data "
                f"loader), got {type(iterator).__name__}."
            ) from None
        self._channel = _Channel(size)
        self._done = False
        self.thread = threading.Thread(
            target=_produce,
            args=(items, place, self._channel),
            name="jaxdev-prefetch",
            daemon=True,
        )
        weakref.finalize(self, self._channel.close)
        with _RUNNING_LOCK:
            _RUNNING[self.thread] = self._channel
        self.thread.start()

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        start = _timeline.start()
        item = self._channel.get()
        if start:  # a step meter: the host waited for input until now
            _timeline.host("input", start)
        if item is _END or isinstance(item, _Failure):
            # The thread has ended, or is being stopped by close(): no join here.
            self._done = True
            self._channel.close()
            if item is _END:
                raise StopIteration
            raise item.error
        return item

    def close(self, timeout: float = 5.0) -> None:
        """Stop the background thread and drop queued elements (from any thread; waits ``timeout``).

        A consumer waiting in ``next`` gets ``StopIteration``; a thread stuck in the source's
        ``next`` finishes that call in the background. The source itself is not closed.
        """
        self._done = True
        self._channel.close()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout)

    def __exit__(self, *exc: Any) -> None:
        self.close()


def prefetch_to_device(
    iterator: Iterable[Any],
    size: int = 2,
    target: Target | None = None,
    *,
    pad: bool = False,
) -> Prefetcher:
    """Place the next ``size`` elements of ``iterator`` on device in a background thread.

    Unlike flax's ``prefetch_to_device`` (pmap layout only), any placement works: a
    ``NamedSharding`` splitting the leading axis goes through :func:`jaxdev.shard_batch`
    (checks, padding, multi-process assembly), any other target through
    :func:`jaxdev.to_device`. Each element is placed as it was when yielded (a refilled
    host buffer is copied first). Order is kept, nothing is dropped, and an exception of
    the source is re-raised in the consumer; at most ``size`` placed elements wait.

    Args:
      iterator: an iterable of pytrees (batches).
      size: how many placed elements may wait (2 overlaps one transfer with one step).
      target: a batch sharding, another ``Sharding``, a device or spec; default
        ``jaxdev.batch_sharding(jaxdev.data_mesh())``. A bare ``Mesh`` is refused.
      pad: pad each batch to a multiple of the devices (elements become :class:`Padded`).

    Raises:
      ShardingError: ``size`` is not a positive int, ``target`` is a bare ``Mesh``, or
        ``pad`` with a target that does not split the batch.
      UsageError: ``iterator`` is not iterable.

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
    if isinstance(target, Mesh):
        raise ShardingError(
            "`target` is a Mesh, which as a placement target means a full copy of every "
            "batch on each device. To split each batch over the mesh pass "
            "`jaxdev.batch_sharding(mesh)`; to replicate, `jaxdev.as_sharding(mesh)`."
        )
    s = batch_sharding(check_mesh(None)) if target is None else as_sharding(target)
    rows = s.spec.partitions[:1] if isinstance(s, NamedSharding) else ()  # reduced: indexable
    if rows and rows[0] is not None and not s.spec.unreduced:  # splits rows (unreduced: named)
        split = functools.partial(shard_batch, mesh=s.mesh, pad=pad, axis=rows[0])
        return Prefetcher(iterator, size, split)
    if pad:
        raise ShardingError(
            "`pad=True` needs a `target` that splits the batch's leading axis, such as "
            f"`jaxdev.batch_sharding(mesh)`; got {target!r}."
        )
    return Prefetcher(iterator, size, functools.partial(to_device, target=s))
