"""Rows and row gradients between the ranks of a host group, through all_to_all.

A step's pull (sorted-unique ids per table) is cut once with ``OwnershipMap.plan``, the cut the
HTTP client (swarm/tables/http.py) makes: ids whose chosen owner is another rank of this group
move in three all_to_all stages, and everything else (rows we hold, rows owned on other hosts)
goes to ``TableClient.pull`` on the event loop at the same time.

  1. counts: how many keys each rank asks of each other rank;
  2. keys: the ids, each tagged with its table (``table index << 40 | id``; ``pack_keys`` and
     ``unpack_keys``, which checks what another rank sent);
  3. rows: each owner reads what it was asked on its table thread (``TableService.read_held``)
     and sends the rows back in --row-dtype, an HTTP pull's wire dtype, so a row has the same bits
     whichever path brought it, plus one "served" flag per row.

An owner serves an asker only under the same view (fencing, as over HTTP) and only rows of slots
it holds and is not still fetching; the asker pulls the rows it was not served over HTTP.

Row gradients go to each slot's primary, cut by ``OwnershipMap.plan`` like ``TableClient.push``.
Parts for ranks of the group move as counts, keys and gradients (--push-dtype, as on the wire);
the owner applies each sender's part with ``TableService.apply_push`` (one writer, an
exactly-once key, replicas replayed over HTTP as for any push) and a fourth all_to_all carries one
acknowledgement per sender back: a refused part goes over HTTP instead.

Every method that calls a collective must run on the training thread, in the same order on every
rank; ``serve`` and ``apply`` touch the table service and run on the table thread.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..tables.ownership import OwnershipMap, TableSpec
from ..tables.service import Fenced, Moving, NotPrimary, TableService
from ..tables.shard import ShardError
from ..tables.formats import PushRequest, roundtrip
from .comm import Comm

KEY_BITS = 40  # a key is table index << KEY_BITS | row id (--table-rows is at most 2**26)
# what carries each wire dtype through a collective: int8 / int4 values travel dequantized (exact in fp32)
_CARRIER = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.float32,
            "int4": torch.float32}

PerRank = dict[int, dict[str, np.ndarray]]


@dataclass
class GroupRowStats:
    pulls: int = 0
    rows_pulled: int = 0  # rows that came through the group's collectives
    rows_missed: int = 0  # asked in the group, not served there: pulled over HTTP instead
    rows_served: int = 0  # rows this rank served to the other ranks
    grads_sent: int = 0  # gradient rows sent to primaries in the group
    grads_applied: int = 0  # gradient rows of other ranks this rank applied as their primary
    parts_refused: int = 0  # our parts an owner refused (moved over HTTP)


@dataclass
class Exchange:
    """One pull's or push's routing: what we sent each rank (in key order) and what came to us."""

    sent: list[tuple[int, str, np.ndarray]]  # (rank, table, ids) in the order of the keys sent
    send_counts: list[int]
    recv_counts: list[int]
    views: list[str]  # every rank's view of the membership, by rank
    asked: np.ndarray  # int64 keys the other ranks sent us, by source rank
    grads: torch.Tensor | None = None  # a push's gradient rows, as received (fp32)


class GroupRows:
    """The collective transport of one rank's rows (its half of every exchange)."""

    def __init__(self, comm: Comm, rank_ids: list[str], specs: list[TableSpec], row_dtype: str = "int8",
                 push_dtype: str = "int8"):
        self.comm = comm
        self.rank_ids = list(rank_ids)
        self.rank_of = {pid: r for r, pid in enumerate(rank_ids)}
        self.self_id = rank_ids[comm.rank]
        self.specs = list(specs)
        self.table_index = {s.name: i for i, s in enumerate(specs)}
        # rows of every table move in one exchange, each padded with zeros to the widest table (a
        # zero changes no row's quantization scale, so a row keeps the bits an HTTP pull gives it)
        self.dims = {s.name: s.dim for s in specs}
        self.dim = max(self.dims.values(), default=1)
        self.row_dtype, self.push_dtype = row_dtype, push_dtype
        self.stats = GroupRowStats()

    # -- routing: the one cut both transports use ---------------------------------------------
    def split_pull(self, omap: OwnershipMap, want: dict[str, np.ndarray], down: set[str] = frozenset()
                   ) -> tuple[PerRank, dict[str, np.ndarray]]:
        """(ids for each other rank of the group, the rest for TableClient.pull)."""
        per_rank: PerRank = {}
        rest: dict[str, np.ndarray] = {}
        for table, ids in want.items():
            local = omap.owned_mask(self.self_id, table, ids)
            keep = [ids[local]]
            for peer, sub in omap.plan(table, ids[~local], down=down).items():
                r = self.rank_of.get(peer)
                if r is None or r == self.comm.rank:
                    keep.append(sub)
                else:
                    per_rank.setdefault(r, {})[table] = sub
            rest[table] = np.sort(np.concatenate(keep)) if len(keep) > 1 else keep[0]
        return per_rank, rest

    def split_push(self, omap: OwnershipMap, grads: dict[str, tuple[np.ndarray, torch.Tensor]]
                   ) -> tuple[dict[int, dict[str, tuple[np.ndarray, torch.Tensor]]],
                              dict[str, tuple[np.ndarray, torch.Tensor]]]:
        """(gradient rows for primaries that are other ranks of the group, the rest for TableClient.push)."""
        per_rank: dict[int, dict[str, tuple[np.ndarray, torch.Tensor]]] = {}
        rest: dict[str, tuple[np.ndarray, torch.Tensor]] = {}
        for table, (ids, g) in grads.items():
            group_mask = np.zeros(len(ids), dtype=bool)
            for peer, sub in omap.plan(table, ids).items():
                r = self.rank_of.get(peer)
                if r is not None and r != self.comm.rank:
                    pos = np.searchsorted(ids, sub)
                    group_mask[pos] = True
                    per_rank.setdefault(r, {})[table] = (sub, g[torch.from_numpy(pos)])
            if not group_mask.all():
                keep = ~group_mask
                rest[table] = (ids[keep], g[torch.from_numpy(keep)])
        return per_rank, rest

    # -- keys ----------------------------------------------------------------------------------
    def _sources(self, ex: Exchange):
        start = 0
        for s, n in enumerate(ex.recv_counts):
            yield s, start, n
            start += n

    def _exchange_keys(self, per_rank: dict[int, dict], view: str) -> tuple[Exchange, torch.Tensor]:
        views = self.comm.all_gather_text(view, width=64)
        keys, send_counts, sent = pack_keys(per_rank, self.table_index, self.comm.world)
        recv_counts = self.comm.exchange_counts(send_counts)
        asked = self.comm.all_to_all(keys, send_counts, recv_counts).numpy()
        return Exchange(sent=sent, send_counts=send_counts, recv_counts=recv_counts, views=views, asked=asked), keys

    # -- pull ----------------------------------------------------------------------------------
    def request(self, per_rank: PerRank, view: str) -> Exchange:
        """Stages 1 and 2 (training thread): counts, then keys, to their owners."""
        ex, _ = self._exchange_keys(per_rank, view)
        self.stats.pulls += 1
        return ex

    def serve(self, service: TableService, ex: Exchange) -> torch.Tensor:
        """The rows asked of us (table thread): [asked, dim + 1] in --row-dtype, the last column 1
        where the row was served."""
        out = torch.zeros(len(ex.asked), self.dim + 1, dtype=_CARRIER[self.row_dtype])
        for s, start, n in self._sources(ex):
            runs = unpack_keys(ex.asked[start:start + n], self.specs)
            if not n or runs is None:
                continue
            at = start
            for table, ids in runs:
                rows, ok = service.read_held(table, ids, ex.views[s])
                cast = roundtrip(rows, self.row_dtype).to(out.dtype)  # the bits an HTTP pull would decode
                ok &= torch.isfinite(cast).all(dim=1).numpy()  # a row HTTP could not send either
                sel = torch.from_numpy(np.flatnonzero(ok) + at)
                out[sel, :self.dims[table]] = cast[torch.from_numpy(ok)]
                out[sel, self.dim] = 1
                self.stats.rows_served += int(ok.sum())
                at += len(ids)
        return out

    def receive(self, ex: Exchange, served: torch.Tensor
                ) -> tuple[dict[str, tuple[np.ndarray, torch.Tensor]], dict[str, np.ndarray]]:
        """Stage 3 (training thread): send what we serve, receive what we asked for. Returns
        ({table: (ids, fp32 rows)} for the rows we got, {table: ids} for those to pull over HTTP)."""
        got = self.comm.all_to_all(served, ex.recv_counts, ex.send_counts)
        rows: dict[str, list] = {}
        missed: dict[str, list] = {}
        at = 0
        for _, table, ids in ex.sent:
            part = got[at:at + len(ids)]
            at += len(ids)
            ok = (part[:, self.dim] == 1).numpy()
            rows.setdefault(table, []).append((ids[ok], part[torch.from_numpy(ok), :self.dims[table]].to(torch.float32)))
            if not ok.all():
                missed.setdefault(table, []).append(ids[~ok])
        self.stats.rows_pulled += sum(len(i) for parts in rows.values() for i, _ in parts)
        out_missed = {t: np.sort(np.concatenate(v)) for t, v in missed.items()}
        self.stats.rows_missed += sum(len(v) for v in out_missed.values())
        return {t: merge_parts(parts) for t, parts in rows.items()}, out_missed

    # -- push ----------------------------------------------------------------------------------
    def send_grads(self, per_rank: dict[int, dict[str, tuple[np.ndarray, torch.Tensor]]], view: str) -> Exchange:
        """Counts, keys and gradient rows to the primaries of the group (training thread)."""
        ex, _ = self._exchange_keys(per_rank, view)
        parts = [torch.nn.functional.pad(per_rank[r][table][1], (0, self.dim - self.dims[table]))
                 for r, table, _ in ex.sent]
        send = roundtrip(torch.cat(parts) if parts else torch.zeros(0, self.dim), self.push_dtype)
        send = send.to(_CARRIER[self.push_dtype])  # the values an HTTP push would decode
        ex.grads = self.comm.all_to_all(send, ex.send_counts, ex.recv_counts).to(torch.float32)
        self.stats.grads_sent += sum(len(ids) for _, _, ids in ex.sent)
        return ex

    def apply(self, service: TableService, ex: Exchange, step: int) -> tuple[list[int], dict]:
        """Apply each sender's part as its primary (table thread). Returns (an ack per source rank,
        the replica replays to forward, as TableService.apply_push gives them)."""
        acks = [1] * self.comm.world
        forward: dict[str, list] = {}
        for s, start, n in self._sources(ex):
            if not n:
                continue
            runs = unpack_keys(ex.asked[start:start + n], self.specs)
            if runs is None:
                acks[s] = 0
                continue
            ids, grads, at = {}, {}, start
            for table, sub in runs:
                ids[table], grads[table] = sub, ex.grads[at:at + len(sub), :self.dims[table]]
                at += len(sub)
            req = PushRequest(view=ex.views[s], key=f"{self.rank_ids[s]}/group:{step}", ids=ids, grads=grads)
            try:
                for peer, replays in service.apply_push(req).items():
                    forward.setdefault(peer, []).extend(replays)
            except (Fenced, Moving, NotPrimary, ShardError):
                acks[s] = 0
                continue
            self.stats.grads_applied += n
        return acks, forward

    def exchange_acks(self, ex: Exchange, acks: list[int], per_rank: dict[int, dict]) -> dict[int, dict]:
        """Stage 4 (training thread): one ack per sender; returns our parts that were refused."""
        got = self.comm.all_to_all(torch.tensor(acks, dtype=torch.int64), [1] * self.comm.world,
                                   [1] * self.comm.world).tolist()
        refused = {r: per_rank[r] for r in per_rank if not got[r]}
        self.stats.parts_refused += len(refused)
        return refused


