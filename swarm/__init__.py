"""swarm: peer-to-peer training of one PyTorch model over slow links.

The public API (README.md, "Bring your own model"; docs/task.md):

    Task, Shard          what to train: the model, its data, its loss, which embeddings to shard
    ShardedEmbedding     an embedding table too large to build whole, sharded from the start
    PeerConfig           every setting of a peer (the CLI's flags)
    Peer                 one peer: ``async with Peer(task, config) as peer: summary = await peer.run()``
    train(task, **kw)    run one peer to the end and return its summary (the CLI's last JSON line)
    optim                torch's Adam and AdamW without torch._dynamo (a task's optimizer may be one)
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from . import optim
from .config import ConfigError, PeerConfig
from .tables.embedding import ShardedEmbedding
from .task import Shard, Task, TaskError, UserCodeError, load_task

if TYPE_CHECKING:
    from .node import Peer

__all__ = ["Task", "Shard", "ShardedEmbedding", "PeerConfig", "Peer", "train", "load_task", "TaskError",
           "UserCodeError", "ConfigError", "optim"]


def __getattr__(name: str) -> Any:
    if name == "Peer":  # the peer pulls in aiohttp and the whole shell: only when asked for
        from .node import Peer

        return Peer
    raise AttributeError(f"module 'swarm' has no attribute {name!r}")


def train(task: Task | None = None, *, out=print, **settings: Any) -> dict:
    """Run one peer on ``task`` (None: the built-in byte LM) with ``settings`` (PeerConfig's fields,
    e.g. ``steps=100, join="host:port"``) until it finishes; returns its summary dict. Bad settings
    raise ConfigError, a bad task TaskError; an exception in the task's own code is raised as it is
    (after the peer left the swarm)."""
    from .node import Peer

    unknown = sorted(set(settings) - set(PeerConfig.__dataclass_fields__))
    if unknown:
        raise TypeError(f"train() got unknown settings {unknown} (see swarm.PeerConfig)")
    cfg = PeerConfig(**settings)

    async def main() -> dict:
        async with Peer(task, cfg, out=out) as peer:
            return await peer.run()

    try:
        return asyncio.run(main())
    except UserCodeError as e:
        if e.__cause__ is not None:
            raise e.__cause__ from None
        raise
