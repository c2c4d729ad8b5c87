"""ShardedEmbedding: the module that stands where a task's embedding table was.

A table named in ``Task.tables`` is not part of the replica: its rows live on their owners across
the swarm (docs/tables.md). The replica swaps the user's ``nn.Embedding`` for a ShardedEmbedding
(``swap_tables``), or the user puts one in the model directly for a table too large to build whole.
Before each forward the replica binds the rows pulled for the batch (sorted-unique ids and a leaf
tensor of their rows); the forward looks the batch's ids up among them, so the gradient lands on
the leaf and goes back to the owners as row gradients. The user's model calls it as it called its
embedding: ``num_embeddings``, ``embedding_dim``, ``padding_idx`` and a ``weight`` that knows its
shape, dtype and device are there for library code that reads them (the rows themselves are not).

Initial rows are identical on every peer without moving row bytes: a swapped ``nn.Embedding``
keeps the weight its seeded construction drew (``init_rows`` slices it); a ShardedEmbedding built
by the user draws each slot's rows from a generator seeded by the swarm seed, the table and the
slot's first row (``std`` x N(0, 1), or zeros for ``std=0``), so no peer ever holds the whole table.
"""
from __future__ import annotations

import hashlib
from typing import Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..task import TaskError

__all__ = ["ShardedEmbedding", "TableError", "swap_tables", "table_name"]


class TableError(TaskError):
    """A task's table is unusable (no such submodule, not an embedding, tied, ids not pulled)."""


class RowsWeight:
    """What ``ShardedEmbedding.weight`` is: the table's shape, dtype and device, without its rows."""

    def __init__(self, rows: int, dim: int, dtype: torch.dtype = torch.float32):
        self.shape = torch.Size((rows, dim))
        self.dtype = dtype
        self.device = torch.device("cpu")
        self.requires_grad = True

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def dim(self) -> int:
        return 2

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def ndim(self) -> int:
        return 2

    def __repr__(self) -> str:
        return f"RowsWeight(shape={tuple(self.shape)}, sharded across the swarm)"


