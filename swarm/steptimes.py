"""Where a peer's step time goes: wall seconds per phase of each training step, kept for the last
few hundred steps. The summary and /api/status report them, so a slow swarm shows whether it waits
on the network (rows, the round) or computes."""

from __future__ import annotations

import collections
import statistics
import time

# in step order; "rows" and "round" are waits on other peers, the rest is this peer's own work
PHASES = ("rows", "compute", "send", "round", "apply", "after")
WAITS = ("rows", "round")


class StepTimes:
    def __init__(self, keep: int = 512):
        self.keep = keep
        self.series: dict[str, collections.deque[float]] = {p: collections.deque(maxlen=keep) for p in PHASES}
        self._t = 0.0
        self._step: dict[str, float] = {}

    def start(self) -> None:
        """A step begins now."""
        self._t = time.monotonic()
        self._step = {}

    def mark(self, phase: str) -> None:
        """``phase`` ended now (it began where the previous mark, or start, left off)."""
        now = time.monotonic()
        self._step[phase] = self._step.get(phase, 0.0) + now - self._t
        self._t = now

    def end(self) -> None:
        """The step is complete: file its phases (a phase it did not pass through counts 0)."""
        for p in PHASES:
            self.series[p].append(self._step.get(p, 0.0))
        self._step = {}

    def report(self) -> dict:
        """Median and mean milliseconds per phase over the kept steps, and the share of the step
        spent waiting on other peers (rows + round, over all phases; means)."""
        n = len(self.series[PHASES[0]])
        if not n:
            return {"steps": 0}
        out: dict = {"steps": n}
        for p in PHASES:
            s = self.series[p]
            out[p] = {"median_ms": round(statistics.median(s) * 1000, 1), "mean_ms": round(sum(s) / n * 1000, 1)}
        total = sum(out[p]["mean_ms"] for p in PHASES)
        out["wait_share"] = round(sum(out[p]["mean_ms"] for p in WAITS) / total, 3) if total > 0 else None
        return out
