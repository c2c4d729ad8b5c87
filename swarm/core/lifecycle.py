"""A peer's lifecycle as explicit states, and the decisions that move it: the --min-peers gate
(start, keep waiting, or join a swarm that is already training) and when lingering may end.

Sans-I/O: time comes in as ``now``; members as their parsed metadata (core/meta.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Mapping

from .meta import PeerMeta

__all__ = ["STOP", "RESYNC", "State", "TRANSITIONS", "Lifecycle", "LifecycleError", "MinPeersGate", "Start", "Wait", "JoinTraining",
           "TRAINING_GRACE", "linger_over"]

STOP, RESYNC = "stop", "resync"  # what a step loop's role says besides the step to take (node.Role.command)
TRAINING_GRACE = 3.0  # seconds a peer waiting for --min-peers gives the count before it joins a training swarm


class State(str, enum.Enum):
    STARTING = "starting"  # building the replica, agreeing settings, joining
    WAITING = "waiting"  # for --min-peers
    SYNCING = "syncing"  # downloading state and replaying rounds before it contributes
    TRAINING = "training"  # contributing a payload every round
    RESYNCING = "resyncing"  # fell behind or diverged: syncing state again
    FINISHING = "finishing"  # its steps are done: final evaluation, checkpoint, lingering
    LEFT = "left"  # said goodbye (or stopped): serves nothing more


TRANSITIONS: dict[State, frozenset[State]] = {
    State.STARTING: frozenset({State.WAITING, State.SYNCING, State.TRAINING, State.FINISHING, State.LEFT}),
    State.WAITING: frozenset({State.SYNCING, State.TRAINING, State.FINISHING, State.LEFT}),
    State.SYNCING: frozenset({State.TRAINING, State.FINISHING, State.LEFT}),
    State.TRAINING: frozenset({State.RESYNCING, State.FINISHING, State.LEFT}),
    State.RESYNCING: frozenset({State.SYNCING, State.TRAINING, State.FINISHING, State.LEFT}),
    State.FINISHING: frozenset({State.LEFT}),
    State.LEFT: frozenset(),
}


class LifecycleError(RuntimeError):
    """A transition the lifecycle does not allow (a bug in the loop, not bad input)."""


class Lifecycle:
    """The current state and when it was entered; a move the table above does not allow raises."""

    def __init__(self, now: float) -> None:
        self.state = State.STARTING
        self.since = now
        self.history: list[tuple[State, float]] = [(State.STARTING, now)]

    def to(self, state: State, now: float) -> None:
        if state == self.state:
            return
        if state not in TRANSITIONS[self.state]:
            raise LifecycleError(f"a peer cannot go from {self.state.value} to {state.value}")
        self.state, self.since = state, now
        self.history.append((state, now))
        del self.history[:-32]


@dataclass(frozen=True)
class Start:
    """Enough contributors: start training at step 0."""


@dataclass(frozen=True)
class Wait:
    """Not enough contributors yet, and nobody is training: ask again shortly."""


@dataclass(frozen=True)
class JoinTraining:
    """The swarm went ahead without us (fewer than --min-peers): join its training at ``step``
    (a state sync) instead of waiting and splitting the swarm in two."""
    step: int


class MinPeersGate:
    """The --min-peers wait. Counts contributors as the status page does (a host group is one: its
    leader), this peer included. A peer that counted enough peers starts a moment before the gossip
    shows them all to us, so at step 0 a training swarm is given TRAINING_GRACE seconds; past step
    0 it is training for certain."""

    def __init__(self, min_peers: int, grace: float = TRAINING_GRACE) -> None:
        self.min_peers = min_peers
        self.grace = grace
        self.seen_training: float | None = None

    def decide(self, alive: Mapping[str, PeerMeta], now: float) -> Start | Wait | JoinTraining:
        """``alive``: the other alive members' metadata."""
        others = [m for m in alive.values() if m.contributor]
        if 1 + len(others) >= self.min_peers:
            return Start()
        training = [m for m in others if m.run]
        if not training:
            return Wait()
        if self.seen_training is None:
            self.seen_training = now
        step = max(m.step for m in training)
        if step > 0 or now - self.seen_training > self.grace:
            return JoinTraining(step)
        return Wait()


def winding_down(me: PeerMeta, live: Mapping[str, PeerMeta]) -> bool:
    """We have finished our steps and evaluated, and so has every other live peer that still
    trains or evaluates (linger_over): nobody will read a table row again, so the slots that a
    peer's leaving hands us are not worth fetching (at the end of a run the first peer to leave
    made every other peer fetch its share of the tables on the way out: 1.1 MB a peer in one
    bench/wan.py run)."""
    return me.done and linger_over(live)


def linger_over(live: Mapping[str, PeerMeta]) -> bool:
    """After its steps a peer keeps serving rows until every live contributor, and every rank of a
    host group (they evaluate too, though only their leader gossips), has said it is done."""
    return all(m.done or not (m.active or m.follower) for m in live.values())
