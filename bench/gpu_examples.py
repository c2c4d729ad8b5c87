"""Every example task (and the built-in LM) trained by two `python peer.py` peers on one device, as
tests/test_examples.py trains them, timed: the check to run on a CUDA machine with ``--device cuda``
(docs/benchmarks.md, "The examples on a GPU"), and on any machine with ``--device cpu``.

Per task it prints: exit codes, the device the peers said they trained on, inner steps, seconds of
training (the first peer's summary: evaluations and start-up included), a step's milliseconds (the
sum of its phases' medians: rows, compute, send, round, apply, after), the median compute ms and
the share of the step spent waiting on the other peer, the held-out loss before the first step and
at the end, and whether the two replicas ended bit-identical (param_sketch). The LAST stdout line is
one JSON object keyed by task name. Bounded: each task gets ``--timeout`` seconds and is killed past
that (reported, not hung).

Usage: python3 bench/gpu_examples.py [--device cuda|cpu|auto] [--only NAME ...] [--timeout S]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# name -> (task flags, flags of the run, a module the task needs); the runs are tests/test_examples.py's
TASKS: dict[str, tuple[tuple[str, ...], tuple[str, ...], str | None]] = {
    "bytelm": ((), ("--steps", "60", "--eval-every", "30", "--table-rows", "4096", "--table-slots", "64",
                    "--batch-size", "8", "--eval-batches", "2"), None),
    # the built-in LM at bench/wan.py's "big" size (5.1M dense parameters): enough compute for a GPU to show
    "bytelm-big": (("--task-arg", "d_model=320", "--task-arg", "layers=4"),
                   ("--steps", "40", "--eval-every", "20", "--table-rows", "4096", "--table-slots", "64",
                    "--batch-size", "16", "--eval-batches", "2"), None),
    "ctr": (("--task", "examples/ctr.py:task"), ("--steps", "60", "--eval-every", "30", "--table-slots", "64"), None),
    "gpt2": (("--task", "examples/gpt2.py:task"), ("--steps", "40", "--eval-every", "20", "--table-slots", "16"),
             "transformers"),
    "resnet": (("--task", "examples/resnet.py:task"), ("--steps", "30", "--eval-every", "15"), "transformers"),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def last_json(text: str) -> dict | None:
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


def run_task(name: str, device: str, timeout: float, threads: int | None) -> dict:
    """Two peers on the task, started together (the second retries its join until the first listens)."""
    task_flags, flags, needs = TASKS[name]
    if needs and importlib.util.find_spec(needs) is None:
        return {"skipped": f"{needs} is not installed"}
    port = free_port()
    common = [*task_flags, *flags, "--min-peers", "2", "--device", device, "--round-timeout", "60"]
    if threads:
        common += ["--threads", str(threads)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmds = [[sys.executable, str(ROOT / "peer.py"), *common, "--port", str(port)],
            [sys.executable, str(ROOT / "peer.py"), *common, "--join", f"127.0.0.1:{port}", "--join-timeout", "60"]]
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        logs = [(open(Path(tmp) / f"out{i}", "w+"), open(Path(tmp) / f"err{i}", "w+")) for i in range(2)]
        procs = [subprocess.Popen(c, cwd=ROOT, stdout=o, stderr=e, text=True, env=env) for c, (o, e) in zip(cmds, logs)]
        timed_out = False
        for p in procs:
            try:
                p.wait(max(1.0, timeout - (time.monotonic() - t0)))
            except subprocess.TimeoutExpired:
                timed_out = True
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        outs, errs = [], []
        for o, e in logs:
            o.seek(0), e.seek(0)
            outs.append(o.read()), errs.append(e.read())
            o.close(), e.close()
    wall = time.monotonic() - t0
    sums = [last_json(o) for o in outs]
    res: dict = {"rc": [p.returncode for p in procs], "timed_out": timed_out, "wall_s": round(wall, 1)}
    if any(s is None for s in sums):
        res["error"] = " | ".join(e.strip().splitlines()[-1] for e in errs if e.strip())[-400:] or "no summary"
        return res
    s0, s1 = sums
    phases = s0.get("step_phases") or {}
    # a step's own phases (medians: the first step waits for the other peer; swarm/steptimes.py),
    # without the evaluations and start-up in "seconds"
    phases_ms = {k: v["median_ms"] for k, v in phases.items() if isinstance(v, dict)}
    hist = s0.get("val_history") or []
    res.update({
        "device": [(s.get("task") or {}).get("device") for s in sums],
        "steps": s0["steps"], "seconds": s0["seconds"],
        "s_per_step": round(s0["seconds"] / s0["steps"], 4) if s0["steps"] else None,
        "phases_ms": phases_ms,
        "step_ms": round(sum(phases_ms.values()), 1),
        "compute_ms": phases_ms.get("compute"),
        "wait_share": phases.get("wait_share"),
        "val_first": hist[0][1] if hist else None, "val_last": hist[-1][1] if hist else None,
        "params": (s0.get("task") or {}).get("params"),
        "replicas_identical": s0["param_sketch"] == s1["param_sketch"],
        "nonfinite_losses": s0["nonfinite_losses"] + s1["nonfinite_losses"],
    })
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu", "auto"))
    ap.add_argument("--only", action="append", choices=sorted(TASKS), help="run only these tasks (repeatable)")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds per task before its peers are killed")
    ap.add_argument("--threads", type=int, default=None, help="--threads of each peer (default: the peer's own)")
    a = ap.parse_args()
    if not a.timeout > 0 or (a.threads is not None and a.threads < 1):
        sys.exit(f"gpu_examples: --timeout must be > 0 and --threads at least 1, got {a.timeout:g} and {a.threads}")
    if a.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            sys.exit("gpu_examples: --device cuda, but torch sees no CUDA device (use --device cpu)")
    results = {}
    print(f"{'task':>10} {'device':>7} {'steps':>5} {'seconds':>8} {'step ms':>7} {'compute ms':>10} "
          f"{'wait':>5} {'val first':>9} {'val last':>8} {'identical':>9}", flush=True)
    for name in a.only or list(TASKS):
        r = results[name] = run_task(name, a.device, a.timeout, a.threads)
        if "skipped" in r or "error" in r:
            print(f"{name:>10} {r.get('skipped') or 'FAILED: ' + r['error']}", flush=True)
            continue
        print(f"{name:>10} {str(r['device'][0]):>7} {r['steps']:>5} {r['seconds']:>8.1f} {r['step_ms']:>7.1f} "
              f"{r['compute_ms'] if r['compute_ms'] is not None else '-':>10} "
              f"{r['wait_share'] if r['wait_share'] is not None else '-':>5} "
              f"{r['val_first']:>9.4f} {r['val_last']:>8.4f} {str(r['replicas_identical']):>9}", flush=True)
    print(json.dumps({"device": a.device, "tasks": results}))


if __name__ == "__main__":
    main()
