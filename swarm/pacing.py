"""This peer's side of core/cadence.py: which rounds it sends a payload for, what it sums between
two of them, and whether it runs free of the swarm's rounds.

The rule itself is sans-I/O (core/cadence.py); this class holds the peer's state for it (its
declared next round, the gradients summed since its last payload, its pace) and reads the
membership and the round book through the peer's public interface. Methods marked *training
thread* run there (Peer.work); the others on the event loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .core import cadence

if TYPE_CHECKING:
    from .codec import Encoded
    from .node import Peer

__all__ = ["Pacing", "Send"]


@dataclass(frozen=True)
class Send:
    """What a payload of ours carries for the cap, decided on the event loop (which holds the
    membership) and encoded on the training thread."""

    next_round: int  # the round we contribute to next
    share: int = 1  # the payload carries 1/share of the entries its codec would send


class Pacing:
    """When this peer contributes, and the sum it contributes (docs/design.md, "Uneven peers and
    large swarms")."""

    def __init__(self, peer: "Peer"):
        self.peer = peer
        self.cap = peer.cfg.max_contributors
        self.pace = cadence.Pace()
        self.next_round: int | None = None  # the round we send our next payload for (None: the next one)
        self.declared_at = -1  # the round of the payload that declared it
        self._sum: torch.Tensor | None = None  # our steps' gradients since the last payload
        self._samples = 0
        self._steps = 0
        self.sent = 0  # payloads sent
        self.summed = 0  # steps whose gradients went into them

    # -- who contributes to which round ------------------------------------------------------------
    def contributor_ids(self) -> list[str]:
        """The contributing members we see (a host group counts once), ourselves included."""
        ids = [pid for pid, m in self.peer.metas().items() if m.contributor]
        return sorted(set(ids) | {self.peer.id})

    def splits_bytes(self) -> bool:
        """The cap holds by bytes (every peer every round, at 1/k of its entries) rather than by
        rounds: always in windows; per step with --cap-by bytes and a sparse codec (a dense payload
        cannot send a share of its entries)."""
        cfg = self.peer.cfg
        return cfg.sync_every > 1 or (cfg.cap_by == "bytes" and cfg.compression != "none")

    def _cap(self, contributors: int) -> tuple[int, int]:
        """(stride, share) the cap asks of us with ``contributors``: by rounds, a payload every k
        rounds (at most cadence.MAX_STRIDE) at whole size; by bytes, every round at 1/k of its
        entries, k the cap's floor(P / C) without the stride's limit, as such a payload is not a
        sum of stale steps, so a peer's payload bytes stay about C payloads' at any swarm size."""
        if self.splits_bytes():
            return 1, cadence.cap_stride(contributors, self.cap, limit=None)
        return cadence.cap_stride(contributors, self.cap), 1

    def cap_stride(self) -> int:
        """Rounds between two of our payloads that the cap asks for (1 when it holds by bytes)."""
        return self._cap(len(self.contributor_ids()))[0]

    def payload_share(self) -> int:
        """k, where our payloads carry 1/k of the entries their codec would send (1 when the cap
        holds by rounds)."""
        return self._cap(len(self.contributor_ids()))[1]

    def plan_next(self, after: int) -> Send:
        """What we send with round ``after``'s payload: the round we declare next (the cap's
        rotation, or further on when our compute needs it: a free-running peer) and the share of
        its entries it carries."""
        ids = self.contributor_ids()
        cap_k, share = self._cap(len(ids))
        ph = cadence.phase(self.peer.id, ids, cap_k)
        return Send(cadence.next_round(after, max(cap_k, self.pace.stride()), cap_k, ph), share)

    def due_round(self, step: int) -> int:
        """The round our next payload is for, as of taking round ``step``: the one we declared, or
        ``step`` itself when we declared none or one that has passed (a join, a re-sync)."""
        if self.next_round is None or self.next_round < step:
            self.next_round = step
        return self.next_round

    def sends_for(self, step: int) -> bool:
        """We contribute to round ``step`` (pure: what core.rounds.expected asks of us)."""
        return self.next_round is None or self.next_round <= step

    # -- pace -----------------------------------------------------------------------------------
    def free_running(self) -> bool:
        """Slower than the swarm by cadence.SLOW_FACTOR: we stop holding its rounds up."""
        if not self.peer.cfg.free_run:
            return False
        others = [m.compute_ms / 1000 for m in self.peer.metas().values() if m.contributor and m.compute_ms]
        return self.pace.update(others)

    def publish(self) -> None:
        """Tell the swarm by gossip what our payloads tell it directly: our next round, our pace."""
        ms = self.pace.step_s()
        self.peer.members.set_meta(nx=self.next_round if self.next_round is not None else self.peer.book.step,
                                   cs=self.declared_at, ms=int(ms * 1000) if ms else 0)

    def completed_at(self, rnd: int) -> float | None:
        """When round ``rnd`` became complete: its last other contributor's payload arrived (None:
        not among the last rounds recorded)."""
        for r, t in reversed(self.pace.completions):
            if r == rnd:
                return t
        return None

    # -- the sum between two payloads (training thread) -------------------------------------------
    def add(self, flat: torch.Tensor, samples: int) -> None:
        """One step's gradient (a mean over ``samples``) joins the sum; a skipped step adds nothing."""
        if samples <= 0:
            return
        if self._sum is None:
            self._sum = flat
        else:
            if self._steps == 1:
                self._sum = self._sum * float(self._samples)
            self._sum.add_(flat, alpha=float(samples))
        self._samples += samples
        self._steps += 1

    def payload(self, step: int, send: Send, n: int) -> "Encoded":
        """Round ``step``'s payload: the mean gradient of every sample since the last one, at
        ``send.share`` of its entries, saying those samples and ``send.next_round``, the round we
        contribute to next (training thread)."""
        if self._sum is None:
            mean, samples = torch.zeros(n), None  # nothing finite since the last payload: an empty update
        elif self._steps == 1:
            mean, samples = self._sum, self._samples  # one step: its gradient as it is
        else:
            mean, samples = self._sum / float(self._samples), self._samples
        self.summed += self._steps
        self._sum, self._samples, self._steps = None, 0, 0
        self.sent += 1
        self.next_round, self.declared_at = send.next_round, step
        return self.peer.compressor.compress(mean, step, samples=samples, next_round=send.next_round,
                                             share=send.share)

    @property
    def pending_steps(self) -> int:
        """Steps summed and not sent yet."""
        return self._steps

    def status(self) -> dict:
        ms = self.pace.step_s()
        per = self.pace.period()
        cap_k, share = self._cap(len(self.contributor_ids()))
        return {"max_contributors": self.cap, "next_round": self.next_round, "free_running": self.pace.free,
                "stride": max(cap_k, self.pace.stride()), "payload_share": share,
                "cap_by": "bytes" if self.splits_bytes() else "rounds",
                "pending_steps": self._steps,
                "payloads_sent": self.sent, "steps_summed": self.summed,
                "compute_ms": round(ms * 1000, 1) if ms else None,
                "round_period_ms": round(per * 1000, 1) if per else None}

    def computed(self, seconds: float) -> None:
        self.pace.computed(seconds)

    def completed(self, rnd: int, at: float | None) -> None:
        self.pace.completed(rnd, at if at is not None else time.monotonic())
