"""The Task contract: what a user brings to train (model, data, loss, tables), and how one is loaded.

A Task is a plain dataclass of callables, checked when it is made; swarm calls them on the peer's
training thread (swarm/replica.py). ``load_task("MODULE:ATTR" or "FILE.py:ATTR", args)`` is what
``peer.py --task ... --task-arg KEY=VALUE`` does: ATTR is a Task, or a callable returning one, called
with the task args converted to the types of its parameters.

Two kinds of failure, kept apart on purpose:
  TaskError      the task is wrongly made or wrongly named (a missing module, a loss that is not
                 a scalar, ids out of range, ...): one line naming the problem (the CLI exits 2).
  UserCodeError  the user's own code raised (their model, data or loss): the original exception,
                 with its traceback, is its __cause__, since it is theirs to debug.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from .task_errors import TaskError, TaskTypeError, UserCodeError, parse_task_args

__all__ = ["Task", "Shard", "TaskError", "TaskTypeError", "UserCodeError", "load_task", "call_user",
           "call_with_args", "parse_task_args"]


def call_user(where: str, fn: Callable, *args: Any) -> Any:
    """Call the user's ``fn``; swarm's own TaskErrors pass as they are, anything else the user's code
    raises becomes a UserCodeError naming ``where`` (its traceback kept)."""
    try:
        return fn(*args)
    except (TaskError, UserCodeError):
        raise
    except Exception as e:
        raise UserCodeError(where, e) from e


@dataclass(frozen=True)
class Shard:
    """This peer's share of the data: ``index`` is unique among the contributing peers and < ``count``;
    ``seed`` (in [0, 2**32)) differs per peer; ``epoch`` counts how often a finite iterator of this
    shard ended."""

    index: int
    count: int
    seed: int
    epoch: int = 0

    def __post_init__(self) -> None:
        for what in ("index", "count", "seed", "epoch"):
            v = getattr(self, what)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"Shard.{what} must be an int, got {v!r}")
        if not 0 <= self.index < self.count:
            raise ValueError(f"Shard needs 0 <= index < count, got index {self.index}, count {self.count}")


@dataclass
class Task:
    """What swarm trains (README, "Bring your own model"; docs/task.md).

    name, version     identify the task: peers of one swarm must agree on both (and on the model's
                      parameter and buffer manifest, the tables and the seed: the fingerprint)
    model()           builds the nn.Module; called under the swarm seed on every peer
    batches(shard)    an iterable of this peer's batches (a tensor, or tuples/lists/dicts of them)
    loss(model, b)    a scalar tensor
    eval_batches()    the same fixed list of batches on every peer (val_loss); None: val_loss is null
    tables            {dotted path of an nn.Embedding: batch -> its ids}: sharded, not replicated
    optimizer(params) the dense optimizer (default AdamW, lr 1e-3); scheduler(opt) stepped with it
    table_lr          learning rate of the tables' row-wise Adam
    micro_batch       samples per forward/backward (0: the whole batch): a batch is cut along its
                      tensors' first dimension and the gradients accumulate, weighted by samples
                      (loss must be a mean over the batch); less activation memory, same gradient
    data_id           when set, every peer must train on data with this id (the built-in corpus hash)
    tokens_per_sample for language models: stats count tokens too (samples x this)
    """

    name: str
    model: Callable[[], torch.nn.Module]
    batches: Callable[[Shard], Iterable[Any]]
    loss: Callable[[torch.nn.Module, Any], torch.Tensor]
    eval_batches: Callable[[], Sequence[Any]] | None = None
    tables: Mapping[str, Callable[[Any], Any]] = field(default_factory=dict)
    optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] | None = None
    scheduler: Callable[[torch.optim.Optimizer], Any] | None = None
    table_lr: float = 1e-2
    micro_batch: int = 0
    version: str = "1"
    data_id: str = ""
    tokens_per_sample: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip() or not self.name.isprintable() \
                or len(self.name) > 100:
            raise TaskTypeError(f"Task.name must be a printable, non-empty string of at most 100 characters, "
                                f"got {self.name!r}")
        if not isinstance(self.version, str) or len(self.version) > 100 or not self.version.isprintable():
            raise TaskTypeError(f"Task.version must be a printable string of at most 100 characters, "
                                f"got {self.version!r}")
        for what in ("model", "batches", "loss"):
            if not callable(getattr(self, what)):
                raise TaskTypeError(f"Task.{what} must be callable, got {type(getattr(self, what)).__name__}")
        for what in ("eval_batches", "optimizer", "scheduler"):
            v = getattr(self, what)
            if v is not None and not callable(v):
                raise TaskTypeError(f"Task.{what} must be callable or None, got {type(v).__name__}")
        if not isinstance(self.tables, Mapping):
            raise TaskTypeError(f"Task.tables must be a dict {{module path: batch -> ids}}, "
                                f"got {type(self.tables).__name__}")
        for path, fn in self.tables.items():
            if not isinstance(path, str) or not path or any(not part.isidentifier() and not part.isdigit()
                                                            for part in path.split(".")):
                raise TaskTypeError(f"Task.tables: {path!r} is not a dotted module path (e.g. 'transformer.wte')")
            if not callable(fn):
                raise TaskTypeError(f"Task.tables[{path!r}] must be a callable batch -> ids, got {type(fn).__name__}")
        if isinstance(self.table_lr, bool) or not isinstance(self.table_lr, (int, float)) \
                or not 0 < float(self.table_lr) < 1:
            raise TaskTypeError(f"Task.table_lr must be a float in (0, 1), got {self.table_lr!r}")
        self.table_lr = float(self.table_lr)
        if isinstance(self.micro_batch, bool) or not isinstance(self.micro_batch, int) or self.micro_batch < 0:
            raise TaskTypeError(f"Task.micro_batch must be an int >= 0 (0: the whole batch), got {self.micro_batch!r}")
        if not isinstance(self.data_id, str) or len(self.data_id) > 200:
            raise TaskTypeError(f"Task.data_id must be a string of at most 200 characters, got {self.data_id!r}")
        if isinstance(self.tokens_per_sample, bool) or not isinstance(self.tokens_per_sample, int) \
                or self.tokens_per_sample < 0:
            raise TaskTypeError(f"Task.tokens_per_sample must be an int >= 0, got {self.tokens_per_sample!r}")
        self.tables = dict(self.tables)


# ------------------------------------------------------------------------------------ loading


_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def _convert(fn_name: str, key: str, raw: str, param: inspect.Parameter, hint: Any) -> Any:
    kind = hint if hint is not inspect.Parameter.empty and hint is not None else None
    if kind is None and param.default is not inspect.Parameter.empty and param.default is not None:
        kind = type(param.default)
    origin = typing.get_origin(kind)
    if origin is typing.Union or (origin is not None and type(kind).__name__ == "UnionType"):
        options = [a for a in typing.get_args(kind) if a is not type(None)]
        kind = options[0] if len(options) == 1 else None
    if kind is None or kind is str or kind is Any:
        return raw
    if kind is bool:
        if raw.strip().lower() in _TRUE:
            return True
        if raw.strip().lower() in _FALSE:
            return False
        raise TaskError(f"--task-arg {key}={raw!r}: {fn_name}() wants a bool (true/false, 1/0)")
    if kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            raise TaskError(f"--task-arg {key}={raw!r}: {fn_name}() wants {'an' if kind is int else 'a'} "
                            f"{kind.__name__}") from None
    return raw


def call_with_args(obj: Callable, args: Mapping[str, str], label: str, fixed: Mapping[str, Any] | None = None) -> Any:
    """``obj(**fixed, **converted args)``: each text arg converted to its parameter's type."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        sig = None
    kwargs: dict[str, Any] = dict(fixed or {})
    if args:
        if sig is None:
            raise TaskError(f"{label} takes no --task-arg (its signature cannot be read)")
        params = sig.parameters
        accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        try:
            hints = typing.get_type_hints(obj)
        except Exception:  # unresolvable annotations: fall back to the defaults' types
            hints = {}
        named = [n for n, p in params.items() if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                             inspect.Parameter.KEYWORD_ONLY)]
        for key, raw in args.items():
            if key not in params or params[key].kind not in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                            inspect.Parameter.KEYWORD_ONLY):
                if accepts_any:
                    kwargs[key] = raw
                    continue
                known = ", ".join(named) or "none"
                raise TaskError(f"--task-arg {key}: {label} has no parameter {key!r} (it takes: {known})")
            kwargs[key] = _convert(label, key, raw, params[key], hints.get(key, params[key].annotation))
    if sig is not None:
        try:
            sig.bind(**kwargs)
        except TypeError as e:
            raise TaskError(f"{label} cannot be called with the given task args: {e}") from None
    return call_user(label, lambda: obj(**kwargs))


