"""torch.optim.Adam and AdamW that run eagerly, without importing torch._dynamo.

Every ``torch.optim.Optimizer`` method that a training loop calls (``add_param_group``, which the
constructor calls, ``state_dict``, ``load_state_dict``, ``zero_grad`` and ``step``) is wrapped by
torch in a guard for torch.compile that imports ``torch._dynamo`` on its first call: about 800
modules, sympy among them, ~73 MB of resident memory in each process that builds an optimizer
(docs/benchmarks.md, "Memory per peer"). Outside torch.compile the guard only calls the function
it wraps, so these classes are torch's own optimizers with those methods bound to the functions
torch wraps (``inspect.unwrap``): the same code, the same arithmetic bit for bit, the same
``state_dict`` (a checkpoint of one loads into the other), the same class names (what a task's
fingerprint records), and still ``torch.optim.Optimizer`` instances, so torch's lr schedulers take
them. Not for a model that is torch.compile'd: that is what the guards are for.

The built-in task and swarm's default optimizer use them; a task may too (docs/task.md).
"""
from __future__ import annotations

import inspect

import torch
from torch.optim import Optimizer

__all__ = ["Adam", "AdamW"]

_adam_step = inspect.unwrap(torch.optim.Adam.step)  # Adam.step's body, under no guard


class _Eager:
    """Optimizer methods without torch's torch.compile guards (mixed in before a torch optimizer)."""

    add_param_group = inspect.unwrap(Optimizer.add_param_group)
    state_dict = inspect.unwrap(Optimizer.state_dict)
    load_state_dict = inspect.unwrap(Optimizer.load_state_dict)
    zero_grad = inspect.unwrap(Optimizer.zero_grad)

    def step(self, closure=None):
        """One optimizer step (torch's Adam.step), with autograd as torch's own step has it:
        recording only for ``differentiable=True``."""
        with torch.set_grad_enabled(self.defaults["differentiable"]):
            return _adam_step(self, closure)


class Adam(_Eager, torch.optim.Adam):
    """``torch.optim.Adam``, the same arguments and results, without importing torch._dynamo."""


class AdamW(_Eager, torch.optim.AdamW):
    """``torch.optim.AdamW``, the same arguments and results, without importing torch._dynamo."""
