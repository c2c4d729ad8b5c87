"""Sharded embedding tables: ownership (slots, rendezvous hashing), the held shard with its row-wise
optimizer, and the wire formats. All sans-I/O; see docs/tables.md."""
from .ownership import Move, OwnershipMap, TableSpec, moves, view_id
from .shard import RowOptConfig, ShardError, TableShard
from .formats import DTYPES, PullRequest, PushRequest, WireError

__all__ = ["Move", "OwnershipMap", "TableSpec", "moves", "view_id", "RowOptConfig", "ShardError", "TableShard",
           "DTYPES", "PullRequest", "PushRequest", "WireError"]
