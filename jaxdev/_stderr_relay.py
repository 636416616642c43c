"""The far end of ``count_transfers``'s stderr pipe: copy it to the real stderr at once.

:func:`relay` passes every byte on unchanged, except JAX's transfer-guard lines (left
out unless the user asked for that log), which it reports back: ``K <aval>`` per guard
line and ``S`` once everything before a :data:`SYNC` marker is handled. It runs as its
own process (``python -I -S _stderr_relay.py 0|1``: fd 0 the pipe, fd 1 the reports,
fd 2 the real stderr; nothing from jaxdev or JAX imported), so a guarded process's last
words survive a crash; else jaxdev runs it in a thread.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys

SYNC = b"\x00jaxdev-stderr-sync\x00"  # written by the guarded process, answered with b"S\n"
READ_SIZE = 1 << 20  # >= the pipe's capacity: a read never splits one small write
GUARD_LINE = re.compile(
    rb"(?:[IWEF]\d{4} [\d:.]+ +\d+ [^\]\n]*\] )?"  # absl's header: W1123 10:58:06.5 9493 x.cc:1]
    rb"host-to-device transfer:(?: aval=(?:ShapedArray\()?([^,)\s]*))?"
)
_LINES = re.compile(rb"[^\n]*\n|[^\n]+")  # split at newlines only: "\r" belongs to progress bars


def write_all(fd: int, data: bytes) -> bool:
    """Write all of ``data`` to ``fd``; return ``False`` (data dropped) if ``fd`` is gone."""
    while data:
        try:
            data = data[os.write(fd, data) :]
        except OSError:
            return False
    return True


def relay(in_fd: int, out_fd: int, report_fd: int, swallow: bool) -> None:
    """Copy ``in_fd`` to ``out_fd`` until every write end closes, reporting on ``report_fd``.

    Closes the three descriptors when done; a closed ``out_fd`` or ``report_fd`` never
    stops the copy. ``swallow`` leaves the guard lines out.
    """
    try:
        with contextlib.suppress(OSError):
            while data := os.read(in_fd, READ_SIZE):
                *before_syncs, rest = data.split(SYNC)
                for part in before_syncs:
                    _pass_on(part, out_fd, report_fd, swallow)
                    write_all(report_fd, b"S\n")
                _pass_on(rest, out_fd, report_fd, swallow)
    finally:
        for fd in (in_fd, out_fd, report_fd):
            with contextlib.suppress(OSError):
                os.close(fd)


def _pass_on(data: bytes, out_fd: int, report_fd: int, swallow: bool) -> None:
    """``data`` to ``out_fd`` (``swallow``: less the guard records, but the text before one
    on its line, e.g. ``"\\r 50%"``, stays); ``K <aval or nothing>`` per guard line reported."""
    out, reports = [], []
    for line in _LINES.findall(data):
        if found := GUARD_LINE.search(line):
            reports.append(b"K " + (found.group(1) or b"") + b"\n")
            line = line[: found.start()] if swallow else line
        out.append(line)
    write_all(out_fd, b"".join(out))
    write_all(report_fd, b"".join(reports))


if __name__ == "__main__":  # python -I -S _stderr_relay.py 0|1 ('1' swallows); signals ignored
    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)
    relay(0, 2, 1, swallow=sys.argv[1:2] == ["1"])