def merge_parts(parts: list[tuple[np.ndarray, torch.Tensor]]) -> tuple[np.ndarray, torch.Tensor]:
    """(ids, rows) parts of one table as one part, ids ascending (each id keeps its row)."""
    if len(parts) == 1:
        return parts[0]
    ids = np.concatenate([p[0] for p in parts])
    rows = torch.cat([p[1] for p in parts])
    order = np.argsort(ids, kind="stable")
    return ids[order], rows[torch.from_numpy(order)]


# -- the keys of stage 2 ---------------------------------------------------------------------------

def pack_keys(per_rank: dict[int, dict], table_index: dict[str, int], world: int
              ) -> tuple[torch.Tensor, list[int], list[tuple[int, str, np.ndarray]]]:
    """Stage 2's keys: ``per_rank`` ({rank: {table: ids or (ids, grads)}}, ids sorted-unique) as one
    int64 tensor of ``table index << KEY_BITS | id``, rank by rank and within a rank table by table
    in ``table_index`` order, so each rank's run is ascending. Returns (keys, how many keys go to
    each of the ``world`` ranks, (rank, table, ids) in key order); empty parts are left out."""
    keys, counts, sent = [], [0] * world, []
    for r in range(world):
        for table in sorted(per_rank.get(r, {}), key=table_index.__getitem__):
            part = per_rank[r][table]
            ids = part[0] if isinstance(part, tuple) else part
            if not len(ids):
                continue
            keys.append(ids.astype(np.int64) | (table_index[table] << KEY_BITS))
            counts[r] += len(ids)
            sent.append((r, table, ids))
    flat = np.concatenate(keys) if keys else np.zeros(0, dtype=np.int64)
    return torch.from_numpy(flat), counts, sent


def unpack_keys(keys: np.ndarray, specs: list[TableSpec]) -> list[tuple[str, np.ndarray]] | None:
    """One source rank's keys (as ``pack_keys`` lays them out, tables indexed by ``specs``) as
    (table, sorted ids) runs; None when they are not what a rank sends (not strictly ascending, an
    unknown table, an id beyond its table): keys come from another process and are checked."""
    runs: list[tuple[str, np.ndarray]] = []
    if not len(keys):
        return runs
    tidx, ids = keys >> KEY_BITS, keys & ((1 << KEY_BITS) - 1)
    if np.any(np.diff(keys) <= 0) or tidx.min() < 0 or tidx.max() >= len(specs):
        return None
    for t in np.unique(tidx).tolist():
        spec = specs[t]
        sub = ids[tidx == t]
        if sub.max() >= spec.rows:
            return None
        runs.append((spec.name, sub))
    return runs
