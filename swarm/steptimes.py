"""Where a peer's step time goes: wall seconds per phase of each training step, kept for the last
few hundred steps. The summary and /api/status report them, so a slow swarm shows whether it waits
on the network (rows, the round) or computes."""

from __future__ import annotations

import collections
import statistics
import time

# in step order; "rows", "held" and "round" are waits on other peers, the rest is this peer's own work
# ("held": with local steps, the part of sending a window that its row pushes' primaries held them
# for the other contributors' pushes of the window, tables/http.py PushBatcher)
PHASES = ("rows", "compute", "send", "held", "round", "apply", "after")
WAITS = ("rows", "held", "round")


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

    def move(self, src: str, dst: str, seconds: float) -> None:
        """Re-file up to ``seconds`` of this step's ``src`` time as ``dst``: a wait found out only
        after its phase was marked (how long a primary held our pushes comes with its answer)."""
        moved = min(max(0.0, seconds), self._step.get(src, 0.0))
        if moved > 0:
            self._step[src] -= moved
            self._step[dst] = self._step.get(dst, 0.0) + moved

    def end(self) -> None:
        """The step is complete: file its phases (a phase it did not pass through counts 0)."""
        for p in PHASES:
            self.series[p].append(self._step.get(p, 0.0))
        self._step = {}

    def report(self) -> dict:
        """Median and mean milliseconds per phase over the kept steps, and the share of the step
        spent waiting on other peers (rows + held + round, over all phases; means)."""
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
