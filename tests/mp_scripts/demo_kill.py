"""Run ``jaxdev demo`` and SIGKILL this process once the progress bar passes a step.

Usage: ``python demo_kill.py KILL_AT [demo flags ...]``. The demo's progress
bar is advanced after every dispatch; when its count reaches ``KILL_AT`` the
process kills itself by its own pid (no cleanup, no atexit, no flush of
pending asynchronous checkpoint writes), as a preempted node would die.
``KILL_AT`` 0 never kills.
"""

from __future__ import annotations

import os
import signal
import sys

from jaxdev.cli import _cli


def main() -> int:
    kill_at = int(sys.argv[1])
    advance = _cli._Bar.advance

    def advance_then_die(self, n, description):
        advance(self, n, description)
        if kill_at and self.completed >= kill_at and description != "resumed":
            os.kill(os.getpid(), signal.SIGKILL)

    _cli._Bar.advance = advance_then_die
    return _cli.main(["demo", *sys.argv[2:]])


if __name__ == "__main__":
    sys.exit(main())
