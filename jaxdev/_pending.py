"""Errors of calls that ran asynchronously, explained where they surface.

An error of a dispatched computation (XLA's out-of-memory) surfaces where its outputs
are read. A jaxdev step records each call (:func:`record`) with an explainer; jaxdev's
reads run under :func:`explained_reads` and the step's next call asks :func:`failed`
first, so each raises the explanation instead of JAX's bare error.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from ._errors import JaxdevError
from ._guards import not_counted

Explain = Callable[[BaseException, str], "BaseException | None"]
"""``explain(error, where) -> the error to raise instead`` (``None``: not one it explains)."""

_PENDING: dict[Any, tuple[Any, Explain]] = {}  # owner -> (an output, explain); oldest first
_KEEP = 8  # owners remembered


def record(owner: Any, token: Any, explain: Explain) -> None:
    """Remember ``owner``'s latest call: ``token`` (an output) and how to ``explain`` it."""
    _PENDING.pop(owner, None)
    _forget_finished()
    _PENDING[owner] = (token, explain)
    if len(_PENDING) > _KEEP:
        _PENDING.pop(next(iter(_PENDING)), None)


def _forget_finished() -> None:
    for key, (token, _) in list(_PENDING.items()):
        if token.is_ready() and _error(token) is None:
            _PENDING.pop(key, None)


def _error(token: Any) -> BaseException | None:
    """The error ``token``'s computation ended with (``None``: still running, or fine)."""
    if not token.is_ready():  # never waits: a failed computation is ready
        return None
    try:
        with not_counted():  # ready: not a wait (count_transfers / no_host_sync)
            token.block_until_ready()
    except Exception as err:
        return err
    return None


def failed(where: str, owner: Any = None) -> BaseException | None:
    """The explained error of the oldest recorded call (of ``owner``) that failed, or ``None``.

    A failed call is forgotten once asked about.
    """
    for key in list(_PENDING) if owner is None else [owner]:
        token, explain = _PENDING.get(key, (None, None))
        err = None if token is None else _error(token)
        if err is not None:
            _PENDING.pop(key, None)
            explained = explain(err, where)
            if explained is not None:
                explained.__cause__ = err
                return explained
    return None


@contextlib.contextmanager
def explained_reads(where: str) -> Iterator[None]:
    """Reading device values in this block, a recorded error is raised explained."""
    try:
        yield
    except JaxdevError:
        raise
    except Exception as err:
        explained = failed(where)
        if explained is None:
            raise
        raise explained from err
    _forget_finished()
