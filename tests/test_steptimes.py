"""swarm/steptimes.py: a step's wall time split by phase, and the share spent waiting on peers."""

from __future__ import annotations

from swarm import steptimes
from swarm.steptimes import PHASES, StepTimes


def test_phases_are_split_at_the_marks_and_the_wait_share_is_rows_held_and_round(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(steptimes.time, "monotonic", lambda: now[0])
    clock = StepTimes(keep=2)
    assert clock.report() == {"steps": 0}
    for _ in range(3):  # only the last 2 steps are kept
        clock.start()
        for phase, secs in (("rows", 0.01), ("compute", 0.3), ("send", 0.05), ("round", 0.09), ("apply", 0.08)):
            now[0] += secs
            clock.mark(phase)
        clock.move("send", "held", 0.03)  # of the send, 30 ms were a primary holding our push for others'
        clock.end()  # "after" not passed through: 0
    r = clock.report()
    assert r["steps"] == 2 and set(r) == {"steps", "wait_share", *PHASES}
    assert r["compute"] == {"median_ms": 300.0, "mean_ms": 300.0} and r["after"]["mean_ms"] == 0.0
    assert r["send"]["mean_ms"] == 20.0 and r["held"]["mean_ms"] == 30.0
    assert r["wait_share"] == round((10 + 30 + 90) / 530, 3)


def test_a_moved_wait_is_capped_by_the_phase_it_comes_from(monkeypatch):
    """StepTimes.move re-files at most what the source phase holds this step, and nothing negative."""
    now = [0.0]
    monkeypatch.setattr(steptimes.time, "monotonic", lambda: now[0])
    clock = StepTimes()
    clock.start()
    now[0] += 0.02
    clock.mark("send")
    clock.move("send", "held", 5.0)
    clock.move("send", "held", -1.0)
    clock.move("round", "held", 1.0)  # not passed through this step: nothing to move
    clock.end()
    r = clock.report()
    assert r["send"]["mean_ms"] == 0.0 and r["held"]["mean_ms"] == 20.0 and r["round"]["mean_ms"] == 0.0


def test_a_phase_passed_twice_in_one_step_adds_up(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(steptimes.time, "monotonic", lambda: now[0])
    clock = StepTimes()
    clock.start()
    now[0] += 0.1
    clock.mark("round")
    now[0] += 0.05
    clock.mark("round")
    clock.end()
    assert clock.report()["round"]["mean_ms"] == 150.0
    assert clock.report()["wait_share"] == 1.0
