"""Checkpoints: a peer's dense replica, its codec residual and the table slots it holds, on disk.

Layout of ``--checkpoint DIR`` (every file written to a temporary name, fsynced, then renamed over
the old one, so a crash mid-write leaves the previous checkpoint intact):

  dense.safetensors     Replica.state_blob(): the model's parameters and buffers, the optimizer's and
                        scheduler's state_dicts, the step and the task fingerprint
  residual.safetensors  the codec's error-feedback residual (Compressor.state_dict())
  tables.safetensors    every held slot: "<table>/<slot>/<rows|m|v|step>", metadata = table layout
  checkpoint.json       written last: what the three files are (step, layout, peer, time) and the
                        swarm settings they were trained under (a resumed peer adopts them)

A checkpoint is read back whole and validated (format, task fingerprint, table layout, shapes,
finite values) before anything of it is installed; a damaged one is a clear error, never a crash
and never a half-loaded peer.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from . import settings
from .statedict import safetensors_metadata

DENSE, RESIDUAL, TABLES, META = "dense.safetensors", "residual.safetensors", "tables.safetensors", "checkpoint.json"
FORMAT = "swarm-checkpoint-1"


class CheckpointError(ValueError):
    """The checkpoint directory holds something that cannot be resumed from (the reason says why)."""


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the new one, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="." + path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a power cut
    finally:
        os.close(dir_fd)


def tables_blob(shards: dict, layout: str) -> bytes:
    """Every held slot of every table, rows and optimizer state, as one safetensors blob."""
    tensors: dict[str, torch.Tensor] = {}
    for name, shard in shards.items():
        for slot in shard.slots():
            for key, t in shard.export_slot(slot).items():
                tensors[f"{name}/{slot}/{key}"] = t
    return st_save(tensors, metadata={"format": FORMAT, "layout": layout})


def parse_tables_blob(blob: bytes, layout: str) -> dict[str, dict[int, dict[str, torch.Tensor]]]:
    """{table: {slot: tensors}}; shapes and values are checked again by TableShard.import_slot."""
    try:
        tensors = st_load(blob)
        meta = safetensors_metadata(blob)
    except Exception as e:
        raise CheckpointError(f"{TABLES} is damaged: {e}") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{TABLES} has format {meta.get('format')!r}, expected {FORMAT!r}")
    if meta.get("layout") != layout:
        raise CheckpointError(f"{TABLES} was written for table layout {meta.get('layout')!r}, this peer uses "
                              f"{layout!r} (check --table-rows, --table-slots, --replicas)")
    out: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for key, t in tensors.items():
        parts = key.split("/")
        if len(parts) != 3 or not parts[1].isdigit():
            raise CheckpointError(f"{TABLES} holds an unexpected tensor {key[:60]!r}")
        out.setdefault(parts[0], {}).setdefault(int(parts[1]), {})[parts[2]] = t
    return out


@dataclass
class Checkpoint:
    """What was read from a checkpoint directory; nothing is installed until the peer decides."""

    step: int
    dense: bytes
    residual: dict[str, torch.Tensor]
    tables: dict[str, dict[int, dict[str, torch.Tensor]]]
    meta: dict


def save(directory: str | os.PathLike, *, dense: bytes, residual: dict[str, torch.Tensor], tables: bytes,
         step: int, layout: str, peer_id: str, settings: dict | None = None) -> None:
    d = Path(directory)
    write_atomic(d / DENSE, dense)
    write_atomic(d / RESIDUAL, st_save({k: v.contiguous() for k, v in residual.items()}))
    write_atomic(d / TABLES, tables)
    meta = {"format": FORMAT, "step": step, "layout": layout, "peer_id": peer_id, "saved_at": time.time(),
            "settings": settings}
    write_atomic(d / META, json.dumps(meta).encode())


def read_settings(directory: str | os.PathLike) -> dict | None:
    """The swarm settings a checkpoint was written under (swarm/settings.py), or None when there is no
    checkpoint or it predates them; CheckpointError when they are damaged."""
    path = Path(directory) / META
    if not path.exists():
        return None
    try:
        raw = json.loads(path.read_text()).get("settings")
    except (OSError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{path} is damaged: {e}") from None
    if raw is None:
        return None
    try:
        return settings.parse(raw)
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None


def load(directory: str | os.PathLike, layout: str) -> Checkpoint | None:
    """The checkpoint in ``directory``, or None when there is none; CheckpointError when damaged."""
    d = Path(directory)
    if not (d / META).exists():
        return None
    try:
        meta = json.loads((d / META).read_text())
        step = int(meta["step"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{d / META} is damaged: {e}") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{d / META} has format {meta.get('format')!r}, expected {FORMAT!r}")
    try:
        dense = (d / DENSE).read_bytes()
        residual_blob = (d / RESIDUAL).read_bytes()
        tables_blob_ = (d / TABLES).read_bytes()
    except OSError as e:
        raise CheckpointError(f"checkpoint in {d} is incomplete: {e}") from None
    try:
        residual = st_load(residual_blob)
    except Exception as e:
        raise CheckpointError(f"{RESIDUAL} is damaged: {e}") from None
    return Checkpoint(step=step, dense=dense, residual=residual, tables=parse_tables_blob(tables_blob_, layout),
                      meta=meta)
