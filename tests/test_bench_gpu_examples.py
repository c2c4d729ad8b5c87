"""bench/gpu_examples.py, the examples' GPU check, run the way CI can: on the CPU, one small task
(two real `peer.py` processes), its table row and its last JSON line; and a CUDA run asked for on a
machine without CUDA, or bounds that cannot run, are refused with one line."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu_examples.py"

pytestmark = pytest.mark.timeout(240)


def test_a_cpu_run_of_one_task_reports_its_device_steps_and_identical_replicas():
    r = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--only", "ctr", "--threads", "1",
                        "--timeout", "150"], cwd=ROOT, capture_output=True, text=True, timeout=200)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert lines[0].split()[:3] == ["task", "device", "steps"] and lines[1].split()[:3] == ["ctr", "cpu", "60"]
    res = json.loads(lines[-1])
    assert res["device"] == "cpu" and list(res["tasks"]) == ["ctr"]
    ctr = res["tasks"]["ctr"]
    assert ctr["rc"] == [0, 0] and not ctr["timed_out"]
    assert ctr["device"] == ["cpu", "cpu"]  # what the peers said they trained on (the summary's task.device)
    assert ctr["steps"] == 60 and ctr["replicas_identical"] and ctr["nonfinite_losses"] == 0
    assert ctr["val_last"] < ctr["val_first"] and ctr["seconds"] > 0 and ctr["s_per_step"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_one_line():
    r = subprocess.run([sys.executable, str(SCRIPT), "--device", "cuda"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip() == "gpu_examples: --device cuda, but torch sees no CUDA device (use --device cpu)"


def test_bad_bounds_are_one_line():
    for flags in (["--timeout", "0"], ["--threads", "0"]):
        r = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", *flags], cwd=ROOT, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 1 and r.stdout == "" and "Traceback" not in r.stderr
        assert r.stderr.startswith("gpu_examples: --timeout must be > 0") and len(r.stderr.splitlines()) == 1
