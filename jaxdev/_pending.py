"""Errors of calls that ran asynchronously, explained where they surface.

An error of a dispatched computation (XLA's out-of-memory) surfaces where its outputs
are read. A jaxdev step records each call (:func:`record`) with an explainer; jaxdev's
reads run under :func:`explained_reads` and the step's next call asks :func:`failed`
first, so each raises the explanation instead of JAX's bare error. A failed call is
remembered (with the 8 newest calls): every read of its (poisoned) outputs, and of what
was computed from them, is explained, however many reads or calls came first; an error
that does not carry its message (another computation's, a bug's) is left as it is.
"""

from __future__ import annotations

import collections
import contextlib
import re
from collections.abc import Callable, Iterator
from typing import Any

import jax

from ._errors import JaxdevError
from ._guards import not_counted, quiet_wait
from ._leaves import array_type, deleted

Explain = Callable[[BaseException, str], "BaseException | None"]
"""``explain(error, where) -> the error to raise instead`` (``None``: not one it explains)."""

_PENDING: dict[Any, list] = {}  # owner -> [an output, explain, raised already, watched]
_KEEP = 8  # owners remembered
_UNSEEN: collections.deque = collections.deque(maxlen=_KEEP)  # calls still running at their
# owner's next call: looked at only when a read fails (a look at a running output is costly)


def record(owner: Any, token: Any, explain: Explain) -> None:
    """Remember ``owner``'s latest call: ``token`` (an output) and how to ``explain`` it.

    Its last call was asked about by :func:`failed` as this call began: gone when it ended
    fine, raised when it failed, else still running: then kept unseen, for a read of its
    outputs that fails. A failure raised already is kept: its outputs stay poisoned, their
    reads are explained."""
    old = _PENDING.pop(owner, None)
    if old is not None and not old[2]:
        _UNSEEN.append(old)
    elif old is not None and _error(old[0]) is not None:
        _PENDING[object()] = old  # a key no step asks about
    if _PENDING:  # other steps' calls
        _forget_finished()
    _PENDING[owner] = [token, explain, False, old and old[3]]  # (look's watched output)
    if len(_PENDING) > _KEEP:
        _PENDING.pop(next(iter(_PENDING)), None)


def _forget_finished() -> None:
    for key, (token, *_) in list(_PENDING.items()):
        if deleted(token) or (token.is_ready() and _error(token) is None):
            _PENDING.pop(key, None)


def _error(token: Any, wait: bool = False) -> BaseException | None:
    """The error ``token``'s computation ended with (``None``: still running, fine, or
    deleted since: never a step's own token, a guard; nothing may look at a deleted
    array, jax 0.10.2 segfaults).

    Never waits unless ``wait`` (an error path: under pmap a read of one output can fail
    before the token, another output of the same failed call, is marked ready)."""
    if deleted(token) or (not wait and not token.is_ready()):  # a failed one is ready
        return None
    try:
        quiet_wait(token)  # ready: not a wait, past count_transfers / no_host_sync / a meter
    except Exception as err:
        return err
    return None


def look(where: str, owner: Any) -> BaseException | None:
    """``failed(where, owner)`` in a loop's few operations, at a step's next call. A loop
    runs ahead of the device: asking a queued output whether it is ready costs ~2 us the
    first time on CPU (a future is made), ~0.3 us after. So the newest call is asked once
    the one watched (an older call of ``owner``, queued when asked) is ready: calls end in
    order."""
    entry = _PENDING.get(owner)
    if entry is None or entry[2]:
        return None
    token, watched = entry[0], entry[3]
    if watched is not None and not watched.is_deleted() and not watched.is_ready():
        return None  # an older call still queued: so is the newest
    if not token.is_deleted():
        if not token.is_ready():
            entry[3] = token
            return None
        try:
            quiet_wait(token)  # ready: not a wait
        except Exception:  # it failed
            return failed(where, owner)
    _PENDING.pop(owner, None)  # ended fine, or deleted: forgotten (record has none to check)
    return None


def failed(
    where: str, owner: Any = None, again: bool = False, error: BaseException | None = None
) -> BaseException | None:
    """The explained error of a recorded call (of ``owner``) that failed, or ``None``.

    The oldest failure not raised yet; with ``again`` (a read that failed), then the newest
    raised already (its outputs stay poisoned, and a step's next call raises it once).
    With ``error`` (what a read or call raised), only a failure it comes from.
    """
    if owner is not None:  # a step's next call: its own last call, a dict lookup
        entry = _PENDING.get(owner)
        if entry is not None and error is None and not entry[2]:
            if not deleted(entry[0]) and not entry[0].is_ready():  # running: nothing to
                return None  # say yet
            if _error(entry[0], wait=True) is None:  # ready and fine, or deleted: forgotten
                _PENDING.pop(owner, None)  # (record has none to check)
                return None
        mine = [] if entry is None else [entry]
    else:  # other threads record; calls that were running at their next call, first
        mine = [*(_UNSEEN if error is not None else ()), *_PENDING.values()]
    order = [e for e in mine if not e[2]] + [e for e in mine[::-1] if again and e[2]]
    for entry in order:
        err = _error(entry[0], wait=error is not None)
        if err is not None and (error is None or _comes_from(error, err)):
            entry[2] = True
            explained = entry[1](err, where)
            if explained is not None:
                explained.__cause__ = err
                return explained
    return None


def _comes_from(error: BaseException, failure: BaseException) -> bool:
    """Whether ``error`` is ``failure`` read again, or that of a value computed from its
    outputs (``INTERNAL: Error dispatching computation: <failure's message>``): not another
    computation's error, nor a bug's."""
    message = re.sub(r"^[A-Z_]+: ", "", str(failure).strip()).splitlines()
    return bool(message) and message[0] in str(error)


def wait(token: Any) -> None:
    """Wait for a call's ``token`` (jaxdev's own bound on queued calls: no user's sync, not
    counted); its error is left to the reads and the next call."""
    with contextlib.suppress(Exception):
        quiet_wait(token)


def settle(tree: Any, where: str) -> None:
    """Wait for ``tree``'s arrays (not traced, not deleted); their error is raised explained.

    A value computed from a failed call's outputs is poisoned too ("INTERNAL: Error
    dispatching computation"), raised by a later ``float()`` that jaxdev does not see.
    """
    impl = array_type()
    live = [x for x in jax.tree.leaves(tree) if type(x) is impl and not x.is_deleted()]
    ready = all(x.is_ready() for x in live)  # then not a wait
    with explained_reads(where), not_counted() if ready else contextlib.nullcontext():
        jax.block_until_ready(live)


@contextlib.contextmanager
def explained_reads(where: str) -> Iterator[None]:
    """Reading device values in this block, a recorded error is raised explained."""
    try:
        yield
    except JaxdevError:
        raise
    except jax.errors.JaxRuntimeError as err:  # a computation's error (a bug's is another type)
        explained = failed(where, again=True, error=err)
        if explained is None:
            raise
        raise explained from err
    _forget_finished()
