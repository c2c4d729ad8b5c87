"""bench/norm_tail.py runs as a user would run it: a short clean run, its per-run line and its last
JSON line over the runs; a bad flag is one line, not a traceback."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_norm_tail_measures_a_short_clean_run():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "norm_tail.py"), "--runs", "1", "--steps", "6"],
                         capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [json.loads(x) for x in out.stdout.strip().splitlines()]
    run, last = lines[0], lines[-1]
    assert run["rounds"] == 6 and run["bans"] == 0
    assert last["payloads"] == 3 * 6 and last["runs"] == 1 and last["bans"] == 0
    assert 0 < last["p50"] <= last["p99"] <= last["max"] == run["max"]
    rows = last["rows"]  # every primary's flush verdicts: levels over the reference, agreement
    assert rows["verdicts"] == run["rows_verdicts"] > 0 and rows["bans"] == 0
    assert 0 < rows["p50"] <= rows["p99"] <= rows["max"] == run["rows_max"]
    assert rows["judged"] == run["rows_judged"] and -1 <= rows["agreement_min"] <= rows["agreement_p50"] <= 1


def test_norm_tail_refuses_bad_flags_in_one_line():
    for argv in (["--peers", "2"], ["--timeout", "0"], ["--runs", "0"]):
        out = subprocess.run([sys.executable, str(ROOT / "bench" / "norm_tail.py"), *argv],
                             capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert out.returncode == 2 and "Traceback" not in out.stderr and "--peers >= 3" in out.stderr, argv
