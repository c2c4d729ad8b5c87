"""The roles a peer's one step loop (Peer.steps) runs in: what a step's rows, reduction and round
are for a plain peer (Solo, here) and for a rank of a host group (HostGroup, swarm/group/runner.py).
A role reaches the peer only through its public interface (docs/design.md, "The house")."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol

import torch

if TYPE_CHECKING:
    from .node import Peer

__all__ = ["Role", "Solo"]


class Role(Protocol):
    """Where a peer's step gets its rows, its reduced gradient and its round (Peer.steps)."""
    gossips: bool  # it compresses and sends the step's payload (a plain peer, a host group's leader)
    prefetch: bool  # the next step's rows may be pulled while this step's round completes
    # in place on the training thread, after backward: the gradient the payload carries (None: as is)
    reducer: Callable[[torch.Tensor], None] | None
    ranks: int  # processes whose samples one payload of this role carries (a host group's size)

    async def begin(self) -> bool: ...  # before the first step; False: do not train

    async def command(self) -> "int | str": ...  # the step to take, RESYNC or STOP

    async def resync(self) -> None: ...

    async def pull(self, want: dict) -> tuple[dict, dict]: ...

    # the prefetch ``fut`` (a pull) was started: return once the step may go on beside it
    async def prefetch_started(self, fut) -> None: ...

    async def push(self, row_grads: dict, missing: dict, step: int) -> None: ...

    async def round(self, step: int) -> None: ...  # take round ``step`` and step the replica

    async def end(self) -> None: ...


class Solo:
    """A plain peer's role: its own rows over HTTP, its own gradient, its own payload and round."""
    gossips = True
    prefetch = True
    reducer = None  # one process: its gradient is the peer's
    ranks = 1

    def __init__(self, peer: Peer):
        self.peer = peer

    async def begin(self) -> bool:
        await self.peer.until_ready()
        return not self.peer.stopping

    async def command(self) -> int | str:
        return self.peer.next_step()

    async def resync(self) -> None:
        await self.peer.resync()

    async def pull(self, want: dict) -> tuple[dict, dict]:
        return await self.peer.table_client.pull(want)

    async def prefetch_started(self, fut) -> None:
        return None  # HTTP only: it travels beside the rest of the step

    async def push(self, row_grads: dict, missing: dict, step: int) -> None:
        await self.peer.push_rows(row_grads, missing, step)

    async def round(self, step: int) -> None:
        await self.peer.take_round(step)

    async def end(self) -> None:
        return None
