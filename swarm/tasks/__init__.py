"""Tasks that ship with swarm. ``bytelm`` is the built-in default: a byte-level LM on the Python
standard library's sources (or the user's text files), sized by its task args."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..task import Task, TaskError, UserCodeError, call_with_args

if TYPE_CHECKING:
    from ..config import PeerConfig

# built-in flag -> the built-in task's argument it sets
BUILTIN_FLAGS = {"batch_size": "batch_size", "lr": "lr", "data": "data", "table_rows": "table_rows",
                 "eval_batches": "eval_batches"}


def default_task(cfg: "PeerConfig") -> Task:
    """The built-in byte LM, sized by ``cfg.task_args`` (d_model, layers, heads, context, table_rows)
    and the built-in flags (--batch-size, --lr, --data, --table-rows, --eval-batches)."""
    from . import bytelm

    fixed = {arg: getattr(cfg, flag) for flag, arg in BUILTIN_FLAGS.items()}
    fixed["steps"] = cfg.budget or cfg.steps  # the schedule's cosine ends at the swarm's budget
    for flag, arg in BUILTIN_FLAGS.items():
        if arg in cfg.task_args:
            if flag in cfg.given:
                raise TaskError(f"--{flag.replace('_', '-')} and --task-arg {arg} both set {arg}: give one")
            del fixed[arg]
    if "steps" in cfg.task_args:
        raise TaskError("--task-arg steps: the built-in task's schedule follows the swarm's budget (--budget)")
    try:
        return call_with_args(bytelm.task, cfg.task_args, "the built-in task", fixed)
    except UserCodeError as e:  # its own checks (a size out of range, --data unusable): one line
        if isinstance(e.__cause__, ValueError):
            raise TaskError(str(e.__cause__)) from None
        raise
