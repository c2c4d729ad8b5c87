"""bench/window_rows.py runs as a user would run it: a small run, its last JSON line; a bad flag is
an argparse line, not a traceback."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "bench" / "window_rows.py")


def test_window_rows_times_each_call_of_a_few_small_windows():
    out = subprocess.run([sys.executable, SCRIPT, "--rows", "512", "--dim", "8", "--sync-every", "4", "--windows", "3",
                          "--ids-per-step", "64"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    last = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(last["ms_per_window"]) == {"clear", "add", "update", "pushes"}
    assert all(v >= 0 for v in last["ms_per_window"].values()) and last["total_ms_per_window"] > 0
    assert len(last["rows_per_window"]) == 3 and all(0 < n <= 2 * 512 for n in last["rows_per_window"])


def test_window_rows_refuses_bad_flags():
    for argv, says in ((["--windows", "0"], "--windows must be >= 1"), (["--ratio", "1.5"], "--ratio must be in")):
        out = subprocess.run([sys.executable, SCRIPT, *argv], capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert out.returncode == 2 and "Traceback" not in out.stderr and says in out.stderr, argv