def _missing_dependency(where: str, e: UserCodeError) -> UserCodeError | TaskError:
    """A task module that imports a package that is not installed: say so in one line."""
    cause = e.__cause__
    if isinstance(cause, ModuleNotFoundError) and cause.name:
        return TaskError(f"--task: {where} imports {cause.name!r}, which is not installed here")
    return e


def _import_file(path: str) -> Any:
    full = os.path.abspath(path)
    if not os.path.isfile(full):
        raise TaskError(f"--task: no such file {path!r}")
    name = "swarm_task_" + os.path.splitext(os.path.basename(full))[0].replace("-", "_").replace(".", "_")
    spec = importlib.util.spec_from_file_location(name, full)
    if spec is None or spec.loader is None:
        raise TaskError(f"--task: {path!r} cannot be imported as a Python file")
    module = importlib.util.module_from_spec(spec)
    folder = os.path.dirname(full)
    if folder not in sys.path:  # the task file may import its neighbours
        sys.path.insert(0, folder)
    sys.modules[name] = module
    try:
        call_user(f"file {path}", spec.loader.exec_module, module)
    except UserCodeError as e:
        sys.modules.pop(name, None)
        raise _missing_dependency(path, e) from e.__cause__
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def _import_module(target: str) -> Any:
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as e:
        if e.name and (target == e.name or target.startswith(e.name + ".")):
            raise TaskError(f"--task: no module named {target!r} (a module path, or a file ending in .py)") from None
        err = UserCodeError(f"module {target}", e)
        err.__cause__ = e
        raise _missing_dependency(target, err) from e
    except (TaskError, UserCodeError):
        raise
    except Exception as e:
        raise UserCodeError(f"module {target}", e) from e


