"""Run ``jaxdev demo`` and SIGKILL this process once the progress bar passes a step.

Usage: ``python demo_kill.py KILL_AT [demo flags ...]``. The demo's progress
bar is advanced after every dispatch; when its count reaches ``KILL_AT`` the
process kills itself by its own pid (no cleanup, no atexit, no flush of
pending asynchronous checkpoint writes), as a preempted node would die.
``KILL_AT`` 0 never kills.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys

from jaxdev.cli import _cli


def main() -> int:
    kill_at = int(sys.argv[1])
    progress = _cli.Ui.progress

    @contextlib.contextmanager
    def progress_then_die(self, total):
        completed = 0
        with progress(self, total) as advance:

            def advance_then_die(n, description):
                nonlocal completed
                advance(n, description)
                completed += n
                if kill_at and completed >= kill_at and description != "resumed":
                    os.kill(os.getpid(), signal.SIGKILL)

            yield advance_then_die

    _cli.Ui.progress = progress_then_die
    return _cli.main(["demo", *sys.argv[2:]])


if __name__ == "__main__":
    sys.exit(main())
