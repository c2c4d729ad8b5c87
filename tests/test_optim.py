"""swarm.optim: torch's Adam and AdamW without importing torch._dynamo, bit for bit the same."""
from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR

from swarm import optim
from swarm.tasks.bytelm import lr_at

from .conftest import ROOT


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                               torch.nn.Linear(32, 8))


def _train(opt_cls, steps: int, start: dict | None = None, **kw):
    """``steps`` steps of ``opt_cls`` with the built-in task's schedule on a fixed model and data;
    with ``start`` (an optimizer and scheduler state_dict and parameters), from there."""
    model = _model()
    opt = opt_cls(model.parameters(), **kw)
    sched = LambdaLR(opt, lambda s: lr_at(s, 3e-3, 30) / 3e-3)
    if start is not None:
        start = copy.deepcopy(start)  # load_state_dict keeps the state's tensors, and steps update them
        model.load_state_dict(start["model"])
        opt.load_state_dict(start["opt"])
        sched.load_state_dict(start["sched"])
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(12, 16, generator=gen), torch.randn(12, 8, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()
    return model, opt, sched


def _same(a, b) -> bool:
    """Parameters and optimizer state equal to the bit."""
    (ma, oa, _), (mb, ob, _) = a, b
    if not all(torch.equal(p, q) for p, q in zip(ma.parameters(), mb.parameters())):
        return False
    sa, sb = oa.state_dict(), ob.state_dict()
    return sa["param_groups"] == sb["param_groups"] and sa["state"].keys() == sb["state"].keys() and all(
        torch.equal(sa["state"][i][k], sb["state"][i][k]) for i in sa["state"] for k in sa["state"][i])


@pytest.mark.parametrize("ours, theirs, kw", [
    (optim.Adam, torch.optim.Adam, dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8)),  # the built-in task's
    (optim.Adam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),
    (optim.Adam, torch.optim.Adam, dict(lr=1e-2, foreach=False)),
    (optim.AdamW, torch.optim.AdamW, dict(lr=1e-3)),  # swarm's default optimizer
    (optim.AdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.5, maximize=True)),
])
def test_the_same_steps_as_torch_to_the_bit(ours, theirs, kw):
    ref, got = _train(theirs, 25, **kw), _train(ours, 25, **kw)
    assert _same(ref, got)
    assert not torch.equal(next(ref[0].parameters()), next(_model().parameters()))  # it did train
    assert type(got[1]).__qualname__ == theirs.__qualname__  # what a task's fingerprint records
    assert isinstance(got[1], theirs) and got[1].param_groups[0]["lr"] == ref[1].param_groups[0]["lr"]


def test_state_dicts_load_across_and_resume_the_same():
    """A checkpoint of torch's Adam resumes in ours (and back) exactly as in its own class."""
    kw = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    for first, then in ((torch.optim.Adam, optim.Adam), (optim.Adam, torch.optim.Adam)):
        m, o, s = _train(first, 12, **kw)
        start = {"model": m.state_dict(), "opt": o.state_dict(), "sched": s.state_dict()}
        across, along = _train(then, 8, start=start, **kw), _train(first, 8, start=start, **kw)
        assert _same(across, along)
        assert across[2].last_epoch == 20 and across[1].state_dict()["state"][0]["step"] == 20


@pytest.mark.parametrize("grad_mode", [True, False])
def test_step_records_no_graph_and_leaves_the_grad_mode_as_it_was(grad_mode):
    w = torch.nn.Parameter(torch.ones(3))
    opt = optim.Adam([w], lr=0.1)
    w.grad = torch.ones(3)
    with torch.set_grad_enabled(grad_mode):
        opt.step()
        assert torch.is_grad_enabled() is grad_mode
    assert w.grad_fn is None and opt.state[w]["exp_avg"].grad_fn is None
    assert torch.allclose(w.detach(), torch.full((3,), 0.9))


CHILD = r"""
import sys
sys.path.insert(0, sys.argv[1])
import torch
from torch.optim.lr_scheduler import LambdaLR
from swarm import optim
from swarm.tasks.bytelm import task
t = task(d_model=32, layers=1, table_rows=1024, batch_size=2, context=16, eval_batches=1)
for make in (t.optimizer, lambda p: optim.AdamW(p, lr=1e-3)):
    m = torch.nn.Linear(4, 2)
    opt = make(list(m.parameters()))
    sched = t.scheduler(opt) if make is t.optimizer else LambdaLR(opt, lambda s: 1.0)
    for _ in range(3):
        opt.zero_grad()
        m(torch.randn(5, 4)).sum().backward()
        opt.step()
        sched.step()
    opt.load_state_dict(opt.state_dict())
    sched.load_state_dict(sched.state_dict())
    opt.zero_grad(set_to_none=False)
print(" ".join(m for m in ("torch._dynamo", "sympy") if m in sys.modules) or "none")
"""


def test_building_stepping_and_saving_them_imports_no_torch_dynamo():
    out = subprocess.run([sys.executable, "-c", CHILD, str(ROOT)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "none"


def test_the_builtin_tasks_fingerprint_is_as_with_torchs_adam():
    """Peers built with torch.optim.Adam (earlier code) and with ours agree on the task: the same
    class name and hyperparameters, and the same arithmetic."""
    from swarm.replica import Replica
    from swarm.tasks.bytelm import task

    small = dict(d_model=32, layers=1, table_rows=1024, batch_size=2, context=16, eval_batches=1)
    ours, theirs = task(**small), task(**small)
    theirs.optimizer = lambda params: torch.optim.Adam(params, lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    a, b = Replica(ours, seed=0), Replica(theirs, seed=0)
    assert type(a.opt) is optim.Adam and type(b.opt) is torch.optim.Adam
    assert a.fingerprint == b.fingerprint
