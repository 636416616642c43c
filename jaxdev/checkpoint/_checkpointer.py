"""``Checkpointer`` (README, "Training loops"); a step ``keep`` drops is renamed into
``.jaxdev-deleted/`` (orbax's ``todelete_subdir``), deleted there, again after a kill.
A step whose files are damaged (``_ckpt_files.damage``, or its digest) is not a step."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import time
import weakref
from typing import Any

import jax

from .. import _timeline
from .._errors import CheckpointError
from . import _checkpoint as ckpt
from . import _ckpt_files as files

_log = logging.getLogger("jaxdev")


class Checkpointer:
    """Numbered checkpoints for a training loop: a thin layer over orbax's ``CheckpointManager``.

    ``save(step, state)`` writes ``directory/<step>`` every ``every`` steps and
    keeps the ``keep`` newest; with ``async_`` it returns once the arrays are
    copied off the devices. A checkpoint appears (and ``latest_step`` sees it)
    only once complete, so a process killed mid-save leaves the previous one.
    A step whose files are damaged (truncated by a power cut with
    ``durable=False``, say) is skipped with a warning (logger ``jaxdev``):
    ``restore()`` falls back to the newest complete step, and the next save
    deletes the damaged one, so ``keep`` never counts it.

    Args:
      directory: where the numbered checkpoints go (created if missing).
      keep: how many newest checkpoints to keep (``None``: all).
      every: save only steps that are multiples of ``every`` (orbax's
        ``save_interval_steps``): the first save into an empty directory
        always happens; ``force=True`` saves any step.
      async_: write in the background (``wait()`` blocks until done).
      durable: fsync every file and folder of a step before the rename that
        commits it, so before ``keep`` deletes an older one (``False``: faster,
        safe against a killed process but not a power cut), as :func:`jaxdev.save`.

    Example:
      >>> import tempfile, jax.numpy as jnp, optax, jaxdev
      >>> state = jaxdev.TrainState.create({"w": jnp.ones(2)}, optax.sgd(0.1))
      >>> with jaxdev.Checkpointer(tempfile.mkdtemp(), every=10) as ckpt:
      ...     ckpt.save(10, state), ckpt.save(15, state)
      ...     ckpt.wait()
      ...     back = ckpt.restore(state)
      (True, False)
      >>> type(back).__name__, ckpt.latest_step()
      ('TrainState', 10)
    """

    def __init__(
        self,
        directory: Any,
        keep: int | None = 3,
        every: int = 1,
        async_: bool = True,
        durable: bool = True,
    ) -> None:
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise CheckpointError(f"`keep` must be a positive int or None, got {keep!r}.")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise CheckpointError(f"`every` must be a positive int, got {every!r}.")
        self.directory = os.path.abspath(os.fsdecode(directory))
        self._started: set[int] = set()
        self._lock, self._durable = None, ckpt.check_durable(durable)
        self._digests: dict[tuple, str | None] = {}  # (step, metadata file's stat): problem
        self._warned: set[tuple[int, str]] = set()
        self._unreadable: dict[int, str] = {}  # steps a read found damaged: why
        ocp = ckpt.orbax()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            save_interval_steps=every,
            enable_async_checkpointing=async_,
            create=True,
            todelete_subdir=files.TOMBSTONES,
            async_options=ckpt.handler_options(),
            temporary_path_class=files.path_class(ocp, self._durable),
        )
        try:  # item handlers follow the args of each save / restore (Composite)
            self._manager = ocp.CheckpointManager(self.directory, options=options)
        except OSError as err:
            raise ckpt.write_error(self.directory, err, previous="nothing was changed") from err

    @_timeline.span("checkpoint")  # a step meter's checkpoint share: the save's own time
    def save(self, step: int, state: Any, metrics: Any = None, force: bool = False) -> bool:
        """Save ``state`` (and ``metrics``: a ``Collection``, ``DeviceLog``, any tree) as ``step``.

        Args:
          step: the step number (the directory name): a non-negative int (a numpy
            integer, or a 0-d integer array such as ``state.step``), not below the latest.
          state: the tree to save (e.g. a ``TrainState``).
          metrics: an optional second tree saved alongside.
          force: save even when ``step`` is not a multiple of ``every``.

        Returns:
          True if a save started; False when ``step`` was skipped: not a
          multiple of ``every``, or already saved by this ``Checkpointer``.

        Raises:
          CheckpointError: as README says (``state`` and the earlier checkpoints unchanged).
          UsageError: ``step`` is not a non-negative int (a bool, float, str).

        Example:
          >>> import tempfile, jax.numpy as jnp, jaxdev
          >>> with jaxdev.Checkpointer(tempfile.mkdtemp(), async_=False) as ckpt:
          ...     ckpt.save(1, {"w": jnp.ones(2)})
          True
        """
        step = ckpt.check_step(step)
        if self._lock is None:  # first save: become the one writer, then see the folder anew
            self._become_writer()
        if step in self._started:
            return False  # this run saved it already: the same state (e.g. epoch end and finish)
        known = {*self._started, *self._manager.all_steps()}  # no I/O: a loop calls this per step
        if not force and step > max(known, default=-1) and not self._manager.should_save(step):
            return False
        if self._lock.held:
            self._drop_damaged()
        done = {*self._started, *self._listed(complete=True)}
        latest = max(done, default=None)
        if step in done:  # a silent skip here lost every checkpoint of a second run
            raise CheckpointError(
                f"Cannot save step {step} in {self.directory}: a checkpoint of step {step} is "
                f"already there (steps {sorted(done)[-5:]}), written before this Checkpointer, "
                "and a checkpoint is never overwritten (`force` only skips the `every` check). "
                f"A run that goes on from this folder restores first (restore() gives step "
                f"{latest}) and saves the steps after it; a new run saves into a new directory."
            )
        if latest is not None and step < latest:
            raise CheckpointError(
                f"Cannot save step {step} in {self.directory}: step {latest} is already there, "
                f"and the latest checkpoint is the highest step (restore() would resume from "
                f"{latest}, and `keep` would delete the newer state first). To go on from an "
                f"earlier step, save into a new directory, or move the steps after {step} "
                "out of this one yourself."
            )
        if not force and not self._manager.should_save(step):
            return False
        if theirs := files.lookalikes(self.directory, {step, *done}):
            raise CheckpointError(
                f"Cannot save step {step} in {self.directory}: it holds {theirs[:10]}, which orbax "
                "takes for a step's unfinished save and deletes in place of that step when `keep` "
                "drops it. Rename them or move them out, or use another directory."
            )
        self._refuse_foreign()
        prepared = ckpt.prepare(state, "state")
        extra = None if metrics is None else ckpt.prepare(metrics, "metrics")
        path = os.path.join(self.directory, str(step))
        try:
            args = ckpt.composite(prepared, step, extra)
            started = self._manager.save(step, args=args, force=True)
        except (OSError, ValueError, RuntimeError) as err:
            raise self._failed(path, err, ckpt.nbytes(prepared, extra)) from err
        if started:
            self._started.add(step)
        if self._lock.held:  # the steps the previous save (or this one, if sync) dropped
            files.remove_tombstones(self.directory, False, self._durable)
        return bool(started)

    def _become_writer(self) -> None:
        """Take the folder's writer lock (released by close(), or when this object is collected)."""
        lock_path = os.path.join(self.directory, ckpt.MANAGER_LOCK)
        self._lock = ckpt.take_writer_lock(lock_path, f"Checkpoint directory {self.directory}")
        weakref.finalize(self, _abandon, self._manager, self._lock)
        if self._lock.held:
            files.remove_tombstones(self.directory, True, self._durable)  # a kill cut one short
        self._manager.reload()
        try:
            self._refuse_foreign()
        except CheckpointError:
            self.close()
            raise

    def _refuse_foreign(self) -> None:
        """Raise if orbax lists a numbered folder jaxdev did not write (``keep`` deletes them)."""
        mine = lambda: [s for s in self._manager.all_steps() if s not in self._started]  # noqa
        if [s for s in mine() if not self._is_ours(s)]:  # listed earlier: still there?
            self._manager.reload()
        if foreign := [s for s in mine() if not self._is_ours(s)]:
            raise CheckpointError(
                f"Checkpoint directory {self.directory} holds numbered folders that jaxdev did "
                f"not write ({sorted(foreign)[:10]}): a Checkpointer would take them for steps "
                "and delete them when `keep` is reached. Move them out, or use another "
                "directory."
            )

    def _is_ours(self, step: int) -> bool:
        return files.is_checkpoint(os.path.join(self.directory, str(step)))

    def _damage(self, step: int) -> str | None:
        """What is damaged in ``step`` (None: complete); said once per damage, as a warning."""
        path = os.path.join(self.directory, str(step))
        meta = os.path.join(path, files.META_FILE)
        try:
            if (why := files.damage(path)) is None:
                st = os.stat(meta)  # one stat: a rewrite between two would mix them in a key
                key = (step, st.st_ino, st.st_dev, st.st_mtime_ns)
                if key not in self._digests:  # a big leaf table's digest costs: once a file
                    with open(meta, "rb") as f:
                        self._digests[key] = ckpt.digest_problem(json.loads(f.read()))
                why = self._digests[key]
        except (OSError, ValueError) as err:
            why = f"jaxdev/metadata: {type(err).__name__}: {err}"
        why = why or self._unreadable.get(step)
        if why and os.path.isdir(path) and (step, why) not in self._warned:  # not gone (`keep`)
            self._warned.add((step, why))
            _log.warning("step %d of %s is damaged, skipped: %s", step, self.directory, why)
        return why

    def _drop_damaged(self) -> None:
        """The writer, before a save: damaged steps are deleted, so ``keep`` never counts them."""
        graves = os.path.join(self.directory, files.TOMBSTONES)
        for s in (bad := [s for s in self._listed() if self._damage(s)]):
            os.makedirs(graves, exist_ok=True)
            os.rename(os.path.join(self.directory, str(s)), os.path.join(graves, str(s)))
            self._unreadable.pop(s, None)
            _log.warning("deleting the damaged step %d of %s", s, self.directory)
        if bad:
            files.remove_tombstones(self.directory, False, self._durable)
            self._manager.reload()

    def _failed(self, path: str, err: BaseException, need: int | None = None) -> CheckpointError:
        """A write error; steps whose asynchronous save never completed may be saved again."""
        self._manager.reload()
        done = set(self._manager.all_steps())
        newest = max(done, default=-1)  # a step below it that is gone was deleted by `keep`
        lost = sorted(s for s in self._started - done if s > newest)
        self._started &= done
        if lost and path != os.path.join(self.directory, str(lost[-1])):
            path = f"{path} (the failure was in the background save of step(s) {lost})"
        steps = self.all_steps()
        intact = f"the checkpoints of steps {steps} are intact" if steps else "no checkpoint exists"
        return ckpt.write_error(path, err, previous=intact, need=need)

    def latest_step(self) -> int | None:
        """The highest step with a complete checkpoint (None when there is none).

        Example:
          >>> import tempfile, jaxdev
          >>> jaxdev.Checkpointer(tempfile.mkdtemp()).latest_step() is None
          True
        """
        return max(self._listed(complete=True), default=None)

    def all_steps(self) -> list[int]:
        """Steps of every complete checkpoint, oldest first.

        Example:
          >>> import tempfile, jaxdev
          >>> jaxdev.Checkpointer(tempfile.mkdtemp()).all_steps()
          []
        """
        return sorted(self._listed(complete=True))

    def _listed(self, complete: bool = False) -> list[int]:
        """jaxdev checkpoints orbax lists (``complete``: not damaged either). A reader racing a
        writer lists again (5 tries) while it finds none, or only damaged ones while a writer
        holds the directory: `keep` deletes the old step as the new one commits, and a listing
        can see the one but not yet the other."""
        if self._lock is not None:
            ours = [s for s in self._manager.all_steps() if self._is_ours(s)]
            return [s for s in ours if not (complete and self._damage(s))]
        found: list[int] = []
        writing = self._writing()
        for attempt in range(5):
            with contextlib.suppress(OSError):
                self._manager.reload()
                listed = self._manager.all_steps()
                ours = [s for s in listed if self._is_ours(s)]
                found = [s for s in ours if not (complete and self._damage(s))]
                if found or not (listed or writing) or (ours and not self._writing()):
                    return found
            time.sleep(0.02 * (attempt + 1))
        return found

    def _writing(self) -> bool:
        return files.holder(os.path.join(self.directory, ckpt.MANAGER_LOCK)) is not None

    def _step(self, step: int | None) -> int:
        if step is None:
            self.wait()
            step = self.latest_step()
            if step is None:
                bad = "; ".join(f"step {s}: {w}" for s in self._listed() if (w := self._damage(s)))
                raise CheckpointError(
                    f"No checkpoint in {self.directory}: nothing has been saved there yet "
                    "(check the directory; `latest_step()` is None)."
                    if not bad
                    else f"No complete checkpoint in {self.directory}, every step is damaged: "
                    f"{bad}. Restore a copy from elsewhere, or start a new run."
                )
        elif ckpt.check_step(step) not in self._listed():
            raise CheckpointError(
                f"No checkpoint for step {step} in {self.directory}; complete steps: "
                f"{self.all_steps()}."
            )
        elif why := self._damage(int(step)):
            raise CheckpointError(
                f"The checkpoint of step {step} in {self.directory} is damaged: {why}. Restore "
                f"an earlier step (complete steps: {self.all_steps()})."
            )
        return int(step)

    def _read(self, step: int | None, item: str, target: Any, rules: Any) -> Any:
        def read(path: str) -> Any:
            at = int(os.path.basename(path))
            reader = functools.partial(self._manager.restore, at)
            try:
                return ckpt.restore_item(path, reader, item, target, rules, item)
            except ckpt.Damaged as err:  # what the cheap check cannot see: not a step from now
                self._unreadable[at] = str(err)
                raise

        # the latest step again if `keep` deleted it mid-read; a step asked for: its error
        locate = lambda: os.path.join(self.directory, str(self._step(step)))  # noqa: E731
        while True:  # the latest: each damaged step found is skipped, until none is left
            try:
                return ckpt.read_unchanged(locate, read)
            except ckpt.Damaged:
                if step is not None or jax.process_count() > 1:  # one process may see it alone
                    raise

    def restore(
        self, target: Any = None, step: int | None = None, *, rules: Any = None, **rule_options: Any
    ) -> Any:
        """Restore the state of ``step`` (default: the latest) onto ``target``.

        ``target``, ``rules`` and ``rule_options`` are :func:`jaxdev.restore`'s. ``step``
        defaults to :meth:`latest_step` (after :meth:`wait`); a step whose read finds it
        damaged is skipped from then on, for the one before (said on the ``jaxdev``
        logger; one process only). The metrics: :meth:`restore_metrics`.

        Example:
          >>> import tempfile, jax.numpy as jnp, jaxdev
          >>> with jaxdev.Checkpointer(tempfile.mkdtemp()) as ckpt:
          ...     _ = ckpt.save(3, {"w": jnp.ones(2)})
          ...     ckpt.restore("cpu:1")["w"].devices() == {jaxdev.d2l.cpu(1)}
          True
        """
        return self._read(step, ckpt.STATE, target, ckpt.rule_set(rules, rule_options))

    def restore_metrics(self, target: Any = None, step: int | None = None) -> Any:
        """Restore the metrics saved with ``step`` (default: the latest); None if none were.

        Example:
          >>> import tempfile, jax.numpy as jnp, jaxdev
          >>> from jaxdev.metrics import Collection, Mean
          >>> m = Collection.from_values({"loss": Mean}, {"loss": jnp.ones(4)})
          >>> with jaxdev.Checkpointer(tempfile.mkdtemp()) as ckpt:
          ...     _ = ckpt.save(1, {"w": jnp.ones(2)}, metrics=m)
          ...     float(ckpt.restore_metrics()["loss"].compute())
          1.0
        """
        return self._read(step, ckpt.METRICS, target, None)

    def wait(self) -> None:
        """Block until every asynchronous save has finished (and report its failure).

        Example:
          >>> import tempfile, jaxdev
          >>> jaxdev.Checkpointer(tempfile.mkdtemp()).wait()
        """
        try:
            self._manager.wait_until_finished()
        except (OSError, ValueError, RuntimeError) as err:
            raise self._failed(self.directory, err) from err

    def close(self) -> None:
        """Wait for pending saves, release orbax's resources and the writer lock.

        Example:
          >>> import tempfile, jaxdev
          >>> jaxdev.Checkpointer(tempfile.mkdtemp()).close()
        """
        try:
            self.wait()
        finally:
            self._manager.close()
            if self._lock is not None:
                if self._lock.held:
                    files.remove_tombstones(self.directory, True, self._durable)
                self._lock.release()
                self._lock = None

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Checkpointer({self.directory!r}, steps={self.all_steps()})"


def _abandon(manager: Any, lock: files.WriterLock) -> None:
    """A Checkpointer collected without close(): finish its saves, then free the folder."""
    try:
        with contextlib.suppress(Exception):  # collected: nobody to report to
            manager.wait_until_finished()
            manager.close()
    finally:
        lock.release()
