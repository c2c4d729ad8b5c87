"""The process group of a host group: set up from torchrun's environment, and the few collectives
a group step uses (docs/design.md, "Host groups").

Every call here blocks, and every rank must make the same calls in the same order, or the group
hangs until the timeout. The node makes all of them from its training thread, in one fixed order
per step (swarm/group/runner.py), never from the event loop.

NCCL needs its buffers on the rank's GPU: tensors are moved to ``comm_device`` for the call and
back to the host after it. With gloo (CPU, and how the tests run) that is a no-op.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.distributed as dist

BACKENDS = ("auto", "nccl", "gloo")
DEVICES = ("auto", "cpu", "cuda")


class GroupError(Exception):
    """The host group cannot be set up, or it broke (a rank died, a collective timed out)."""


@dataclass(frozen=True)
class GroupEnv:
    """Where this process sits in its torchrun group."""

    rank: int
    world: int
    local_rank: int

    @classmethod
    def detect(cls, environ: Mapping[str, str] | None = None) -> "GroupEnv | None":
        """The group torchrun started us in, or None for a plain peer (no WORLD_SIZE, or 1)."""
        env = os.environ if environ is None else environ
        if "WORLD_SIZE" not in env:
            return None
        try:
            world = int(env["WORLD_SIZE"])
            rank = int(env.get("RANK", "0"))
            local_rank = int(env.get("LOCAL_RANK", str(rank)))
            local_world = int(env.get("LOCAL_WORLD_SIZE", str(world)))
        except ValueError:
            raise GroupError("WORLD_SIZE, RANK, LOCAL_RANK and LOCAL_WORLD_SIZE must be integers") from None
        if world == 1:
            return None
        if not 0 <= rank < world or world < 1:
            raise GroupError(f"RANK {rank} is not in 0..{world - 1}")
        if local_world != world:
            raise GroupError(f"a host group lives on one host, but torchrun spans {world // max(1, local_world)} "
                             "nodes: run one torchrun per host, each with --join to the swarm")
        for key in ("MASTER_ADDR", "MASTER_PORT"):
            if not env.get(key):
                raise GroupError(f"{key} is not set: start host groups with torchrun")
        return cls(rank=rank, world=world, local_rank=local_rank)


def pick_device(requested: str, local_rank: int) -> str:
    """--device: 'auto' is this rank's GPU when CUDA is there, else the CPU."""
    if requested not in DEVICES:
        raise GroupError(f"--device must be one of {', '.join(DEVICES)}, got {requested!r}")
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return "cpu"
    if not torch.cuda.is_available():
        raise GroupError("--device cuda, but torch sees no CUDA device")
    return f"cuda:{local_rank % torch.cuda.device_count()}"


def pick_backend(requested: str, device: str, world: int = 1, gpus: int | None = None) -> str:
    """--backend: 'auto' is NCCL for GPU ranks with a GPU each, gloo otherwise. NCCL refuses two ranks
    on one GPU ("Duplicate GPU detected"), so ranks that outnumber the host's ``gpus`` share them
    through gloo (docs/design.md, "Backend and device")."""
    if requested not in BACKENDS:
        raise GroupError(f"--backend must be one of {', '.join(BACKENDS)}, got {requested!r}")
    on_gpu = device.startswith("cuda")
    if gpus is None:
        gpus = torch.cuda.device_count() if on_gpu else 0
    shared = on_gpu and world > gpus
    if requested == "auto":
        requested = "nccl" if on_gpu and not shared and dist.is_nccl_available() else "gloo"
    if requested == "nccl" and not on_gpu:
        raise GroupError("--backend nccl needs GPU ranks (--device cuda)")
    if requested == "nccl" and shared:
        raise GroupError(f"--backend nccl needs one GPU per rank, but {world} ranks share {gpus} GPU(s): "
                         "use --backend gloo (or auto), or fewer ranks")
    if requested == "nccl" and not dist.is_nccl_available():
        raise GroupError("--backend nccl, but this torch build has no NCCL")
    return requested


