"""One peer's replica of a task's model: compute a gradient, step on an aggregate, evaluate, state.

The replica knows no particular model. Its state is the model's own parameters and persistent
buffers, the optimizer's and the scheduler's own ``state_dict``s, and the step. The task's tables
are not part of it: they are ShardedEmbeddings (swarm/tables/embedding.py) whose rows are bound for
each forward from what the peer pulled.

The flat space that the codec compresses (``manifest``) is every trainable parameter, then every
numeric persistent buffer. A step's vector holds the parameters' gradients and the buffers' change
during the forward (BatchNorm's running statistics, ``num_batches_tracked``); the buffers are put
back as they were, and every peer adds the same aggregated change to them when it applies a round,
so buffers stay bit-identical like parameters (for BatchNorm: an update with the contributors'
mean batch statistics). Integer buffers add the aggregate rounded to the nearest integer; bool
buffers are restored and never change.

Every method is blocking compute and runs on the peer's single training thread, never on the
event loop, one call at a time: there is no locking because there is no concurrency inside.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.nn as nn
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from . import optim, statedict
from .codec import Manifest
from .codec.manifest import ManifestEntry
from .outer import OuterConfig, OuterOptimizer
from .sketch import param_sketch
from .statedict import StateDictError, safetensors_metadata
from .tables import TableSpec
from .tables.embedding import ShardedEmbedding, swap_tables
from .task import Shard, Task, TaskError, TaskTypeError, UserCodeError, call_user

STATE_FORMAT = "swarm-state-2"
MAX_NONFINITE = 10  # losses in a row that may be non-finite before the peer stops
_BUILD = threading.Lock()  # model construction seeds torch's global generator: one build at a time


_WHAT = {"name": "task name", "version": "task version",
         "model": "model (the names, shapes and dtypes of its parameters and buffers)",
         "tables": "tables (name:rows x width)", "seed": "seed (--seed)", "data": "data (the built-in corpus or --data)",
         "optimizer": "optimizer"}


def fingerprint_differs(ours: dict[str, str], theirs: Any) -> str | None:
    """None when a joiner's task fingerprint equals ours; else one line naming what differs, with
    both values (the 409 a join gets)."""
    if not isinstance(theirs, dict):
        return "join message lacks the task fingerprint (a peer of an older swarm version?)"
    for key, label in _WHAT.items():
        a, b = ours.get(key), theirs.get(key)
        if a != b and key == "optimizer" and isinstance(a, str) and isinstance(b, str):
            ta, tb = a.split(" "), b.split(" ")
            if ta[0] != tb[0]:
                return f"task fingerprint differs: optimizer: this swarm uses {ta[0]}, the joiner {tb[0][:40]}"
            da = dict(t.split("=", 1) for t in ta[1:] if "=" in t)
            db = dict(t.split("=", 1) for t in tb[1:] if "=" in t)
            for k in sorted(set(da) | set(db)):
                if da.get(k) != db.get(k):
                    return (f"task fingerprint differs: optimizer {ta[0]} hyperparameter {k[:40]}: this swarm has "
                            f"{da.get(k)}, the joiner {str(db.get(k))[:40]}")
        if a != b:
            show = (lambda v: repr(v)[:80])
            return f"task fingerprint differs: {label}: this swarm has {show(a)}, the joiner {show(b)}"
    extra = sorted(set(theirs) - set(ours))
    if extra:
        return f"task fingerprint differs: unknown field {str(extra[0])[:40]!r}"
    return None


class StateError(ValueError):
    """A downloaded state does not fit this replica (wrong names, shapes, dtypes, non-finite)."""


@dataclass
class StepStats:
    loss: float
    samples: int
    grad_norm: float
    finite: bool = True  # False: the loss was not finite and the step's gradient was dropped


def map_tensors(batch: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """The batch with ``fn`` applied to every tensor in it (tuples, namedtuples, lists and dicts
    rebuilt as they are, other values kept)."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, (list, tuple)):
        parts = [map_tensors(b, fn) for b in batch]
        return type(batch)(*parts) if hasattr(batch, "_fields") else type(batch)(parts)
    if isinstance(batch, dict):
        return {k: map_tensors(v, fn) for k, v in batch.items()}
    return batch


def tensors_in(batch: Any) -> Iterator[torch.Tensor]:
    """Every tensor of the batch, depth first, in map_tensors' order."""
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, (list, tuple, dict)):
        for b in batch.values() if isinstance(batch, dict) else batch:
            yield from tensors_in(b)


