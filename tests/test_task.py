"""The Task API: a user's own model trains in a swarm with bit-identical replicas (buffers too), and
every way a task can be wrong is a clear error (TaskError / TaskTypeError), while an exception in
the user's own code keeps its traceback (UserCodeError)."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

import swarm
from swarm.config import ConfigError, PeerConfig
from swarm.node import JoinError, Peer
from swarm.replica import Replica
from swarm.task import Shard, Task, TaskError, TaskTypeError, UserCodeError, load_task

from . import user_task
from .conftest import ROOT
from .test_peer_cli import run_clis

pytestmark = pytest.mark.timeout(240)
HERE = Path(__file__).resolve().parent


def task_cfg(**kw) -> PeerConfig:
    return PeerConfig(**{**dict(threads=1, table_slots=32, progress_interval=0.5, warmup_steps=0, free_run=0,
                                round_timeout=15.0, linger=10.0), **kw})


async def run_peers(task: Task, n: int, steps: int, **kw) -> tuple[list[dict], list[Peer]]:
    first = Peer(task, task_cfg(steps=steps, min_peers=n, **kw), out=lambda line: None)
    await first.start()
    peers = [first]
    try:
        for _ in range(n - 1):
            p = Peer(task, task_cfg(steps=steps, min_peers=n, join=f"127.0.0.1:{first.port}", **kw),
                     out=lambda line: None)
            await p.start()
            peers.append(p)
        summaries = await asyncio.wait_for(asyncio.gather(*(p.run() for p in peers)), 200)
    finally:
        for p in peers:
            await p.close()
    return summaries, peers


async def test_two_peers_train_a_user_task_with_identical_replicas_and_buffers():
    summaries, (a, b) = await run_peers(user_task.task, 2, steps=40, eval_every=20)
    sa, sb = summaries
    assert sa["steps"] == sb["steps"] == 40
    assert sa["param_sketch"] == sb["param_sketch"]  # parameters and buffers, bit for bit
    for name, buf in a.replica.buffers.items():
        assert torch.equal(buf, b.replica.buffers[name]), name
    assert float(a.replica.buffers["norm.running_mean"].abs().sum()) > 0  # the buffers did move
    assert int(a.replica.buffers["norm.num_batches_tracked"]) > 0
    first, final = sa["val_history"][0], sa["val_history"][-1]
    assert first[0] == 0 and final[0] == 40
    assert final[1] <= 0.9 * first[1], sa["val_history"]
    assert sa["val_loss"] == sb["val_loss"]
    # the table is sharded, not part of the replica, and reported under its path
    assert "encoder.tok.weight" not in dict(a.replica.model.named_parameters())
    assert sa["task"]["tables"] == [{"name": "encoder-tok", "path": "encoder.tok", "rows": user_task.ROWS,
                                     "dim": user_task.DIM}]
    assert sa["task"]["name"] == "test-classifier" and sa["samples"] == 40 * 32 and sa["tokens"] == 0
    # the task's own scheduler ran on the swarm's steps: StepLR(10, 0.9) after 40 optimizer steps
    assert sa["lr"] == pytest.approx(3e-2 * 0.9 ** 4) and sa["lr"] == sb["lr"]


async def test_a_late_joiner_downloads_parameters_buffers_optimizer_and_scheduler():
    task = user_task.task
    first = Peer(task, task_cfg(steps=40), out=lambda line: None)
    await first.start()
    run_first = asyncio.ensure_future(first.run())
    late = None
    try:
        while first.book.step < 10:
            await asyncio.sleep(0.05)
        late = Peer(task, task_cfg(steps=40, join=f"127.0.0.1:{first.port}"), out=lambda line: None)
        await late.start()
        s_late, s_first = await asyncio.wait_for(asyncio.gather(late.run(), run_first), 200)
    finally:
        run_first.cancel()
        await first.close()
        if late is not None:
            await late.close()
    assert s_late["state_bytes_received"] > 0 and s_late["steps_contributed"] < 40
    assert s_late["param_sketch"] == s_first["param_sketch"]
    assert late.replica.sched.last_epoch == first.replica.sched.last_epoch
    sd_a, sd_b = first.replica.opt.state_dict(), late.replica.opt.state_dict()
    assert all(torch.equal(sd_a["state"][i]["exp_avg"], sd_b["state"][i]["exp_avg"]) for i in sd_a["state"])


async def test_a_joiner_with_another_task_is_refused_naming_what_differs():
    first = Peer(user_task.task, task_cfg(), out=lambda line: None)
    await first.start()
    try:
        for other, needle in [(user_task.make_task(version="2"), "task version"),
                              (user_task.make_task(name="another"), "task name"),
                              (user_task.make_task(model=lambda: user_task.Classifier().float().double()), "model")]:
            joiner = Peer(other, task_cfg(join=f"127.0.0.1:{first.port}"), out=lambda line: None)
            try:
                with pytest.raises(JoinError, match=needle):
                    await joiner.start()
            finally:
                await joiner.close()
    finally:
        await first.close()


async def test_a_user_task_resumes_from_its_checkpoint(tmp_path):
    ck = str(tmp_path / "ck")
    a = Peer(user_task.task, task_cfg(steps=12, checkpoint=ck), out=lambda line: None)
    await a.start()
    try:
        await a.run()
    finally:
        await a.close()
    b = Peer(user_task.task, task_cfg(steps=20, checkpoint=ck), out=lambda line: None)
    await b.start()
    try:
        assert b.replica.step == 12 and b.replica.sched.last_epoch == a.replica.sched.last_epoch
        assert b.replica.sketch() == a.replica.sketch()
        for name, buf in a.replica.buffers.items():
            assert torch.equal(buf, b.replica.buffers[name])
        summary = await b.run()
    finally:
        await b.close()
    assert summary["steps"] == 20 and summary["steps_contributed"] == 8


def test_swarm_train_runs_a_peer_and_returns_its_summary():
    summary = swarm.train(user_task.task, steps=6, threads=1, table_slots=16, out=lambda line: None)
    assert summary["steps"] == 6 and summary["task"]["name"] == "test-classifier"
    with pytest.raises(TypeError, match="unknown settings"):
        swarm.train(user_task.task, stepz=3)
    with pytest.raises(ConfigError, match="built-in task"):
        swarm.train(user_task.task, batch_size=8)


# ------------------------------------------------------------------------------------ bad tasks


def test_loading_tasks_by_name_and_file(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert load_task("tests.user_task:task").name == "test-classifier"
    assert load_task("tests/user_task.py:task").name == "test-classifier"
    assert load_task(str(HERE / "user_task.py") + ":sized", {"lr": "0.1", "norm": "false"}).name == "test-classifier"
    cases = [
        ("no_such_module_xyz:task", {}, TaskError, "no module named 'no_such_module_xyz'"),
        ("missing.py:task", {}, TaskError, "no such file"),
        ("tests.user_task:nothing", {}, TaskError, "no attribute 'nothing'"),
        ("tests.user_task:ROWS", {}, TaskTypeError, "neither a swarm.Task"),
        ("tests.user_task:make_batch", {}, TaskError, "cannot be called"),
        ("tests.user_task:loss", {"model": "1", "batch": "2"}, TaskError, "raised|returned"),
        ("tests.user_task:sized", {"colour": "red"}, TaskError, "no parameter 'colour'"),
        ("tests.user_task:sized", {"lr": "fast"}, TaskError, "wants a float"),
        ("tests.user_task:sized", {"norm": "maybe"}, TaskError, "wants a bool"),
        ("tests.user_task:task", {"lr": "1"}, TaskError, "takes no --task-arg"),
        ("tests.user_task", {}, TaskError, "MODULE:ATTR"),
    ]
    for spec, args, kind, needle in cases:
        with pytest.raises((kind, UserCodeError)) as e:
            load_task(spec, args)
        assert e.type is not UserCodeError or kind is TaskError and "raised" in needle, (spec, e.value)
        assert any(n in str(e.value) for n in needle.split("|")), (spec, str(e.value))
    bad = tmp_path / "bad.py"
    bad.write_text("import no_such_dependency_abc\n")
    with pytest.raises(TaskError, match="imports 'no_such_dependency_abc', which is not installed"):
        load_task(f"{bad}:task")
    boom = tmp_path / "boom.py"
    boom.write_text("raise RuntimeError('the user broke it')\n")
    with pytest.raises(UserCodeError) as e:
        load_task(f"{boom}:task")
    assert isinstance(e.value.__cause__, RuntimeError)


def test_task_fields_are_checked_when_made():
    with pytest.raises(TaskTypeError, match="Task.model must be callable"):
        user_task.make_task(model=3)
    with pytest.raises(TaskTypeError, match="dotted module path"):
        user_task.make_task(tables={"encoder/tok": lambda b: b[0]})
    with pytest.raises(TaskTypeError, match="table_lr"):
        user_task.make_task(table_lr=2.0)
    with pytest.raises(TaskTypeError, match="Task.name"):
        user_task.make_task(name="")


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.out = nn.Linear(8, 50, bias=False)
        self.out.weight = self.emb.weight


def _checked(**overrides) -> Replica:
    r = Replica(user_task.make_task(**overrides))
    r.check()
    return r


def test_bad_tasks_are_one_line_errors_before_training():
    ids_ok = {"encoder.tok": lambda b: b[0]}
    cases = [
        (dict(loss=lambda m, b: m(b[0]).sum(1)), TaskError, "must be a scalar"),
        (dict(loss=lambda m, b: 1.0), TaskTypeError, "not a tensor"),
        (dict(tables={"head": lambda b: b[0]}), TaskError, "is a Linear, not an nn.Embedding"),
        (dict(tables={"encoder.nope": lambda b: b[0]}), TaskError, "no submodule 'encoder.nope'"),
        (dict(tables={"encoder.tok": lambda b: b[0] + user_task.ROWS}), TaskError, "outside the table's 0..599"),
        (dict(tables={"encoder.tok": lambda b: b[0] - user_task.ROWS}), TaskError, "outside the table's"),
        (dict(tables={"encoder.tok": lambda b: b[0].float()}), TaskTypeError, "must be integers"),
        (dict(tables={"encoder.tok": lambda b: [1, 2]}), TaskTypeError, "integer tensor"),
        (dict(tables={"encoder.tok": lambda b: b[0][:, :1]}), TaskError, "did not return"),  # forward reads more
        (dict(model=Tied, tables={"emb": lambda b: b[0] % 50}, loss=lambda m, b: m.out(m.emb(b[0] % 50)).mean()),
         TaskError, "tied to out.weight"),
        (dict(model=lambda: "a model"), TaskTypeError, "not a torch.nn.Module"),
        (dict(optimizer=lambda params: "sgd"), TaskTypeError, "not a torch.optim.Optimizer"),
        (dict(batches=lambda shard: iter([])), TaskError, "gave no batch"),
        (dict(eval_batches=lambda: 5), TaskTypeError, "not a list of batches"),
    ]
    for overrides, kind, needle in cases:
        overrides.setdefault("tables", ids_ok)
        with pytest.raises(kind, match=needle):
            _checked(**overrides)


def test_the_users_own_exceptions_keep_their_traceback():
    def broken_loss(model, batch):
        raise KeyError("my bug")

    def broken_data(shard):
        raise ZeroDivisionError("oops")
        yield

    for overrides, where in [(dict(loss=broken_loss), "loss()"), (dict(batches=broken_data), "batches"),
                             (dict(model=lambda: 1 / 0), "model()")]:
        with pytest.raises(UserCodeError, match=where.replace("(", r"\(").replace(")", r"\)")) as e:
            _checked(**overrides)
        assert e.value.__cause__ is not None and e.value.__cause__.__traceback__ is not None


async def test_non_finite_losses_skip_the_step_and_many_in_a_row_stop_the_peer():
    calls = {"n": 0}

    def sometimes_nan(model, batch):
        calls["n"] += 1
        out = user_task.loss(model, batch)
        return out * float("nan") if calls["n"] % 4 == 0 else out

    peer = Peer(user_task.make_task(loss=sometimes_nan), task_cfg(steps=12), out=lambda line: None)
    await peer.start()
    try:
        summary = await peer.run()
    finally:
        await peer.close()
    assert summary["nonfinite_losses"] >= 2 and math.isfinite(summary["final_loss"])
    assert all(math.isfinite(v) for v in peer.replica.sketch())

    peer = Peer(user_task.make_task(loss=lambda m, b: user_task.loss(m, b) * float("inf")), task_cfg(steps=50),
                out=lambda line: None)
    await peer.start()
    try:
        with pytest.raises(TaskError, match="not finite in 10 steps in a row"):
            await peer.run()
        assert peer.members.get(peer.id).state == "left"  # it left the swarm on its way out
    finally:
        await peer.close()


def test_sharded_embedding_initial_rows_are_seeded_per_slot():
    torch.manual_seed(3)
    a = swarm.ShardedEmbedding(1000, 4, padding_idx=5, std=0.5)
    torch.manual_seed(3)
    b = swarm.ShardedEmbedding(1000, 4, padding_idx=5, std=0.5)
    a.table = b.table = "t"
    assert torch.equal(a.init_rows(0, 100), b.init_rows(0, 100))
    assert float(a.init_rows(0, 100)[5].abs().sum()) == 0  # the padding row starts at zero
    assert not torch.equal(a.init_rows(0, 100)[10:20], a.init_rows(100, 200)[10:20])
    assert abs(float(a.init_rows(0, 1000).std()) - 0.5) < 0.05
    assert a.weight.shape == (1000, 4) and a.weight.dtype == torch.float32
    assert float(swarm.ShardedEmbedding(10, 2, std=0.0).init_rows(0, 10).abs().sum()) == 0
    with pytest.raises(ValueError):
        swarm.ShardedEmbedding(0, 4)


def test_a_swapped_embedding_starts_from_the_users_init_rows():
    r = Replica(user_task.task, seed=4)
    torch.manual_seed(4)
    ref = user_task.Classifier()  # the same seeded construction
    mod = r.modules["encoder-tok"]
    assert torch.equal(mod.init_rows(0, user_task.ROWS), ref.encoder["tok"].weight.detach())
    assert r.table_specs[0].rows == user_task.ROWS and r.table_specs[0].dim == user_task.DIM
    assert {e.name for e in r.manifest.entries if e.kind == "buffer"} == {
        "norm.running_mean", "norm.running_var", "norm.num_batches_tracked"}


def test_shards_and_epochs():
    r = Replica(user_task.task)
    r.set_shard(1, 3, seed=7)
    assert r.shard == Shard(1, 3, 7, 0)
    for _ in range(51):  # the finite iterator (50 batches) ends: the next epoch begins
        r.next_batch()
    assert r.shard.epoch == 1
    with pytest.raises(ValueError):
        Shard(3, 3, 0)
    assert isinstance(r.rows_of(r.next_batch())["encoder-tok"], np.ndarray)


# ------------------------------------------------------------------------------------ the CLI


async def test_cli_task_errors_are_one_line_and_user_errors_show_their_traceback(spawn, tmp_path):
    boom = tmp_path / "boom.py"
    boom.write_text("import sys\nsys.path.insert(0, %r)\nfrom tests import user_task\n\n"
                    "def task():\n    return user_task.make_task(loss=lambda m, b: {}['missing key'])\n" % str(ROOT))
    cases = [
        (("--task", "no_such_module_xyz:task"), 2, "no module named"),
        (("--task", "tests/user_task.py:sized", "--task-arg", "colour=red"), 2, "no parameter 'colour'"),
        (("--task", "tests/user_task.py:task", "--batch-size", "8"), 2, "--batch-size is a setting of the built-in task"),
        (("--task", "tests/user_task.py:task", "--data", "README.md"), 2, "--data is a setting of the built-in task"),
        (("--task-arg", "bogus=1"), 2, "no parameter 'bogus'"),
        (("--task-arg", "d_model=100", "--task-arg", "heads=3"), 2, "not divisible"),
        (("--task", f"{boom}:task"), 1, "KeyError"),
    ]
    # two at a time, each its own `python peer.py` (run_clis)
    ran = await asyncio.to_thread(run_clis, *(((*args, "--steps", "2"), None) for args, _, _ in cases), timeout=120)
    for (args, code, needle), r in zip(cases, ran):
        text, out = r.stderr, r.stdout
        assert r.returncode == code, (args, text[-500:])
        assert needle in text, (args, text[-500:])
        if code == 2:
            assert "Traceback" not in text and len(text.strip().splitlines()) <= 2, text
            assert "listening on" not in out  # refused before the peer listens
        else:
            assert "Traceback" in text and "the traceback above is from the task's code" in text


async def test_cli_builtin_task_args_size_the_model(spawn):
    p = spawn("--task-arg", "d_model=64", "--task-arg", "layers=1", "--steps", "2")
    code, summary = await p.finish(120)
    assert code == 0, p.stderr_tail()
    from swarm.tasks.bytelm import dense_params

    assert summary["task"]["params"] == dense_params(64, 1) and summary["steps"] == 2


def test_the_readme_task_runs(tmp_path):
    """README's "Bring your own model" snippet is a working task file."""
    text = (ROOT / "README.md").read_text()
    start = text.index("## Bring your own model")
    code = text[text.index("```python\n", start) + len("```python\n"):text.index("```", text.index("```python\n", start) + 3)]
    assert len(code.strip().splitlines()) < 30
    (tmp_path / "my_task.py").write_text(code)
    task = load_task(f"{tmp_path / 'my_task.py'}:task")
    r = Replica(task)
    r.check()
    assert r.table_specs[0].rows == 100_000 and [e.name for e in r.manifest.entries] == ["head.weight", "head.bias"]
