"""What the command line needs of tasks before torch is imported: the task's error types and the
parsing of ``--task-arg KEY=VALUE``.

They live apart from swarm/task.py (which imports torch) so that ``peer.py`` refuses a bad flag,
or prints ``--help``, in a tenth of a second rather than after torch's ~2 s import; task.py
re-exports them, so ``swarm.task.TaskError`` is the same class.
"""
from __future__ import annotations

from typing import Iterable

__all__ = ["TaskError", "TaskTypeError", "UserCodeError", "parse_task_args"]


class TaskError(ValueError):
    """The task is unusable as given; the message names the problem in one line."""


class TaskTypeError(TaskError, TypeError):
    """A task field, or what a task callable returned, has the wrong type."""


class UserCodeError(Exception):
    """The user's own code raised inside ``where`` (its exception is ``__cause__``)."""

    def __init__(self, where: str, exc: BaseException):
        super().__init__(f"the task's {where} raised {type(exc).__name__}: {exc}")
        self.where = where


def parse_task_args(items: Iterable[str]) -> dict[str, str]:
    """["KEY=VALUE", ...] -> {KEY: VALUE} (values still text; load_task converts them)."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise TaskError(f"--task-arg {item!r} is not KEY=VALUE")
        if key in out:
            raise TaskError(f"--task-arg {key} is given twice")
        out[key] = value
    return out