def to_device(batch: Any, device: torch.device) -> Any:
    """The batch with every tensor on ``device`` (tuples, lists and dicts kept as they are)."""
    return map_tensors(batch, lambda t: t.to(device))


def _as_dtype(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 values as ``dtype``: cast to a floating dtype, rounded to the nearest for an integer one."""
    return v.to(dtype) if dtype.is_floating_point else torch.round(v).to(dtype)


def samples_of(batch: Any) -> int:
    """The first dimension of the batch's first tensor (depth first; a 0-dim tensor counts 1, an
    empty one is passed over): its sample count."""
    return next((n for t in tensors_in(batch) if (n := int(t.shape[0]) if t.dim() else 1)), 0)


def split_batch(batch: Any, size: int) -> list[tuple[Any, int]]:
    """``batch`` cut into pieces of at most ``size`` samples, each with its sample count (micro-
    batches: gradient accumulation). Every tensor of the batch with a first dimension is cut along
    it, and all of them must have the same one; 0-dim tensors and other values go whole into every
    piece. One piece (the batch itself) when it has no more than ``size`` samples."""
    n = samples_of(batch)
    if n <= size:
        return [(batch, n)]
    firsts = {int(t.shape[0]) for t in tensors_in(batch) if t.dim()}
    if firsts != {n}:
        raise TaskError(f"micro-batches of {size} need every tensor of a batch to have its samples first, the "
                        f"same number in all; this batch's tensors have first dimensions {sorted(firsts)} "
                        "(give --micro-batch 0 to take the batch whole)")
    return [(map_tensors(batch, lambda t, lo=lo: t[lo:lo + size] if t.dim() else t), min(lo + size, n) - lo)
            for lo in range(0, n, size)]


class Replica:
    def __init__(self, task: Task, seed: int = 0, device: str = "cpu", table_lr: float | None = None,
                 micro_batch: int | None = None):
        if not isinstance(task, Task):
            raise TaskTypeError(f"expected a swarm.Task, got {type(task).__name__}")
        self.task = task
        self.seed = seed
        self.device = torch.device(device)
        self.table_lr = table_lr or task.table_lr
        # samples per forward/backward (0: the whole batch at once); the gradient is their
        # sample-weighted sum, so the loss must be a mean over the batch's samples
        self.micro_batch = task.micro_batch if micro_batch is None else micro_batch
        with _BUILD, torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = call_user("model()", task.model)
        if not isinstance(model, nn.Module):
            raise TaskTypeError(f"the task's model() returned a {type(model).__name__}, not a torch.nn.Module")
        self.modules: dict[str, ShardedEmbedding] = swap_tables(model, task.tables)
        self.model = model.to(self.device)
        self.ids_of = {name: task.tables[path] for name, path in zip(self.modules, task.tables)}
        self.paths = dict(zip(self.modules, task.tables))  # table name -> module path
        for emb in self.modules.values():
            emb.weight.device = self.device
        self.table_specs = [TableSpec(name, m.num_embeddings, m.embedding_dim) for name, m in self.modules.items()]
        self.table_inits = {name: m.init_rows for name, m in self.modules.items()}

        seen: set[int] = set()
        self.params: list[nn.Parameter] = []
        self.names: list[str] = []
        self.frozen: dict[str, torch.Tensor] = {}
        for name, p in self.model.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            if p.requires_grad:
                self.params.append(p)
                self.names.append(name)
            else:
                self.frozen[name] = p
        param_names = {n for n, _ in self.model.named_parameters(remove_duplicate=False)}
        self.buffers: dict[str, torch.Tensor] = {
            n: t for n, t in self.model.state_dict(keep_vars=True).items() if n not in param_names}
        self.flowing = [n for n, b in self.buffers.items() if b.dtype != torch.bool and not b.dtype.is_complex]
        entries = [ManifestEntry(n, tuple(p.shape), str(p.dtype).removeprefix("torch.")) for n, p in zip(self.names, self.params)]
        entries += [ManifestEntry(n, tuple(self.buffers[n].shape), str(self.buffers[n].dtype).removeprefix("torch."),
                                  kind="buffer") for n in self.flowing]
        if not entries:
            raise TaskError("the task's model has no trainable parameter and no buffer: nothing to train")
        self.manifest = Manifest(tuple(entries))

        self.opt = call_user("optimizer()", task.optimizer, self.params) if task.optimizer is not None \
            else optim.AdamW(self.params, lr=1e-3)
        if not isinstance(self.opt, torch.optim.Optimizer):
            raise TaskTypeError(f"the task's optimizer() returned a {type(self.opt).__name__}, not a "
                                "torch.optim.Optimizer")
        self.sched = call_user("scheduler()", task.scheduler, self.opt) if task.scheduler is not None else None
        if self.sched is not None and not (callable(getattr(self.sched, "step", None))
                                           and callable(getattr(self.sched, "state_dict", None))):
            raise TaskTypeError(f"the task's scheduler() returned a {type(self.sched).__name__}, not an lr scheduler")
        self.step = 0  # rounds applied to this replica
        self.val: list = []
        if task.eval_batches is not None:
            val = call_user("eval_batches()", task.eval_batches)
            if isinstance(val, (str, bytes)) or not hasattr(val, "__iter__"):
                raise TaskTypeError(f"the task's eval_batches() returned a {type(val).__name__}, not a list of batches")
            self.val = list(val)
        self.shard: Shard | None = None
        self._batches: Iterator | None = None
        self.nonfinite = 0  # steps whose loss was not finite
        self.nonfinite_run = 0  # ... in a row, now
        # local steps (use_local_steps): the shared model as a flat vector and its outer optimizer;
        # the model's own parameters are then this peer's local copy
        self.outer: OuterOptimizer | None = None
        self.global_flat = torch.zeros(0)
        # overlapped windows (end_window(keep=True)): where the window being computed started, and
        # our last window's pseudo-gradient, sent but not yet aggregated
        self.anchor: torch.Tensor | None = None
        self.pending: torch.Tensor | None = None
        self.pending_window = -1
        # overlapped per-step rounds (predict_ahead): the parameters' change in the last round
        # applied, by which a step computed one round ahead extrapolates them (compute(ahead=True))
        self.predict_ahead = False
        self.last_change: list[torch.Tensor] | None = None
        self.optimizer_desc = self._describe_optimizer()
        self.fingerprint = self._fingerprint()

    # -- identity ---------------------------------------------------------------------------
    def _describe_optimizer(self) -> str:
        """The optimizer's class and the non-tensor hyperparameters of its param groups, as they are
        when it is built ("AdamW g0.lr=0.001 g0.betas=(0.9,0.999) ..."; a scheduler's initial_lr
        stands for lr): what a joiner's optimizer must match."""
        parts = [type(self.opt).__qualname__]
        for i, g in enumerate(self.opt.param_groups):
            for k in sorted(g):
                if k in ("params", "initial_lr") or isinstance(g[k], torch.Tensor):
                    continue
                v = g.get("initial_lr", g[k]) if k == "lr" else g[k]
                parts.append(f"g{i}.{k}={repr(v).replace(' ', '')}")
        return " ".join(parts)

    def _fingerprint(self) -> dict[str, str]:
        """What every peer of a swarm must agree on (compared at join, docs/task.md)."""
        desc = [[n, list(t.shape), str(t.dtype).removeprefix("torch."), kind]
                for kind, items in (("param", zip(self.names, self.params)), ("frozen", self.frozen.items()),
                                    ("buffer", self.buffers.items()))
                for n, t in items]
        model = hashlib.sha256(json.dumps(desc, separators=(",", ":")).encode()).hexdigest()[:16]
        tables = ",".join(f"{s.name}:{s.rows}x{s.dim}" for s in self.table_specs)
        return {"name": self.task.name, "version": self.task.version, "model": model, "tables": tables,
                "seed": str(self.seed), "data": self.task.data_id, "optimizer": self.optimizer_desc}

    @property
    def numel(self) -> int:
        return self.manifest.numel

    # -- data -------------------------------------------------------------------------------
    def set_shard(self, index: int, count: int, seed: int) -> None:
        """Draw batches from this peer's shard (a new iterator of the task's batches)."""
        self.shard = Shard(index, count, seed, 0)
        self._batches = iter(call_user("batches()", self.task.batches, self.shard))

    def next_batch(self) -> Any:
        assert self._batches is not None and self.shard is not None, "set_shard first"
        for _ in range(2):
            try:
                return call_user("batches() iterator", next, self._batches)
            except UserCodeError as e:
                if not isinstance(e.__cause__, StopIteration):
                    raise
            # a finite iterator ended: the next epoch of the same shard
            self.shard = Shard(self.shard.index, self.shard.count, self.shard.seed, self.shard.epoch + 1)
            self._batches = iter(call_user("batches()", self.task.batches, self.shard))
        raise TaskError("the task's batches() gave no batch for this shard (an empty iterator, twice)")

    def sample(self) -> tuple[Any, dict[str, np.ndarray]]:
        """The next batch of this peer's shard and the sorted-unique table rows it touches."""
        batch = self.next_batch()
        return batch, self.rows_of(batch)

    def rows_of(self, batch: Any) -> dict[str, np.ndarray]:
        """{table: sorted-unique int64 ids} the batch reads, checked (integers, in range)."""
        out = {}
        for name, fn in self.ids_of.items():
            ids = call_user(f"tables[{self.paths[name]!r}]", fn, batch)
            if isinstance(ids, torch.Tensor):
                if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
                    raise TaskTypeError(f"tables[{self.paths[name]!r}](batch) returned {ids.dtype} ids: ids "
                                        "must be integers")
                arr = ids.detach().reshape(-1).cpu().to(torch.int64).numpy()
            elif isinstance(ids, np.ndarray) and np.issubdtype(ids.dtype, np.integer):
                arr = ids.reshape(-1).astype(np.int64)
            else:
                raise TaskTypeError(f"tables[{self.paths[name]!r}](batch) returned a "
                                    f"{getattr(ids, 'dtype', type(ids).__name__)}: it must be an integer tensor")
            rows = self.modules[name].num_embeddings
            if arr.size and (arr.min() < 0 or arr.max() >= rows):
                bad = int(arr.min()) if arr.min() < 0 else int(arr.max())
                raise TaskError(f"tables[{self.paths[name]!r}](batch) returned id {bad}, outside the table's "
                                f"0..{rows - 1}")
            out[name] = np.unique(arr)
        return out

    # -- one step ---------------------------------------------------------------------------
    def _bind(self, want: dict[str, np.ndarray], rows: dict[str, torch.Tensor], grad: bool) -> dict[str, torch.Tensor]:
        leaves = {}
        for name, mod in self.modules.items():
            r = rows[name].detach().to(self.device, copy=True)
            if grad:
                r.requires_grad_(True)
            leaves[name] = r
            mod.bind(torch.from_numpy(want[name]).to(self.device), r)
        return leaves

    def _unbind(self) -> None:
        for mod in self.modules.values():
            mod.unbind()

    def _loss(self, batch: Any) -> torch.Tensor:
        loss = call_user("loss()", self.task.loss, self.model, batch)
        if not isinstance(loss, torch.Tensor):
            raise TaskTypeError(f"the task's loss() returned a {type(loss).__name__}, not a tensor")
        if loss.numel() != 1:
            raise TaskError(f"the task's loss() returned a tensor of shape {tuple(loss.shape)}: it must be a "
                            "scalar (e.g. take .mean())")
        if not loss.dtype.is_floating_point:
            raise TaskTypeError(f"the task's loss() returned a {loss.dtype} tensor: it must be floating point")
        return loss.reshape(())

    def compute(self, batch: Any, want: dict[str, np.ndarray], rows: dict[str, torch.Tensor], ahead: bool = False
                ) -> tuple[StepStats, torch.Tensor, dict[str, tuple[np.ndarray, torch.Tensor]]]:
        """Forward and backward on ``batch`` with the pulled table ``rows`` (fp32, in ``want`` order).

        Returns the stats, the flat fp32 vector (parameter gradients, then the buffers' change) and
        the gradient of every pulled row: {table: (ids, grads [len(ids), d])}. A non-finite loss
        gives a zero vector and no row gradients (the step is skipped and counted).

        ``ahead`` (overlapped rounds): the gradient will be applied one round after the next one,
        so it is taken at the parameters extrapolated by the last round's change, a guess of where
        the next round puts them (weight prediction, docs/design.md); the replica itself is untouched."""
        with self._predicted(ahead):
            loss, finite, leaves, before = self._forward_backward(batch, want, rows)
        flat = torch.zeros(self.manifest.numel, dtype=torch.float32)
        row_grads: dict[str, tuple[np.ndarray, torch.Tensor]] = {}
        with torch.no_grad():
            if finite:
                views = self.manifest.unflatten(flat)
                for name, p in zip(self.names, self.params):
                    if p.grad is not None:
                        views[name].copy_(p.grad.detach())
                for name in self.flowing:
                    views[name].copy_((self.buffers[name].detach().double() - before[name].double()).float())
                if not bool(torch.isfinite(flat).all()):
                    finite = False
                    flat.zero_()
        self._undo(before)
        if finite:
            row_grads = {name: (want[name], leaves[name].grad.cpu() if leaves[name].grad is not None
                                else torch.zeros(leaves[name].shape)) for name in want}
            self.nonfinite_run = 0
        else:
            row_grads = {name: (want[name][:0], torch.zeros(0, self.modules[name].embedding_dim)) for name in want}
            self.nonfinite += 1
            self.nonfinite_run += 1
        stats = StepStats(loss=float(loss.detach()), samples=samples_of(batch), grad_norm=float(flat.norm()),
                          finite=finite)
        return stats, flat, row_grads

    @contextlib.contextmanager
    def _predicted(self, ahead: bool):
        """The parameters as the last round's change extrapolates them, for the duration (the
        replica's own tensors are put back exactly, not recomputed)."""
        change = self.last_change if ahead and self.predict_ahead else None
        if change is None:
            yield
            return
        held = [p.data for p in self.params]
        with torch.no_grad():
            for p, d in zip(self.params, change):
                p.data = p.data + d
        try:
            yield
        finally:
            for p, h in zip(self.params, held):
                p.data = h

    def rehearse(self, batch: Any, want: dict[str, np.ndarray], rows: dict[str, torch.Tensor]) -> None:
        """Forward and backward on ``batch`` again with everything discarded: gradients, buffer
        changes and random draws (--compute-speed: a peer slowed for a test or a benchmark spends
        the CPU a slower machine would, instead of sleeping and freeing the cores)."""
        with torch.random.fork_rng(devices=[]):
            before = self._forward_backward(batch, want, rows)[3]
        self._undo(before)

    def _forward_backward(self, batch: Any, want: dict[str, np.ndarray], rows: dict[str, torch.Tensor]
                          ) -> tuple[torch.Tensor, bool, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The task's loss on ``batch`` with ``rows`` bound, and its backward when finite: (loss,
        finite, the bound row leaves, the buffers as they were before)."""
        self.model.train()
        for p in self.params:
            p.grad = None
        before = {n: b.detach().clone() for n, b in self.buffers.items()}
        leaves = self._bind(want, rows, grad=True)
        try:
            pieces = split_batch(batch, self.micro_batch) if self.micro_batch else [(batch, 0)]
            total = sum(n for _, n in pieces)
            loss, finite = None, True
            for piece, n in pieces:  # micro-batches: gradients (params and row leaves) accumulate
                part = self._loss(to_device(piece, self.device))
                if len(pieces) > 1:
                    part = part * (n / total)
                loss = part.detach() if loss is None else loss + part.detach()
                finite = bool(torch.isfinite(part.detach()))
                if not finite:
                    break
                call_user("loss().backward()", part.backward)
        finally:
            self._unbind()
        return loss, finite, leaves, before

    @torch.no_grad()
    def _undo(self, before: dict[str, torch.Tensor]) -> None:
        """The buffers back to ``before`` and no gradients left: a step changes the replica only
        through the aggregate (apply_aggregate)."""
        for name, b in self.buffers.items():
            b.copy_(before[name])
        for p in self.params:
            p.grad = None

    def check(self) -> None:
        """Try the task once before the peer listens: a batch, its ids, a forward and backward
        (nothing of the replica changes). TaskError or UserCodeError name what is wrong."""
        with torch.random.fork_rng(devices=[]):
            it = iter(call_user("batches()", self.task.batches, Shard(0, 1, self.seed, 0)))
            try:
                batch = call_user("batches() iterator", next, it)
            except UserCodeError as e:
                if isinstance(e.__cause__, StopIteration):
                    raise TaskError("the task's batches() gave no batch (an empty iterator)") from None
                raise
            want = self.rows_of(batch)
            rows = {t: torch.zeros(len(ids), self.modules[t].embedding_dim) for t, ids in want.items()}
            run = self.nonfinite, self.nonfinite_run
            self.compute(batch, want, rows)
            self.nonfinite, self.nonfinite_run = run
            for b in self.val[:1]:
                self.rows_of(b)

    @torch.no_grad()
    def apply_aggregate(self, agg: torch.Tensor, step: int, count: int) -> None:
        """Step on ``agg`` (a flat fp32 vector in manifest order) as round ``step``'s, where ``count``
        contributions were combined (none: no step). Every peer steps on the same bits.

        Every step a round: the optimizer (then the scheduler) on the parameters, the change added
        to the buffers. Local steps: the outer step on the global vector, and the local model set
        to it (its own window's progress comes back through the aggregate, docs/design.md)."""
        if self.outer is not None:
            if count:
                self.outer.step(self.global_flat, agg)
            if self.pending is not None and self.pending_window > step:
                # overlapped: the new global model plus our own later window, not aggregated yet
                self._write_local(self.global_flat - self.pending)
                self.anchor = self._flat_local()
            else:
                self._write_local(self.global_flat)
                self.anchor = self.pending = None
        elif count:
            self._optimizer_step(agg)
        self.step = step + 1

    @torch.no_grad()
    def _optimizer_step(self, vec: torch.Tensor) -> None:
        """The task's optimizer (then its scheduler) on ``vec``'s gradients; its buffer change added.
        ``vec`` goes to the device in one copy, not one per tensor (on a GPU the small examples'
        apply took longer than on two CPU cores; the per-tensor copies were the suspect)."""
        views = self.manifest.unflatten(vec.to(self.device))
        for name, p in zip(self.names, self.params):
            p.grad = views[name].to(self.device, p.dtype)
        was = [p.detach().clone() for p in self.params] if self.predict_ahead else None
        self.opt.step()
        if was is not None:
            for w, p in zip(was, self.params):
                torch.sub(p.detach(), w, out=w)  # the copy becomes the change
            self.last_change = was
        if self.sched is not None:
            self.sched.step()
        for p in self.params:
            p.grad = None
        for name in self.flowing:
            b = self.buffers[name]
            b.add_(_as_dtype(views[name].to(self.device), b.dtype))

    # -- local steps (--sync-every H; docs/design.md, "Local steps") ----------------------------
    def use_local_steps(self, cfg: OuterConfig) -> None:
        """Train in windows: inner steps on the local model, one outer step per window on the
        global vector (every trainable parameter, then every numeric buffer: the manifest's flat
        space), which starts as the model is now."""
        n_params = sum(int(p.numel()) for p in self.params)
        self.outer = OuterOptimizer(self.numel, n_params, cfg)
        self.global_flat = self._flat_local()

    @torch.no_grad()
    def _flat_local(self) -> torch.Tensor:
        return self.manifest.flatten({**dict(zip(self.names, self.params)),
                                      **{n: self.buffers[n] for n in self.flowing}})

    @torch.no_grad()
    def _write_local(self, flat: torch.Tensor) -> None:
        views = self.manifest.unflatten(flat.to(self.device))  # one copy to the device
        for name, p in zip(self.names, self.params):
            p.copy_(views[name].to(self.device, p.dtype))
        for name in self.flowing:
            b = self.buffers[name]
            b.copy_(_as_dtype(views[name].to(self.device), b.dtype))

    def inner_step(self, batch: Any, want: dict[str, np.ndarray], rows: dict[str, torch.Tensor]
                   ) -> tuple[StepStats, dict[str, tuple[np.ndarray, torch.Tensor]]]:
        """One step of the task's optimizer on the local model (a non-finite loss: no step), its
        buffers keeping their change; returns the stats and the pulled rows' gradients."""
        stats, flat, row_grads = self.compute(batch, want, rows)
        if stats.finite:
            self._optimizer_step(flat)
        return stats, row_grads

    @torch.no_grad()
    def end_window(self, keep: bool = False, window: int = 0) -> torch.Tensor:
        """The window's pseudo-gradient (where the window started minus local, fp32 in manifest
        order). Without ``keep`` the local model starts the next window from the global vector.
        With ``keep`` (overlapped windows; ``window`` is this one's round) it goes on from where it
        is: the next window starts from the global model plus our own progress that no round has
        aggregated yet, and when an earlier round lands (apply_aggregate) the local model becomes
        the new global vector minus this window's pseudo-gradient (docs/design.md, "Local steps")."""
        local = self._flat_local()
        delta = (self.anchor if self.anchor is not None else self.global_flat) - local
        if keep:
            self.anchor, self.pending, self.pending_window = local, delta, window
        else:
            self.anchor = self.pending = None
            self._write_local(self.global_flat)
        return delta

    @torch.no_grad()
    def local_progress(self) -> torch.Tensor:
        """The local model minus where its window started (``end_window(keep=True)``'s point, else
        the global vector): the progress of inner steps taken since (fp32, manifest order)."""
        return self._flat_local() - (self.anchor if self.anchor is not None else self.global_flat)

    @torch.no_grad()
    def resume_local(self, progress: torch.Tensor) -> None:
        """The local model becomes the global vector plus ``progress``: inner steps taken on our own
        model while a round travelled (--early-step), carried onto the round's outer step; the
        window's pseudo-gradient is then measured from the global vector, so it counts them once."""
        self._write_local(self.global_flat + progress)

    def skip_schedule(self, steps: int) -> None:
        """Move the task's scheduler on by ``steps`` steps without an optimizer step: a window cut
        short (a slow peer's) keeps the learning rate where the swarm's is."""
        if self.sched is not None:
            for _ in range(steps):
                self.sched.step()

    def lr(self) -> float | None:
        """The first parameter group's learning rate now."""
        return float(self.opt.param_groups[0]["lr"]) if self.opt.param_groups else None

    # -- evaluation -------------------------------------------------------------------------
    @torch.no_grad()
    def eval_loss(self, batch: Any, want: dict[str, np.ndarray], rows: dict[str, torch.Tensor]) -> float:
        """Loss on one held-out batch in eval mode (the node pulls its rows)."""
        self.model.eval()
        self._bind(want, rows, grad=False)
        try:
            return float(self._loss(to_device(batch, self.device)))
        finally:
            self._unbind()
            self.model.train()

    @torch.no_grad()
    def sketch(self) -> list[float]:
        """param_sketch over the trainable parameters, then every numeric buffer (manifest order);
        with local steps, over the global vector (the local copies differ by design)."""
        if self.outer is not None:
            return param_sketch(list(self.manifest.unflatten(self.global_flat).values()))
        return param_sketch([*self.params, *(self.buffers[n] for n in self.flowing)])

    # -- state transfer ---------------------------------------------------------------------
    @torch.no_grad()
    def state_blob(self) -> bytes:
        """Model state, optimizer and scheduler state as one safetensors blob (GET /v1/state)."""
        tensors: dict[str, torch.Tensor] = {}
        shared = self.manifest.unflatten(self.global_flat) if self.outer is not None else {}
        for name, p in [*zip(self.names, self.params), *self.frozen.items()]:
            t = shared[name].to(p.dtype) if name in shared else p.detach()  # local steps: the global model
            tensors["p." + name] = t.cpu().contiguous()
        for name, b in self.buffers.items():
            t = _as_dtype(shared[name], b.dtype) if name in shared else b.detach()
            tensors["b." + name] = t.cpu().contiguous()
        if self.outer is not None:  # the shared vector exactly (a bf16 model rounds it) and the outer momentum
            tensors["w.global"] = self.global_flat.clone()
            tensors["w.momentum"] = self.outer.momentum.clone()
        opt_tree, opt_tensors = statedict.pack(self.opt.state_dict(), "o.")
        tensors.update(opt_tensors)
        sched_tree, sched_tensors = statedict.pack(self.sched.state_dict() if self.sched is not None else None, "s.")
        tensors.update(sched_tensors)
        meta = {"format": STATE_FORMAT, "step": str(self.step), "fingerprint": json.dumps(self.fingerprint),
                "optimizer": statedict.dumps(opt_tree), "scheduler": statedict.dumps(sched_tree)}
        return st_save(tensors, metadata=meta)

    @torch.no_grad()
    def load_state_blob(self, blob: bytes) -> int:
        """Replace model, optimizer and scheduler state from a peer's blob; returns its step.

        Everything is checked before anything is written, so a bad blob leaves the replica as it was.
        """
        try:
            tensors = st_load(blob)
            meta = safetensors_metadata(blob)
        except Exception as e:  # safetensors raises its own error types on malformed input
            raise StateError(f"malformed state blob: {e}") from None
        if meta.get("format") != STATE_FORMAT:
            raise StateError(f"state format {meta.get('format')!r}, expected {STATE_FORMAT!r}")
        try:
            theirs = json.loads(meta.get("fingerprint", ""))
        except ValueError:
            theirs = None
        if theirs != self.fingerprint:
            what = [k for k in self.fingerprint if not isinstance(theirs, dict) or theirs.get(k) != self.fingerprint[k]]
            raise StateError(f"state was made for another task (its {', '.join(what) or 'fingerprint'} differs)")
        try:
            step = int(meta["step"])
        except (KeyError, ValueError):
            raise StateError("state metadata lacks a valid step") from None
        if step < 0:
            raise StateError("negative step in state")
        model = {**dict(zip(self.names, self.params)), **self.frozen}
        expected = {"p." + n for n in model} | {"b." + n for n in self.buffers}
        named = {k for k in tensors if k[:2] in ("p.", "b.")}
        if named != expected:
            extra = sorted(named - expected)[:3]
            missing = sorted(expected - named)[:3]
            raise StateError(f"state tensors do not match the model (missing {missing}, unexpected {extra})")
        for key, ref in [*(("p." + n, t) for n, t in model.items()), *(("b." + n, t) for n, t in self.buffers.items())]:
            t = tensors[key]
            if t.shape != ref.shape or t.dtype != ref.dtype:
                raise StateError(f"{key}: shape {tuple(t.shape)} {t.dtype}, expected {tuple(ref.shape)} {ref.dtype}")
            if t.dtype.is_floating_point and not torch.isfinite(t).all():
                raise StateError(f"{key} holds non-finite values")
        try:
            opt_sd = statedict.unpack(statedict.loads(meta.get("optimizer", "")), tensors, "o.")
            sched_sd = statedict.unpack(statedict.loads(meta.get("scheduler", "")), tensors, "s.")
            self._check_optimizer_state(opt_sd)
            if self.sched is None:
                if sched_sd is not None:
                    raise StateDictError("the state has a scheduler, this task has none")
            else:
                statedict.same_shape(self.sched.state_dict(), sched_sd, "scheduler")
        except StateDictError as e:
            raise StateError(f"optimizer or scheduler state: {e}") from None
        window_keys = {k for k in tensors if k[:2] == "w."}
        if set(tensors) - expected - window_keys - {k for k in tensors if k[:2] in ("o.", "s.")}:
            raise StateError("state holds tensors of no known kind")
        if self.outer is not None:
            if window_keys != {"w.global", "w.momentum"}:
                raise StateError("state lacks the global vector of local steps (a peer without --sync-every?)")
            g = tensors["w.global"]
            if g.dtype != torch.float32 or tuple(g.shape) != (self.numel,) or not torch.isfinite(g).all():
                raise StateError(f"w.global must be finite float32 [{self.numel}], got {g.dtype} {tuple(g.shape)}")
            try:
                probe = OuterOptimizer(self.numel, self.outer.n_params, self.outer.cfg)
                probe.load_state_dict({"momentum": tensors["w.momentum"]})
            except ValueError as e:
                raise StateError(str(e)) from None
        elif window_keys:
            raise StateError("state holds local-step tensors, this peer trains without --sync-every")
        try:
            self.opt.load_state_dict(opt_sd)  # builds the new state whole before it replaces the old one
        except (ValueError, KeyError, TypeError, RuntimeError) as e:
            raise StateError(f"optimizer state does not load: {e}") from None
        if self.sched is not None:
            self.sched.load_state_dict(sched_sd)
        for n, t in model.items():
            t.copy_(tensors["p." + n])
        for n, b in self.buffers.items():
            b.copy_(tensors["b." + n])
        if self.outer is not None:
            self.global_flat = tensors["w.global"].clone()
            self.outer.load_state_dict({"momentum": tensors["w.momentum"]})
            self.anchor = self.pending = None
            self._write_local(self.global_flat)
        self.last_change = None  # a change from before the snapshot predicts nothing
        self.step = step
        return step

    def _check_optimizer_state(self, sd: Any) -> None:
        """A downloaded optimizer state_dict fits our optimizer: the same groups, parameters and
        hyperparameter kinds; per-parameter state of known parameters, finite, no larger than its
        parameter (plus scalars such as Adam's step)."""
        ours = self.opt.state_dict()
        if not isinstance(sd, dict) or set(sd) != set(ours):
            raise StateDictError("optimizer state_dict keys differ")
        statedict.same_shape(ours["param_groups"], sd["param_groups"], "param_groups")
        for g_ours, g in zip(ours["param_groups"], sd["param_groups"]):
            if g_ours["params"] != g["params"]:
                raise StateDictError("param_groups hold other parameters")
        state = sd["state"]
        if not isinstance(state, dict):
            raise StateDictError("optimizer state is not a map")
        by_index = dict(enumerate(self.params))
        for idx, entry in state.items():
            if not isinstance(idx, int) or idx not in by_index or not isinstance(entry, dict):
                raise StateDictError(f"state for unknown parameter {idx!r}")
            p = by_index[idx]
            for key, v in entry.items():
                if not isinstance(key, str):
                    raise StateDictError("per-parameter state keys must be strings")
                if isinstance(v, torch.Tensor):
                    if v.numel() > max(p.numel(), 1) or (v.dtype.is_floating_point and not torch.isfinite(v).all()):
                        raise StateDictError(f"state {key!r} of parameter {idx} is too large or not finite")
                    if v.numel() == p.numel() and v.dim() and tuple(v.shape) != tuple(p.shape):
                        raise StateDictError(f"state {key!r} of parameter {idx} has shape {tuple(v.shape)}")
                elif isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise StateDictError(f"state {key!r} of parameter {idx} is a {type(v).__name__}")
