"""One peer's replica of the model: compute a gradient, apply an aggregate, evaluate, snapshot.

Every method here is blocking compute and runs on the peer's single training thread (see
node.Peer.work), never on the event loop. Methods are called one at a time in the order the node
decides: there is no locking because there is no concurrency inside a replica.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from .codec import Manifest
from .config import PeerConfig
from .data import BatchSampler, Corpus, val_batches
from .gossip import RoundResult, aggregate_report
from .robust import Report, RobustConfig
from .model import TABLES, ModelConfig, SwarmLM, param_sketch
from .tables import TableSpec

STATE_FORMAT = "swarm-state-1"


class StateError(ValueError):
    """A downloaded state does not fit this replica (wrong names, shapes, dtypes, non-finite)."""


@dataclass
class StepStats:
    loss: float
    tokens: int
    grad_norm: float


class Trainer:
    def __init__(self, cfg: PeerConfig, corpus: Corpus, device: str = "cpu"):
        self.cfg = cfg
        self.corpus = corpus
        # the model, its optimizer and each step's batch and rows live on ``device``; gradients,
        # aggregates and state blobs cross to the host, where the codec and the wire are
        self.device = torch.device(device)
        # The hashed tables are not part of the replica: they are sharded across the swarm
        # (swarm/tables), and every step brings the rows it needs (see compute()).
        self.model_cfg = ModelConfig(ngram_rows=cfg.table_rows, value_rows=cfg.table_rows, seed=cfg.seed,
                                     local_tables=False)
        self.model = SwarmLM(self.model_cfg).to(self.device)
        self.table_specs = [TableSpec(name, cfg.table_rows, self.model_cfg.d_model) for name in TABLES]
        self.manifest = Manifest.from_module(self.model)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.names = [e.name for e in self.manifest.entries]
        self.opt = torch.optim.Adam(self.params, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
        self.step = 0  # rounds applied to this replica
        self.sampler: BatchSampler | None = None
        self.val = val_batches(corpus, cfg.batch_size, self.model_cfg.context, max_batches=cfg.eval_batches,
                               prefix=self.model_cfg.prefix)
        self._agg = torch.zeros(self.manifest.numel, dtype=torch.float32)
        self.robust_cfg = RobustConfig(rule=cfg.aggregation, trim=cfg.trim, msg_clip=cfg.msg_clip)
        self.last_report: Report | None = None  # what the last apply() aggregated (the node scores peers on it)

    # -- data -------------------------------------------------------------------------------
    def set_shard(self, index: int, count: int, seed: int) -> None:
        """Draw batches from this peer's shard of the training files."""
        self.sampler = BatchSampler(self.corpus, self.cfg.batch_size, self.model_cfg.context, seed=seed,
                                    shard=(index, count))

    # -- one step ---------------------------------------------------------------------------
    def sample(self) -> tuple[torch.Tensor, dict[str, np.ndarray]]:
        """The next batch of this peer's shard and the sorted-unique table rows it touches."""
        assert self.sampler is not None, "set_shard first"
        batch = self.sampler.next()
        return batch, self.rows_of(batch)

    def rows_of(self, batch: torch.Tensor) -> dict[str, np.ndarray]:
        return {name: ids.numpy() for name, ids in self.model.unique_table_ids(batch).items()}

    def compute(self, batch: torch.Tensor, want: dict[str, np.ndarray], rows: dict[str, torch.Tensor]
                ) -> tuple[StepStats, torch.Tensor, dict[str, tuple[np.ndarray, torch.Tensor]]]:
        """Forward and backward on ``batch`` with the pulled table ``rows`` (fp32, in ``want`` order).

        Returns the loss, the flat fp32 gradient of the dense parameters, and the gradient of every
        pulled row: {table: (ids, grads [len(ids), d])}."""
        self.model.train()
        for p in self.params:
            p.grad = None
        leaves = {name: rows[name].detach().to(self.device, copy=True).requires_grad_(True) for name in want}
        table_rows = {name: (torch.from_numpy(want[name]).to(self.device), leaves[name]) for name in want}
        loss = self.model.loss(batch.to(self.device), table_rows)
        loss.backward()
        flat = self.manifest.flatten_grads(self.model)
        for p in self.params:
            p.grad = None
        row_grads = {name: (want[name], leaves[name].grad.cpu() if leaves[name].grad is not None
                            else torch.zeros(leaves[name].shape)) for name in want}
        tokens = batch.shape[0] * self.model_cfg.context
        return StepStats(loss=float(loss.detach()), tokens=tokens, grad_norm=float(flat.norm())), flat, row_grads

    def lr_at(self, step: int) -> float:
        """Linear warm-up over 20 steps, then cosine to 10% at cfg.steps (constant when unbounded)."""
        warm = 20
        if step < warm:
            return self.cfg.lr * (step + 1) / warm
        if self.cfg.steps <= warm:
            return self.cfg.lr
        t = min(1.0, (step - warm) / max(1, self.cfg.steps - warm))
        return self.cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    @torch.no_grad()
    def apply(self, result: RoundResult) -> int:
        """Optimizer step on the round's aggregate (cfg.aggregation, swarm/robust.py). Returns how many
        contributions it combined; ``last_report`` keeps their norms and verdicts."""
        self._agg.zero_()
        self.last_report = aggregate_report(self._agg, result, self.robust_cfg)
        self.apply_aggregate(result.step, self.last_report.count)
        return self.last_report.count

    @property
    def aggregate(self) -> torch.Tensor:
        """The flat fp32 aggregate the last apply() stepped on (a host group's leader sends it to its
        ranks, which step on the same bits with apply_aggregate)."""
        return self._agg

    @torch.no_grad()
    def apply_aggregate(self, step: int, count: int) -> None:
        """Optimizer step on ``self.aggregate`` as round ``step``'s (no step when nothing was combined)."""
        if count:
            grads = self.manifest.unflatten(self._agg)
            for name, p in zip(self.names, self.params):
                p.grad = grads[name].to(self.device)
            for g in self.opt.param_groups:
                g["lr"] = self.lr_at(self.step)
            self.opt.step()
            for p in self.params:
                p.grad = None
        self.step = step + 1

    # -- evaluation -------------------------------------------------------------------------
    @torch.no_grad()
    def eval_loss(self, batch: torch.Tensor, want: dict[str, np.ndarray], rows: dict[str, torch.Tensor]) -> float:
        """Loss on one held-out batch (the node pulls its rows; the batches are identical on every peer)."""
        self.model.eval()
        table_rows = {name: (torch.from_numpy(want[name]).to(self.device), rows[name].to(self.device))
                      for name in want}
        return float(self.model.loss(batch.to(self.device), table_rows))

    @torch.no_grad()
    def sketch(self) -> list[float]:
        return param_sketch(self.model)

    # -- state transfer ---------------------------------------------------------------------
    @torch.no_grad()
    def state_blob(self, corpus_hash: str) -> bytes:
        """Dense parameters and optimizer state as one safetensors blob (for GET /v1/state)."""
        tensors: dict[str, torch.Tensor] = {}
        for name, p in zip(self.names, self.params):
            tensors["p." + name] = p.detach().cpu().contiguous()
            st = self.opt.state.get(p)
            if st:
                tensors["m." + name] = st["exp_avg"].cpu().contiguous()
                tensors["v." + name] = st["exp_avg_sq"].cpu().contiguous()
        opt_steps = {float(st["step"]) for st in self.opt.state.values()} if self.opt.state else {0.0}
        meta = {
            "format": STATE_FORMAT,
            "step": str(self.step),
            "opt_step": str(int(max(opt_steps))),
            "manifest": self.manifest.hash,
            "corpus": corpus_hash,
        }
        return st_save(tensors, metadata=meta)

    @torch.no_grad()
    def load_state_blob(self, blob: bytes, corpus_hash: str) -> int:
        """Replace parameters and optimizer state from a peer's blob; returns its step.

        Everything is checked before anything is written, so a bad blob leaves the replica as it was.
        """
        try:
            tensors = st_load(blob)
            meta = safetensors_metadata(blob)
        except Exception as e:  # safetensors raises its own error types on malformed input
            raise StateError(f"malformed state blob: {e}") from None
        if meta.get("format") != STATE_FORMAT:
            raise StateError(f"state format {meta.get('format')!r}, expected {STATE_FORMAT!r}")
        if meta.get("manifest") != self.manifest.hash:
            raise StateError("state was made for another model (manifest hash differs)")
        if meta.get("corpus") != corpus_hash:
            raise StateError("state was made on another corpus (corpus hash differs)")
        try:
            step = int(meta["step"])
            opt_step = int(meta["opt_step"])
        except (KeyError, ValueError):
            raise StateError("state metadata lacks a valid step") from None
        if step < 0 or opt_step < 0:
            raise StateError("negative step in state")
        has_opt = any(k.startswith("m.") for k in tensors)
        expected = {"p." + n for n in self.names}
        if has_opt:
            expected |= {"m." + n for n in self.names} | {"v." + n for n in self.names}
        if set(tensors) != expected:
            extra = sorted(set(tensors) - expected)[:3]
            missing = sorted(expected - set(tensors))[:3]
            raise StateError(f"state tensors do not match the model (missing {missing}, unexpected {extra})")
        for name, p in zip(self.names, self.params):
            for prefix in ("p.", "m.", "v.") if has_opt else ("p.",):
                t = tensors[prefix + name]
                if t.shape != p.shape or t.dtype != p.dtype:
                    raise StateError(f"{prefix}{name}: shape {tuple(t.shape)} {t.dtype}, expected "
                                     f"{tuple(p.shape)} {p.dtype}")
                if not torch.isfinite(t).all():
                    raise StateError(f"{prefix}{name} holds non-finite values")
        for name, p in zip(self.names, self.params):
            p.copy_(tensors["p." + name])
        self.opt.state.clear()
        if has_opt:
            for name, p in zip(self.names, self.params):
                self.opt.state[p] = {
                    "step": torch.tensor(float(opt_step)),
                    "exp_avg": tensors["m." + name].to(p.device, copy=True),
                    "exp_avg_sq": tensors["v." + name].to(p.device, copy=True),
                }
        self.step = step
        return step


def safetensors_metadata(blob: bytes) -> dict[str, str]:
    """The __metadata__ map of a safetensors blob (header parsed by hand: 8-byte length + JSON)."""
    if len(blob) < 8:
        raise ValueError("blob shorter than its header length field")
    (hlen,) = struct.unpack("<Q", blob[:8])
    if hlen > len(blob) - 8 or hlen > 1 << 24:
        raise ValueError("header length out of range")
    header = json.loads(blob[8:8 + hlen])
    meta = header.get("__metadata__", {}) if isinstance(header, dict) else {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ValueError("metadata is not a string map")
    return meta
