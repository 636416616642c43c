"""A :class:`MeterReport` as a rich table, as text, and as a picture (matplotlib)."""

from __future__ import annotations

import io
from typing import Any

from .._report import figure

ROWS = {
    "step": "device computing train steps",
    "eval": "device computing eval steps",
    "input": "device idle: host waits for input",
    "sync": "device idle: host sync",
    "compile": "device idle: host compiles",
    "checkpoint": "device idle: checkpoint save",
    "other": "device idle: other host work",
}
COLORS = {"step": "tab:green", "eval": "tab:olive", "input": "tab:orange", "sync": "tab:red",
          "compile": "tab:purple", "checkpoint": "tab:blue", "other": "tab:gray"}


def summary(r: Any) -> str:
    """``N steps in W s: X steps/s, ...; FLOP/s per device, MFU``."""
    rates = ", ".join(f"{v:,.1f} {k}" for k, v in r.rates.items())
    flops = "unknown " if r.flops_per_device is None else _si(r.flops_per_device)
    mfu = "unknown" if r.mfu is None else f"{r.mfu:.1%}"
    return (f"{r.steps} steps in {r.wall:.2f} s: {rates}; {flops}FLOP/s per device; "
            f"MFU {mfu} (peak {r.peak})")


def _si(x: float) -> str:
    scale, unit = next(((f, u) for f, u in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))
                        if x >= f), (1.0, ""))
    return f"{x / scale:,.1f} {unit}"


def table(r: Any) -> Any:
    """A rich ``Table`` (each share's seconds and percent, the sync sites) over the rates."""
    from rich.console import Group
    from rich.table import Table

    t = Table(title="where the time went (jaxdev.meter)")
    for col in ("", "seconds", "share", "where"):
        right = col in ("seconds", "share")
        t.add_column(col, justify="right" if right else "left", no_wrap=not col)
    sites = sorted(r.syncs, key=lambda s: -s[2])[:3]
    notes = {"sync": "\n".join(f"{n}x {w}" for w, n, _ in sites)}
    for key, label in ROWS.items():
        if r.seconds[key] > 0 or key == "step":
            share = r.seconds[key] / r.wall if r.wall else 0.0
            secs = r.seconds[key]  # a share under half a millisecond is not 0.000 s
            secs = f"{secs:.3f}" if secs >= 5e-4 or not secs else "<0.001"
            t.add_row(label, secs, f"{share:.1%}", notes.get(key, ""))
    return Group(t, summary(r))


def text(r: Any) -> str:
    from rich.console import Console

    out = io.StringIO()
    Console(file=out, width=120, highlight=False, markup=False).print(table(r))
    return out.getvalue().rstrip()


def plot(r: Any, path: str) -> str:
    """The last steps' lanes (device; host input, sync, compile, checkpoint, eval) above a
    stacked bar of the shares; returns the file written."""
    fig, path = figure(path, figsize=(9, 4.2))  # no pyplot: the user's backend is untouched
    top, bar = fig.subplots(2, 1, height_ratios=(3, 1))
    lanes = ["device step", "device eval", "input", "sync", "compile", "checkpoint", "eval"]
    lanes = [lane for lane in lanes if any(x[0] == lane for x in r.lanes)] or ["device step"]
    for y, lane in enumerate(lanes):
        spans = [(s, e - s) for name, s, e in r.lanes if name == lane]
        color = COLORS[lane.split()[-1]] if lane != "eval" else "tab:cyan"
        top.broken_barh(spans, (y - 0.4, 0.8), color=color)
    top.set_yticks(range(len(lanes)), [lane if " " in lane else "host " + lane for lane in lanes])
    top.invert_yaxis()
    top.set_xlabel("seconds into the metered block")
    top.set_title("the last steps: device lanes, and what the host did")
    left = 0.0
    for key in ROWS:
        share = r.seconds[key] / r.wall if r.wall else 0.0
        if share > 0:
            bar.barh(0, share, left=left, color=COLORS[key], label=f"{key} {share:.1%}")
            left += share
    bar.set_xlim(0, 1)
    bar.set_yticks([])
    bar.set_xlabel("share of wall time")
    bar.legend(ncol=7, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.9), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    return path