def load_task(spec: str, args: Mapping[str, str] | None = None) -> Task:
    """The Task named by ``spec`` = "MODULE:ATTR" or "path/to/file.py:ATTR" (split on the last ':';
    a path is absolute or relative to the working directory). ATTR may be a Task, or a callable
    returning one, called as ATTR(**args) with each value converted to the type of the parameter's
    annotation or default. TaskError names the problem; UserCodeError when the user's code raised."""
    args = dict(args or {})
    if not isinstance(spec, str) or ":" not in spec:
        raise TaskError(f"--task {spec!r} must be MODULE:ATTR or FILE.py:ATTR")
    target, _, attr = spec.rpartition(":")
    if not target or not attr or not all(part.isidentifier() for part in attr.split(".")):
        raise TaskError(f"--task {spec!r} must be MODULE:ATTR or FILE.py:ATTR")
    is_file = target.endswith(".py") or os.sep in target or "/" in target
    module = _import_file(target) if is_file else _import_module(target)
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise TaskError(f"--task: {target} has no attribute {attr!r}")
        obj = getattr(obj, part)
    label = attr
    if isinstance(obj, Task):
        if args:
            raise TaskError(f"--task {spec}: {attr} is a Task, not a function: it takes no --task-arg")
        return obj
    if not callable(obj):
        raise TaskTypeError(f"--task {spec}: {attr} is a {type(obj).__name__}, neither a swarm.Task nor a "
                            "callable that returns one")
    task = call_with_args(obj, args, f"{label}()")
    if not isinstance(task, Task):
        raise TaskTypeError(f"--task {spec}: {attr}() returned a {type(task).__name__}, not a swarm.Task")
    return task
