"""Side-by-side timing: warm-up, interleaved repetitions, medians."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable


class Timings(dict):
    """Per-name lists of seconds, one entry per repetition, taken interleaved."""

    def median(self, name: str) -> float:
        """Median seconds of ``name``."""
        return statistics.median(self[name])

    def ratio(self, a: str, b: str) -> float:
        """Median over repetitions of ``time(a) / time(b)``.

        Each repetition's pair ran moments apart, so load from other
        processes cancels out better than in a ratio of medians.
        """
        return statistics.median(x / y for x, y in zip(self[a], self[b]))


def time_side_by_side(
    fns: dict[str, Callable[[], object]],
    repeats: int = 20,
    warmup: int = 2,
    after: Callable[[], object] | None = None,
) -> Timings:
    """Time zero-argument callables side by side (jaxdev's one timer, kept per repetition).

    Every callable runs ``warmup`` times first (compilation, caches). Then the
    repetitions interleave the callables, rotating which goes first, so slow
    drifts of the machine hit all of them alike. Each timing waits for the
    result with ``jax.block_until_ready``; ``after()`` runs untimed after each call.
    """
    from jaxdev.cli._bench import sample_side_by_side

    return Timings(sample_side_by_side(fns, repeats, warmup=warmup, after=after))


def report(rows: list[dict], median: tuple[str, str], json_path: str | None = None) -> None:
    """Print ratio ``rows`` as a markdown table; write them as JSON if asked.

    Every row has ``what``, ``variant``, ``ratio_vs``, ``ratio``, ``target``,
    ``met`` and a median column, named by ``median = (key, header)``.
    """
    columns = {"what": "what", "variant": "variant", median[0]: median[1], "ratio_vs": "vs"}
    columns |= {"ratio": "ratio", "target": "target", "met": "met"}
    print("| " + " | ".join(columns.values()) + " |")
    print("|" + "---|" * len(columns))
    for r in rows:
        print("| " + " | ".join(str(r[k]) for k in columns) + " |")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=2)