class ShardedEmbedding(nn.Module):
    """An embedding table whose rows are sharded across the swarm (see the module docstring).

    ``std``: initial rows are ``std`` x N(0, 1) per slot (nn.Embedding's default is std 1), 0 for
    zeros; the ``padding_idx`` row starts at zero and gets no gradient, as in nn.Embedding. Rows are
    kept and sent as fp32; a forward returns them in ``dtype`` (a half-precision model's, say).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None, *,
                 std: float = 1.0, dtype: torch.dtype = torch.float32, _init_weight: torch.Tensor | None = None):
        super().__init__()
        for what, v in (("num_embeddings", num_embeddings), ("embedding_dim", embedding_dim)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ShardedEmbedding: {what} must be an int >= 1, got {v!r}")
        if padding_idx is not None:
            if isinstance(padding_idx, bool) or not isinstance(padding_idx, int) \
                    or not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"ShardedEmbedding: padding_idx must be an int in [-{num_embeddings}, "
                                 f"{num_embeddings}), got {padding_idx!r}")
            padding_idx %= num_embeddings
        if not isinstance(std, (int, float)) or isinstance(std, bool) or not 0 <= float(std) < float("inf"):
            raise ValueError(f"ShardedEmbedding: std must be a finite float >= 0, got {std!r}")
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx
        self.std = float(std)
        self.seed = torch.initial_seed()  # the swarm seed: a task's model() is called under it
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"ShardedEmbedding: dtype must be a floating-point torch.dtype, got {dtype!r}")
        self.dtype = dtype
        self.weight = RowsWeight(num_embeddings, embedding_dim, dtype)
        self._init_weight = _init_weight  # a swapped nn.Embedding's rows as its construction drew them
        self._bound: tuple[torch.Tensor, torch.Tensor] | None = None
        self.table = ""  # the swarm's name for it, set by swap_tables

    @classmethod
    def replacing(cls, emb: nn.Embedding) -> "ShardedEmbedding":
        new = cls(emb.num_embeddings, emb.embedding_dim, emb.padding_idx, dtype=emb.weight.dtype,
                  _init_weight=emb.weight.detach().to("cpu", torch.float32).contiguous())
        return new

    def extra_repr(self) -> str:
        pad = f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""
        return f"{self.num_embeddings}, {self.embedding_dim}{pad}, sharded"

    # -- initial rows ---------------------------------------------------------------------------
    def init_rows(self, lo: int, hi: int) -> torch.Tensor:
        """The initial fp32 rows [hi - lo, dim] of rows lo..hi-1 (the same on every peer)."""
        if self._init_weight is not None:
            rows = self._init_weight[lo:hi].clone()
        elif self.std == 0:
            rows = torch.zeros(hi - lo, self.embedding_dim)
        else:
            digest = hashlib.sha256(f"swarm-rows\0{self.seed}\0{self.table}\0{lo}".encode()).digest()
            g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
            rows = torch.randn(hi - lo, self.embedding_dim, generator=g) * self.std
        if self.padding_idx is not None and lo <= self.padding_idx < hi:
            rows[self.padding_idx - lo] = 0.0
        return rows

    # -- the rows of one forward ------------------------------------------------------------------
    def bind(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """The rows a forward may read: ``rows[i]`` is row ``ids[i]`` (ids sorted, unique)."""
        self._bound = (ids, rows)

    def unbind(self) -> None:
        self._bound = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self._bound is None:
            raise TableError(f"table {self.table or 'ShardedEmbedding'!r} has no rows here: its rows live on the "
                             "swarm's peers and are bound only during a swarm peer's forward")
        if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or ids.dtype.is_complex \
                or ids.dtype == torch.bool:
            raise TableError(f"table {self.table!r} was called with "
                             f"{ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__} ids: "
                             "ids must be an integer tensor")
        uids, rows = self._bound
        flat = ids.reshape(-1).to(uids.device, torch.int64)
        if uids.numel() == 0:
            ok = torch.zeros_like(flat, dtype=torch.bool)
            pos = torch.zeros_like(flat)
        else:
            pos = torch.searchsorted(uids, flat).clamp_(max=uids.numel() - 1)
            ok = uids[pos] == flat
        if not bool(ok.all()):
            missing = torch.unique(flat[~ok])[:8].tolist()
            raise TableError(f"table {self.table!r}: the forward read ids that the task's tables[{self.table!r}] "
                             f"function did not return for this batch, e.g. {missing}")
        pad = None
        if self.padding_idx is not None and uids.numel():
            p = int(torch.searchsorted(uids, torch.tensor(self.padding_idx, device=uids.device)))
            if p < uids.numel() and int(uids[p]) == self.padding_idx:
                pad = p
        out = F.embedding(pos.view(ids.shape).to(rows.device), rows, padding_idx=pad)
        return out if out.dtype == self.dtype else out.to(self.dtype)


def table_name(path: str) -> str:
    """The swarm's name of the table at module path ``path`` ("transformer.wte" -> "transformer-wte":
    table names travel in wire keys that use '.' as a separator)."""
    return path.replace(".", "-")


def swap_tables(model: nn.Module, paths: Mapping[str, object]) -> dict[str, ShardedEmbedding]:
    """Replace each ``nn.Embedding`` at a dotted path of ``model`` by a ShardedEmbedding (one already
    there is kept); returns {table name: module}. TableError names the first unusable path."""
    tied: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        tied.setdefault(id(p), []).append(name)
    out: dict[str, ShardedEmbedding] = {}
    for path in paths:
        if not isinstance(path, str) or not path:
            raise TableError(f"tables: keys must be module paths (non-empty strings), got {path!r}")
        try:
            mod = model.get_submodule(path)
        except AttributeError:
            raise TableError(f"tables[{path!r}]: the model has no submodule {path!r}") from None
        name = table_name(path)
        if name in out:
            raise TableError(f"tables: {path!r} and another path both map to table name {name!r}")
        if isinstance(mod, ShardedEmbedding):
            new = mod
        elif isinstance(mod, nn.Embedding):
            if mod.max_norm is not None or mod.scale_grad_by_freq:
                raise TableError(f"tables[{path!r}]: an nn.Embedding with max_norm or scale_grad_by_freq cannot "
                                 "be sharded (both need the whole table)")
            if not mod.weight.dtype.is_floating_point:
                raise TableError(f"tables[{path!r}]: weight dtype {mod.weight.dtype} is not floating point")
            others = [n for n in tied.get(id(mod.weight), []) if n != f"{path}.weight"]
            if others:
                raise TableError(f"tables[{path!r}]: its weight is tied to {others[0]} (e.g. an LM head sharing "
                                 "the embedding): a sharded table cannot share its weight; untie them "
                                 "(transformers: tie_word_embeddings=False)")
            new = ShardedEmbedding.replacing(mod)
            parent_path, _, attr = path.rpartition(".")
            parent = model.get_submodule(parent_path) if parent_path else model
            setattr(parent, attr, new)
        else:
            raise TableError(f"tables[{path!r}]: model.{path} is a {type(mod).__name__}, not an nn.Embedding")
        new.table = name
        out[name] = new
    return out