class Comm:
    """One rank's handle on the group's process group."""

    def __init__(self, env: GroupEnv, backend: str, device: str, timeout_s: float = 600.0):
        self.rank, self.world = env.rank, env.world
        self.backend = backend
        self.comm_device = torch.device(device if backend == "nccl" else "cpu")
        if self.comm_device.type == "cuda":
            torch.cuda.set_device(self.comm_device)
        try:
            dist.init_process_group(backend, rank=env.rank, world_size=env.world,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        except (RuntimeError, ValueError) as e:
            raise GroupError(f"cannot form the host group ({backend}): {e}") from None
        self.bytes_moved = 0  # payload bytes this rank sent through the collectives

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # -- helpers ---------------------------------------------------------------------------------
    def _to(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.comm_device) if t.device != self.comm_device else t

    def all_gather_text(self, text: str, width: int = 256) -> list[str]:
        """Every rank's ``text`` (UTF-8, at most ``width`` bytes), in rank order."""
        raw = text.encode()
        if len(raw) > width:
            raise GroupError(f"{text[:40]!r}... is longer than {width} bytes")
        buf = torch.zeros(width + 2, dtype=torch.uint8)
        buf[0], buf[1] = len(raw) & 0xFF, len(raw) >> 8
        buf[2:2 + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else buf[2:2]
        out = [torch.empty_like(self._to(buf)) for _ in range(self.world)]
        dist.all_gather(out, self._to(buf))
        texts = []
        for o in out:
            o = o.cpu()
            n = int(o[0]) | int(o[1]) << 8
            texts.append(bytes(o[2:2 + n].tolist()).decode())
        return texts

    def broadcast_ints(self, values: list[int] | None, n: int) -> list[int]:
        """Rank 0's ``n`` int64 values to every rank (others pass None)."""
        t = torch.zeros(n, dtype=torch.int64) if values is None else torch.tensor(values, dtype=torch.int64)
        t = self._to(t)
        dist.broadcast(t, 0)
        return t.cpu().tolist()

    def broadcast_bytes(self, blob: bytes | None, size: int) -> bytes:
        """Rank 0's ``size`` bytes to every rank (others pass None)."""
        t = (torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob is not None
             else torch.empty(size, dtype=torch.uint8))
        t = self._to(t)
        dist.broadcast(t, 0)
        if self.rank == 0:
            self.bytes_moved += size * (self.world - 1)
        return bytes(t.cpu().numpy()) if blob is None else blob

    def broadcast_(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``t`` into every rank's ``t`` (in place; same shape and dtype everywhere)."""
        buf = self._to(t)
        dist.broadcast(buf, 0)
        if buf is not t:
            t.copy_(buf)
        if self.rank == 0:
            self.bytes_moved += t.numel() * t.element_size() * (self.world - 1)
        return t

    def all_reduce_mean_(self, t: torch.Tensor) -> torch.Tensor:
        """The mean of every rank's ``t``, into ``t``."""
        buf = self._to(t)
        dist.all_reduce(buf, op=dist.ReduceOp.SUM)
        buf /= self.world
        if buf is not t:
            t.copy_(buf)
        self.bytes_moved += t.numel() * t.element_size()
        return t

    def exchange_counts(self, send_counts: list[int]) -> list[int]:
        """How many items each rank will send us, given how many we send each."""
        send = self._to(torch.tensor(send_counts, dtype=torch.int64))
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
        return recv.cpu().tolist()

    def all_to_all(self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """Rows send[sum(send_counts[:r]):][:send_counts[r]] go to rank r; what we receive comes back
        concatenated in rank order, on the host."""
        send = self._to(send.contiguous())
        out = send.new_empty((sum(recv_counts), *send.shape[1:]))
        dist.all_to_all_single(out, send, output_split_sizes=recv_counts, input_split_sizes=send_counts)
        mine = send_counts[self.rank] if self.rank < len(send_counts) else 0
        self.bytes_moved += (sum(send_counts) - mine) * (send[0].numel() * send.element_size() if len(send) else 0)
        return out.cpu() if out.device.type != "cpu" else out
