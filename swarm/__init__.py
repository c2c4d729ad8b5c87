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
import importlib
from typing import TYPE_CHECKING, Any

from .config import ConfigError, PeerConfig
from .task_errors import TaskError, UserCodeError

if TYPE_CHECKING:
    from . import optim
    from .node import Peer
    from .tables.embedding import ShardedEmbedding
    from .task import Shard, Task, load_task

__all__ = ["Task", "Shard", "ShardedEmbedding", "PeerConfig", "Peer", "train", "load_task", "TaskError",
           "UserCodeError", "ConfigError", "optim"]


# the names that import torch (or, for Peer, aiohttp and the whole shell) load when first asked
# for, so that `import swarm` and the command line's flag checks stay torch-free (swarm/task_errors.py)
_LAZY = {"Peer": "node", "optim": None, "ShardedEmbedding": "tables.embedding", "Shard": "task", "Task": "task",
         "load_task": "task"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'swarm' has no attribute {name!r}")
    module = importlib.import_module(f".{_LAZY[name] or name}", __name__)
    value = module if _LAZY[name] is None else getattr(module, name)
    globals()[name] = value
    return value


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
