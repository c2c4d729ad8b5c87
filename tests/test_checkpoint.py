"""Checkpoints: atomic writes, a peer that resumes where it stopped, damaged checkpoints refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from swarm import checkpoint
from swarm.identity import KEY_FILE
from swarm.node import Peer

from .conftest import small_cfg
from .test_peer_cli import run_clis

pytestmark = pytest.mark.timeout(120)


def test_write_atomic_keeps_the_old_file_when_a_write_fails(tmp_path: Path):
    target = tmp_path / "f.bin"
    checkpoint.write_atomic(target, b"old")
    with pytest.raises(TypeError):
        checkpoint.write_atomic(target, "not bytes")  # type: ignore[arg-type]
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]  # no temporary file left behind
    checkpoint.write_atomic(target, b"new")
    assert target.read_bytes() == b"new"


def snapshot(p: Peer) -> tuple[dict, dict]:
    dense = {k: v.clone() for k, v in p.replica.model.state_dict().items()}
    slots = {(t, s): sh.checksum(s) for t, sh in p.tables.shards.items() for s in sh.slots()}
    return dense, slots


async def test_a_peer_resumes_dense_state_residual_and_table_slots(tmp_path: Path):
    ck = str(tmp_path / "ck")
    a = Peer(small_cfg(steps=8, checkpoint=ck), out=lambda line: None)
    await a.start()
    try:
        first = await a.run()
    finally:
        await a.close()
    assert first["steps"] == 8
    assert sorted(os.listdir(ck)) == sorted([checkpoint.DENSE, checkpoint.RESIDUAL, checkpoint.TABLES,
                                             checkpoint.META, KEY_FILE])  # and the peer's key: its id
    saved_dense, saved_slots = snapshot(a)
    residual = a.compressor.residual.clone()

    b = Peer(small_cfg(steps=12, checkpoint=ck), out=lambda line: None)
    await b.start()
    try:
        assert b.id == a.id  # the same key, so the same id
        assert b.book.step == 8 and b.replica.step == 8
        dense, slots = snapshot(b)
        assert all(torch.equal(dense[k], saved_dense[k]) for k in saved_dense)
        assert slots == saved_slots
        assert torch.equal(b.compressor.residual, residual)
        second = await b.run()
    finally:
        await b.close()
    assert second["steps"] == 12 and second["steps_contributed"] == 4


async def test_a_damaged_checkpoint_is_a_clear_error(tmp_path: Path):
    ck = tmp_path / "ck"
    a = Peer(small_cfg(steps=3, checkpoint=str(ck)), out=lambda line: None)
    await a.start()
    try:
        await a.run()
    finally:
        await a.close()
    data = (ck / checkpoint.TABLES).read_bytes()
    (ck / checkpoint.TABLES).write_bytes(data[: len(data) // 2])
    b = Peer(small_cfg(steps=3, checkpoint=str(ck)), out=lambda line: None)
    try:
        with pytest.raises(checkpoint.CheckpointError, match="damaged"):
            await b.start()
    finally:
        await b.close()
    same, other = run_clis((("--table-rows", "4096", "--table-slots", "256", "--checkpoint", str(ck)), None),
                           (("--table-rows", "8192", "--table-slots", "256", "--checkpoint", str(ck)), None))
    assert same.returncode == 2 and "damaged" in same.stderr and "Traceback" not in same.stderr
    assert other.returncode == 2 and "Traceback" not in other.stderr  # another layout
