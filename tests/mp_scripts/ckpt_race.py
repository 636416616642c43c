"""A reader racing a writer of the same checkpoint (tests/test_checkpoint_edges.py).

Usage: ``python ckpt_race.py DIR READS``. For each way of writing
(``exchange``: ``save(overwrite=True)`` swapping with ``renameat2``;
``fallback``: the two renames; ``keep``: an asynchronous ``Checkpointer``
with ``keep=1``) a thread writes ``{w, v: all i, n: i}`` for i = 1, 2, ...
while the main thread restores ``READS`` times; prints one JSON line, per
way the count of each outcome: ``complete`` (w and v equal n), ``being
written`` (the named error), else the error's repr. Run in its own process:
reads cut short leave orbax's coroutines to be collected later on
tensorstore's threads, as unraisable exceptions pytest would pin on a later test.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import threading

import jaxdev

jaxdev.testing.use_fake_cpu_devices(2)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402


def tree(i: int) -> dict:
    return {"w": jnp.full((64, 64), float(i)), "v": np.full(1000, i, np.int32), "n": i}


def race(write, read, reads: int) -> collections.Counter:
    stop, seen = threading.Event(), collections.Counter()

    def writer() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            write(i)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        for _ in range(reads):
            try:
                back = read()
                whole = all(np.all(np.asarray(x) == back["n"]) for x in (back["w"], back["v"]))
                seen["complete" if whole else f"MIXED {back}"] += 1
            except Exception as err:  # noqa: BLE001 - counted and reported
                named = "changed while it was read" in str(err)
                ours = isinstance(err, jaxdev.CheckpointError) and named
                seen["being written" if ours else repr(err)] += 1
    finally:
        stop.set()
        thread.join(timeout=60)
    return seen


def main(root: str, reads: int) -> None:
    out = {}
    for way in ("exchange", "fallback"):
        os.environ["JAXDEV_CHECKPOINT_NO_EXCHANGE"] = "1" if way == "fallback" else "0"
        path = os.path.join(root, way)
        jaxdev.save(path, tree(0))
        write = lambda i, path=path: jaxdev.save(path, tree(i), overwrite=True)  # noqa: E731
        out[way] = race(write, lambda path=path: jaxdev.restore(path), reads)
    with jaxdev.Checkpointer(os.path.join(root, "keep"), keep=1) as ckpt:
        ckpt.save(0, tree(0))
        ckpt.wait()
        reader = jaxdev.Checkpointer(os.path.join(root, "keep"))
        out["keep"] = race(lambda i: ckpt.save(i, tree(i)), reader.restore, reads)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
