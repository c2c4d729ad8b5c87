"""The pure parts of bench/wan.py: parsing, curves, time to target, byte windows, the root check.

No network namespaces, no processes, no root."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parent.parent / "bench" / "wan.py"
_spec = importlib.util.spec_from_file_location("bench_wan", _PATH)
wan = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(wan)


def test_parse_peer_lines_progress_and_summary():
    lines = [(1.0, "listening on http://10.77.0.1:7100 (peer p0)"),
             (2.0, "step 1 loss 5.545 tok/s 100 peers 4 sent 0.10MB recv 0.20MB compression x12"),
             (2.5, "step 2 loss 5.400 tok/s 100 peers 4 sent 0.10MB recv 0.20MB compression x12"),
             (2.6, "step 3 loss nan tok/s 100 peers 4 sent 0.10MB recv 0.20MB compression x12"),
             (3.0, json.dumps({"peer_id": "p0", "val_loss": 3.5, "bytes_sent": 10}))]
    pts, summary = wan.parse_peer_lines(lines)
    assert pts == {1: (2.0, 5.545), 2: (2.5, 5.4)}
    assert summary["val_loss"] == 3.5


def test_parse_peer_lines_leaves_the_evaluations_out_of_the_curves_time():
    """peer.py --eval-every says the seconds its evaluations took so far (eval_time): a point's time
    is the training's alone, so a mid-run evaluation (val_loss at the budget) is not step time."""
    tail = "tok/s 100 peers 4 sent 0.10MB recv 0.20MB compression x12"
    pts, _ = wan.parse_peer_lines([(10.0, f"step 1 loss 5.0 {tail} eval_time 1.50s"),
                                   (11.0, f"step 2 loss 4.9 {tail} eval_time 1.50s"),
                                   (15.0, f"step 3 loss 4.8 {tail} eval_time 4.50s"),
                                   (16.0, f"step 4 loss 4.7 {tail}")])
    assert pts == {1: (8.5, 5.0), 2: (9.5, 4.9), 3: (10.5, 4.8), 4: (16.0, 4.7)}
    # the wall clock, for cutting the interface counters' samples at the steps' ends (traffic)
    wall, _ = wan.parse_peer_lines([(10.0, f"step 1 loss 5.0 {tail} eval_time 1.50s"),
                                    (15.0, f"step 3 loss 4.8 {tail} eval_time 4.50s")], less_evals=False)
    assert wall == {1: (10.0, 5.0), 3: (15.0, 4.8)}
    assert wan.step_time(wan.merge_curves([{s: p for s, p in pts.items() if s < 4}])) == 1.0
    lines = [(10.0, f"step 1 loss 5.0 {tail} eval_time 1.50s"), (15.0, f"step 3 loss 4.8 {tail} eval_time 4.50s")]
    assert wan.eval_seconds_between(lines, 1, 3) == 3.0 and wan.eval_seconds_between(lines, 1, 2) == 0.0


def test_parse_peer_lines_without_summary():
    pts, summary = wan.parse_peer_lines([(1.0, "step 1 loss 5.0 tok/s 1 peers 1 sent 0MB recv 0MB compression x0"),
                                         (2.0, "Traceback (most recent call last):")])
    assert pts == {1: (1.0, 5.0)} and summary is None


def test_running_mean_matches_peer_progress_line():
    vals = [float(i) for i in range(1, 15)]
    out = wan.running_mean(vals, 10)
    assert out[0] == 1.0 and out[1] == 1.5 and out[9] == 5.5
    assert out[10] == pytest.approx(sum(vals[1:11]) / 10)
    assert out[13] == pytest.approx(sum(vals[4:14]) / 10)


def test_parse_ddp_lines():
    recs = [{"step": i, "t": 100.0 + i, "loss": 6.0 - i, "compute_s": 0.1, "comm_s": 0.2} for i in (2, 1, 3)]
    lines = [json.dumps(r) for r in recs] + ["garbage", json.dumps({"rank": 0, "val_loss": 2.5})]
    pts, summary, raw = wan.parse_ddp_lines(lines)
    assert [r["step"] for r in raw] == [1, 2, 3]
    assert pts[1] == (101.0, 5.0) and pts[2] == (102.0, 4.5) and pts[3] == (103.0, 4.0)
    assert summary["val_loss"] == 2.5


def test_merge_curves_uses_last_peer_time_and_common_steps():
    a = {1: (10.0, 4.0), 2: (11.0, 3.0), 3: (12.0, 2.0)}
    b = {1: (10.5, 6.0), 2: (10.9, 5.0)}
    assert wan.merge_curves([a, b]) == [(1, 10.5, 5.0), (2, 11.0, 4.0)]
    assert wan.merge_curves([]) == []


def test_time_to_target_and_step_time():
    curve = [(1, 100.0, 5.0), (2, 101.0, 4.0), (3, 103.0, 3.0), (4, 104.0, 2.9)]
    assert wan.time_to_target(curve, 3.0) == (3.0, 3)
    assert wan.time_to_target(curve, 4.5) == (1.0, 2)
    assert wan.time_to_target(curve, 1.0) == (None, None)
    assert wan.time_to_target([], 1.0) == (None, None)
    assert wan.step_time(curve) == pytest.approx(4.0 / 3)
    assert wan.step_time(curve[:1]) is None


def test_pick_target_is_reached_by_every_method():
    curves = {"a": [(1, 0.0, 5.0), (2, 1.0, 3.0)], "b": [(1, 0.0, 5.0), (2, 9.0, 3.5)], "c": []}
    target = wan.pick_target(curves, 0.01)
    assert target == pytest.approx(3.51)
    assert all(wan.time_to_target(c, target)[0] is not None for c in curves.values() if c)


def test_bytes_between_interpolates_and_skips_missing_samples():
    samples = [(0.0, [0, 0]), (1.0, [100, 10]), (2.0, [None, 20]), (3.0, [300, 30])]
    assert wan.bytes_between(samples, 0.5, 3.0) == [250, 25]
    assert wan.bytes_between(samples, -5.0, 99.0) == [300, 30]
    assert wan.bytes_between([(0.0, [None])], 0.0, 1.0) is None


def test_traffic_splits_the_run_around_its_training_window():
    samples = [(0.0, [0, 0]), (1.0, [100, 50]), (2.0, [200, 100]), (3.0, [300, 150]), (4.0, [700, 550])]
    curve = [(1, 1.0, 5.0), (3, 3.0, 4.0)]  # steps 1..3 end at t = 1 and 3
    out = wan.traffic([700, 550], samples, curve)
    assert out["tx_bytes_train_window"] == [200, 100]
    assert out["tx_bytes_before_window"] == 75 and out["tx_bytes_after_window"] == 400
    assert out["bytes_per_step_per_peer"] == 75  # 150 bytes over 2 steps, per peer
    # before + window + after is the whole run
    assert out["tx_bytes_before_window"] + sum(out["tx_bytes_train_window"]) / 2 + out["tx_bytes_after_window"] \
        == out["run_bytes_per_peer"]


def test_summarize_ratios():
    runs = {
        "swarm": {"time_to_target_s": 10.0, "bytes_per_peer": 1_000, "run_bytes_per_peer": 2_000, "step_time_s": 0.6,
                  "val_loss": 2.0, "wait_share": 0.1},
        "ddp-dense": {"time_to_target_s": 40.0, "bytes_per_peer": 60_000, "run_bytes_per_peer": 60_000,
                      "step_time_s": 5.0, "val_loss": 1.9},
        "ddp-sparse": {"time_to_target_s": 16.0, "bytes_per_peer": 5_000, "step_time_s": 1.0},
    }
    out = wan.summarize(runs, floor_contended=0.5, floor_solo=0.2, target=2.5)
    assert out["speedup_vs_ddp_time_to_loss"] == 4.0
    assert out["speedup_vs_sparse_ddp_time_to_loss"] == 1.6
    assert out["speedup_vs_hivemind_time_to_loss"] is None
    assert out["bytes_ratio_vs_ddp"] == 60.0 and out["bytes_ratio_vs_ddp_whole_run"] == 30.0
    assert out["step_time_over_compute_floor"] == 1.2 and out["step_time_ratios"] == []
    assert out["step_time_over_solo_compute_floor"] == 3.0
    # with back-to-back (floor, swarm) pairs: the median of their ratios
    paired = wan.summarize(runs, floor_contended=0.5, floor_solo=0.2, target=2.5,
                           pairs=[(0.5, 0.6), (0.4, 0.7), (0.5, 0.65)])
    assert paired["step_time_ratios"] == [1.2, 1.75, 1.3] and paired["step_time_over_compute_floor"] == 1.3
    for key in ("speedup_vs_ddp_time_to_loss", "speedup_vs_sparse_ddp_time_to_loss",
                "speedup_vs_hivemind_time_to_loss", "bytes_ratio_vs_ddp", "step_time_over_compute_floor"):
        assert key in out
    json.dumps(out)


def test_wait_share():
    assert wan.wait_share(1.0, 0.25) == 0.75
    assert wan.wait_share(0.2, 0.25) == 0.0
    assert wan.wait_share(None, 0.25) is None


def test_without_root_it_says_so_and_exits_0(monkeypatch, capsys):
    monkeypatch.setattr(wan.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(sys, "argv", ["wan.py"])
    called = []
    monkeypatch.setattr(wan, "sh", lambda *a, **k: called.append(a))  # must not touch the network
    assert wan.main() == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "needs root" in out[0]
    assert called == []


# ----------------------------------------------------------------------------- the Hivemind leg (no hivemind needed)

def test_hivemind_maddrs_are_parsed_and_the_namespace_one_is_picked():
    lines = ["some log", "hivemind listening on /ip4/127.0.0.1/tcp/7300/p2p/Qa /ip4/10.77.0.1/tcp/7300/p2p/Qa",
             "hivemind ready 4 peers"]
    maddrs = wan.parse_hivemind_maddrs(lines)
    assert maddrs == ["/ip4/127.0.0.1/tcp/7300/p2p/Qa", "/ip4/10.77.0.1/tcp/7300/p2p/Qa"]
    assert wan.pick_maddr(maddrs, "10.77.0.1") == "/ip4/10.77.0.1/tcp/7300/p2p/Qa"
    assert wan.pick_maddr(maddrs, "10.77.0.9") == "/ip4/10.77.0.1/tcp/7300/p2p/Qa"  # first non-loopback
    assert wan.pick_maddr(maddrs[:1], "10.77.0.9") is None
    assert wan.parse_hivemind_maddrs(["hivemind ready 4 peers"]) == []


def test_parse_ddp_lines_reads_the_hivemind_baseline_output():
    lines = ["hivemind listening on /ip4/10.77.0.1/tcp/7300/p2p/Qa", "hivemind ready 2 peers",
             json.dumps({"step": 1, "t": 10.0, "loss": 5.0, "epoch": 0, "compute_s": 0.1, "comm_s": 0.0}),
             json.dumps({"step": 2, "t": 14.0, "loss": 4.0, "epoch": 1, "compute_s": 0.1, "comm_s": 3.9}),
             json.dumps({"index": 0, "steps": 2, "val_loss": 4.2, "epoch": 1, "collaborative_epochs": 1,
                         "local_epochs": 0})]
    pts, summary, raw = wan.parse_ddp_lines(lines)
    assert pts == {1: (10.0, 5.0), 2: (14.0, 4.5)}
    assert summary["val_loss"] == 4.2 and [r["epoch"] for r in raw] == [0, 1]


def test_hivemind_health_flags_peers_that_trained_alone():
    good = [{"steps": 20, "epoch": 10, "collaborative_epochs": 9, "local_epochs": 1, "mean_group_size": 4.0}
            for _ in range(4)]
    h = wan.hivemind_health(good, 4)
    assert h["epochs"] == 10 and h["collaborative_epochs"] == 9 and h["local_epochs"] == 1
    assert h["mean_group_size"] == 4.0 and h["local_steps_per_epoch"] == 2.0 and h["out_of_sync"] == 0
    assert wan.hivemind_health([dict(good[0], out_of_sync=3)] + good[1:], 4)["out_of_sync"] == 3
    assert "fell back" not in h["warning"] and "1 epochs" in h["warning"]
    clean = [dict(s, local_epochs=0) for s in good]
    assert "warning" not in wan.hivemind_health(clean, 4)
    alone = clean[:3] + [{"steps": 20, "epoch": 20, "collaborative_epochs": 0, "local_epochs": 20,
                          "mean_group_size": None}]
    h = wan.hivemind_health(alone, 4)
    assert "fell back to local training" in h["warning"] and h["collaborative_epochs"] == 0
    assert "1 of 4 peers" in wan.hivemind_health(clean[:3], 4)["warning"]
    assert "no hivemind peer" in wan.hivemind_health([], 4)["warning"]
    json.dumps(h)


def test_summarize_with_hivemind():
    runs = {"swarm": {"time_to_target_s": 10.0, "bytes_per_peer": 1_000, "step_time_s": 0.6},
            "hivemind": {"time_to_target_s": 55.0, "bytes_per_peer": 90_000, "step_time_s": 4.0}}
    out = wan.summarize(runs, floor_contended=0.5, floor_solo=0.2, target=2.5)
    assert out["speedup_vs_hivemind_time_to_loss"] == 5.5 and out["bytes_ratio_vs_hivemind"] == 90.0
    assert out["step_time_s"]["hivemind"] == 4.0


def test_probe_hivemind_reports_why_not():
    version, why = wan.probe_hivemind(sys.executable, module="no_such_module_xyz")
    assert version is None and "no_such_module_xyz" in why and sys.executable in why
    version, why = wan.probe_hivemind("/nonexistent/python3")
    assert version is None and "cannot run" in why
    version, why = wan.probe_hivemind(sys.executable, module="json")
    assert why is None and version


def test_parse_stat_and_related_processes():
    assert wan.parse_stat("42 (a) b) c) S 1 42 42 0 -1 4194560 1 0 0 0 0 0 0 0 20 0 1 0 777 0 0") == (1, 42, 42, 777)
    assert wan.parse_stat("garbage") is None
    table = {10: (1, 10, 10, 1), 11: (10, 10, 10, 2), 12: (11, 12, 12, 3),  # 12: a grandchild that called setsid
             13: (1, 10, 10, 4),  # an orphan still in the group
             14: (12, 12, 12, 5), 20: (1, 20, 20, 6), 21: (20, 20, 20, 7)}
    assert wan.related(10, table) == {11, 12, 13, 14}
    assert wan.related(20, table) == {21}
    assert wan.related(99, table) == set()


def test_kill_reaches_a_grandchild_that_left_the_session(tmp_path):
    """Like hivemind's torch_shm_manager: a descendant in its own session survives killpg; kill()
    must find it (no root, no network)."""
    pidfile = tmp_path / "grandchild"
    code = ("import subprocess, sys, time; "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True); "
            f"open({str(pidfile)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    proc = wan.Proc([sys.executable, "-c", code])
    import time
    deadline = time.time() + 20
    while not (pidfile.exists() and pidfile.read_text()) and time.time() < deadline:
        time.sleep(0.05)
    grandchild = int(pidfile.read_text())
    time.sleep(1.2)  # let the watcher record it
    wan.kill(proc.p)
    assert proc.p.poll() is not None
    stat = wan.Path(f"/proc/{grandchild}/stat")
    assert not stat.exists() or stat.read_text().rpartition(")")[2].split()[0] == "Z"


def test_hivemind_does_not_set_the_target_and_gets_a_lower_bound_when_it_misses_it():
    curves = {"swarm": [(1, 0.0, 5.0), (2, 1.0, 2.0)], "ddp-sparse": [(1, 0.0, 5.0), (2, 3.0, 2.2)],
              "hivemind": [(1, 0.0, 5.0), (2, 40.0, 4.0)]}
    target = wan.pick_target(curves, 0.01)
    assert target == pytest.approx(2.21)  # the worst final among the others; hivemind's 4.0 is ignored
    runs = {m: {"curve": c, "time_to_target_s": wan.time_to_target(c, target)[0], "step_time_s": 1.0}
            for m, c in curves.items()}
    out = wan.summarize(runs, floor_contended=0.5, floor_solo=0.2, target=target)
    assert out["speedup_vs_sparse_ddp_time_to_loss"] == 3.0
    assert out["speedup_vs_hivemind_time_to_loss"] == 40.0  # at least: its whole run / the swarm's time
    assert out["speedup_lower_bound_for"] == ["hivemind"]


# ----------------------------------------------------------------------------- local steps, two rates, the DDP target

def test_local_flags_and_the_methods_flags():
    assert wan.local_flags({"compression": "topk-int2", "ratio": 0.02, "overlap": True, "outer_nesterov": False,
                            "chunk": None}, 8) == ["--sync-every", "8", "--compression", "topk-int2", "--ratio", "0.02",
                                                   "--overlap", "1"]
    h32, h8 = wan.SWARM_FLAGS["swarm-h32"], wan.SWARM_FLAGS["swarm-h8"]
    assert h32[:2] == ["--sync-every", "32"] and "--overlap" not in h32  # its round between windows
    assert h8[h8.index("--overlap") + 1] == "1"  # swarm-h8 overlaps its round with the next window
    for key, v in wan.LOCAL_STEP.items():  # the one table sets every local-step method
        flag = "--" + key.replace("_", "-")
        if not isinstance(v, bool):
            assert flag in h32 and flag in h8
    diloco = wan.SWARM_FLAGS["swarm-diloco"]
    assert diloco[diloco.index("--compression") + 1] == "none" and diloco[diloco.index("--outer-nesterov") + 1] == "1"
    assert diloco[diloco.index("--outer-momentum") + 1] == "0.9" and "--overlap" not in diloco
    assert wan.SWARM_FLAGS["swarm"] == [] and wan.SWARM_FLAGS["swarm-dense"] == ["--compression", "none"]
    # swarm-h32-lead is swarm-h32 with its row pushes led (--push-lead auto), measured beside it on request
    assert wan.SWARM_FLAGS["swarm-h32-lead"] == h32 + ["--push-lead", "auto"] and "--push-lead" not in h32
    assert "swarm-h32-lead" in wan.METHODS and "swarm-h32-lead" not in wan.DEFAULT_METHODS


def test_sync_periods_and_the_budget_check():
    assert [wan.sync_every_of(m) for m in ("swarm", "swarm-h8", "swarm-h32", "swarm-diloco", "ddp-dense",
                                           "torchft-diloco", "hivemind")] == [1, 8, 32, 32, 1, 32, 1]
    assert wan.check_budget(224, list(wan.METHODS)) is None
    why = wan.check_budget(200, ["swarm", "swarm-h8", "swarm-h32", "torchft-diloco"])
    assert "200" in why and "swarm-h32 (H=32)" in why and "torchft-diloco" in why and "swarm-h8" not in why
    assert wan.check_budget(10, ["ddp-dense", "swarm"]) is None
    assert wan.extended_steps(224, 2.0, 32) == 448 and wan.extended_steps(224, 1.5, 32) == 320
    assert wan.extended_steps(224, 1.0, 32) == 224 and wan.extended_steps(224, 1.1, 32) == 224


def test_model_presets_map_to_peer_and_baseline_flags():
    small = wan.MODELS["small"]
    assert wan.model_flags(small, small) == ([], [])
    peer, base = wan.model_flags(wan.MODELS["big"], small)
    assert "d_model=320" in peer and "layers=4" in peer and peer.count("--task-arg") == 2
    assert base == ["--d-model", "320", "--layers", "4"]
    big = wan.MODELS["big"]  # >= 5M dense parameters (swarm.tasks.bytelm.dense_params), the tables smaller
    d, L, V, C = big["d_model"], big["layers"], 256, big["context"]
    dense = V * d + C * d + L * (4 * d + 12 * d * d) + 2 * d + d * V
    assert dense >= 5_000_000 and 2 * big["table_rows"] * d < dense


def test_plan_runs_sync_baselines_once_and_pairs_the_local_method():
    methods = ["swarm", "swarm-h32", "swarm-diloco", "ddp-sparse", "ddp-dense", "torchft-diloco"]
    p = wan.plan(methods, ["80mbit", "8mbit"], None, "swarm-h32", 2)
    assert p[:2] == [("floor-solo", None, None), ("floor", None, None)]
    assert p[2:5] == [("full", "ddp-dense", None), ("full", "ddp-sparse", None), ("full", "torchft-diloco", None)]
    for r in ("80mbit", "8mbit"):
        at = [(k, m) for k, m, rr in p if rr == r]
        assert at == [("timing", "ddp-dense"), ("timing", "ddp-sparse"), ("timing", "torchft-diloco"),
                      ("run", "swarm"), ("run", "swarm-diloco"), ("floor", "swarm-h32"), ("run", "swarm-h32"),
                      ("floor", "swarm-h32"), ("pair", "swarm-h32")]
    # budget at the first rate: no timing run there
    p = wan.plan(["ddp-dense", "swarm-h32"], ["80mbit", "8mbit"], "80mbit", "swarm-h32", 1)
    assert ("timing", "ddp-dense", "80mbit") not in p and ("timing", "ddp-dense", "8mbit") in p
    assert ("full", "ddp-dense", "80mbit") in p and ("pair", "swarm-h32", "80mbit") not in p
    # --only without the local method: no pairs
    assert not [x for x in wan.plan(["swarm"], ["8mbit"], None, "swarm-h32", 3) if x[0] in ("pair",) or x[1] == "swarm-h32"]


def test_project_curve_per_step_baseline():
    full = [(1, 100.0, 5.0), (2, 100.5, 4.0), (3, 101.0, 3.0), (4, 101.5, 2.5)]
    timing = [(1, 50.0, 9.0), (2, 56.0, 9.0), (3, 62.0, 9.0)]  # 6 s a step at this rate
    curve, info = wan.project_curve(full, timing)
    assert [(k, l) for k, _, l in curve] == [(k, l) for k, _, l in full]  # the loss of the full run
    assert [t - curve[0][1] for _, t, _ in curve] == [0.0, 6.0, 12.0, 18.0]
    assert info["plain_step_s"] == 6.0 and info["sync_extra_s"] == 0.0 and info["timing_steps"] == 3
    assert wan.time_to_target(curve, 3.0) == (12.0, 3)
    assert wan.project_curve(full, timing[:1])[0] == [] and "error" in wan.project_curve(full, timing[:1])[1]


def test_project_curve_with_sync_windows():
    H = 4  # plain steps 1 s; the step that ends a window 11 s (10 s of all-reduce)
    timing, t = [(1, 0.0, 9.0)], 0.0
    for k in range(2, 9):
        t += 11.0 if k % H == 0 else 1.0
        timing.append((k, t, 9.0))
    full = [(k, 1000.0 + k * 0.1, 5.0 - k * 0.1) for k in range(1, 13)]
    curve, info = wan.project_curve(full, timing, H)
    assert info["plain_step_s"] == 1.0 and info["sync_extra_s"] == 10.0
    rel = {k: t - curve[0][1] for k, t, _ in curve}
    assert [rel[k] for k in (3, 4, 8, 12)] == pytest.approx([2.0, 13.0, 27.0, 41.0])
    no_sync = [(1, 0.0, 9.0), (2, 1.0, 9.0), (3, 2.0, 9.0)]
    assert "warning" in wan.project_curve(full, no_sync, H)[1]


def test_the_target_is_dense_ddps_final_loss():
    runs = {"ddp-dense": {"curve": [(1, 0.0, 5.0), (2, 1.0, 2.0), (3, 2.0, 2.5)]},
            "swarm": {"curve": [(1, 0.0, 5.0), (2, 1.0, 9.0)]}}
    assert wan.ddp_target(runs) == 2.5  # its final running mean, not its best, nor the worst method's
    assert wan.ddp_target({"swarm": runs["swarm"]}) is None and wan.ddp_target({"ddp-dense": {"curve": []}}) is None
    # dense DDP always reaches its own final loss (at or before its last step)
    assert wan.time_to_target(runs["ddp-dense"]["curve"], 2.5) == (1.0, 2)


def test_reached_and_timing_done():
    c = [(1, 0.0, 5.0), (2, 1.0, 3.0), (3, 2.0, 3.5)]
    assert wan.reached(c, 3, 3.0) and not wan.reached(c, 4, 3.0) and not wan.reached(c, 3, 2.0)
    assert not wan.reached(c, 3, None) and not wan.reached([], 0, 1.0)
    assert wan.timing_done(c, 3, 2.0) and not wan.timing_done(c, 3, 2.5) and not wan.timing_done(c, 4, 0.0)
    assert not wan.timing_done(c[:2], 2, 0.0)


def test_val_at_the_budget_from_the_peers_val_history():
    # val_history is [[round, val_loss]]: with H = 32, the budget of 224 inner steps is round 7
    summ = [{"val_history": [[0, 5.0], [7, 2.0], [14, 1.5]]}, {"val_history": [[7, 2.2]]}, {}]
    assert wan.val_at(summ, 224 // wan.sync_every_of("swarm-h32")) == pytest.approx(2.1)
    assert wan.val_at(summ, 100) is None and wan.val_at([], 7) is None


def test_lower_bounds_and_speedup_kinds():
    hit = {"time_to_target_s": 10.0, "curve": [(1, 0.0, 5.0), (2, 30.0, 1.0)]}
    miss = {"time_to_target_s": None, "curve": [(1, 0.0, 5.0), (2, 40.0, 3.0)]}
    assert wan.time_or_bound(hit) == (10.0, False) and wan.time_or_bound(miss) == (40.0, True)
    assert wan.time_or_bound(None) == (None, False)
    assert wan.speedup(hit, {"time_to_target_s": 5.0}) == (2.0, "exact")
    assert wan.speedup(miss, hit) == (4.0, "at_least")  # the baseline missed: at least 40 / 10
    assert wan.speedup(hit, miss) == (0.25, "at_most")  # we missed: at most 10 / 40
    assert wan.speedup(miss, miss) == (None, None) and wan.speedup(None, hit) == (None, None)


def test_bytes_per_sample_and_gap():
    run = {"tx_bytes_run": [1_000_000, 3_000_000], "steps": 100}
    assert wan.bytes_per_sample(run, 16) == 1250.0  # mean 2 MB / (100 steps x 16)
    assert wan.bytes_per_sample({"tx_bytes_run": [1], "steps": 0}, 16) is None and wan.bytes_per_sample(None, 16) is None
    # the samples the peers say they trained, when every peer says (a slow peer trains fewer)
    said = {**run, "samples_by_peer": {"p0": 1600, "p1": 800}}
    assert wan.bytes_per_sample(said, 16) == pytest.approx(sum(run["tx_bytes_run"]) / 2400)
    assert wan.bytes_per_sample({**run, "samples_by_peer": {"p0": 1600, "p1": None}}, 16) == 1250.0
    assert wan.gap(2.2, 2.0) == 0.1 and wan.gap(None, 2.0) is None and wan.gap(2.0, 0) is None


def _run(ttt, end, val, tx, steps=224, st=0.3):
    return {"time_to_target_s": ttt, "curve": [(1, 0.0, 5.0), (steps, end, 2.0)], "val_loss": val,
            "tx_bytes_run": tx, "steps": steps, "step_time_s": st}


def test_summarize_rates_keys_per_rate():
    per_rate = {
        "80mbit": {"ddp-dense": _run(100.0, 150.0, 2.0, [9_000_000] * 4), "ddp-sparse": _run(50.0, 60.0, 2.0, [10] * 4),
                   "swarm-diloco": _run(40.0, 45.0, 2.1, [10] * 4), "torchft-diloco": _run(30.0, 35.0, 2.0, [10] * 4),
                   "swarm": _run(20.0, 25.0, 2.2, [3_584_000] * 4), "swarm-h32": _run(10.0, 15.0, 2.1, [358_400] * 4)},
        "8mbit": {"ddp-dense": _run(1000.0, 1500.0, 2.0, [9_000_000] * 4),
                  "swarm-h32": _run(None, 20.0, 2.3, [358_400] * 4)},
    }
    pairs = {"80mbit": [(0.25, 0.3), (0.2, 0.3), (0.25, 0.35)], "8mbit": []}
    out = wan.summarize_rates(per_rate, "swarm-h32", 2.0, pairs, 16)
    keys = ("speedup_vs_ddp_time_to_ddp_loss", "speedup_vs_sparse_ddp_time_to_ddp_loss",
            "speedup_vs_dense_diloco_time_to_ddp_loss", "speedup_vs_torchft_diloco_time_to_ddp_loss",
            "bytes_per_sample_vs_per_step_swarm", "val_loss_gap_vs_ddp_at_equal_samples",
            "local_step_time_over_compute_floor")
    for key in keys:
        assert set(out[key]) == {"80mbit", "8mbit"}, key
    assert out["local_step_config"]["method"] == "swarm-h32" and out["local_step_config"]["sync_every"] == 32
    assert out["speedup_vs_ddp_time_to_ddp_loss"] == {"80mbit": 10.0, "8mbit": 50.0}  # 1000 / at least 20
    assert out["speedup_bounds"] == {"speedup_vs_ddp_time_to_ddp_loss": {"8mbit": "at_most"}}
    assert out["speedup_vs_sparse_ddp_time_to_ddp_loss"] == {"80mbit": 5.0, "8mbit": None}
    assert out["speedup_vs_dense_diloco_time_to_ddp_loss"]["80mbit"] == 4.0
    assert out["speedup_vs_torchft_diloco_time_to_ddp_loss"]["80mbit"] == 3.0
    assert out["bytes_per_sample_vs_per_step_swarm"] == {"80mbit": 10.0, "8mbit": None}
    assert out["val_loss_gap_vs_ddp_at_equal_samples"] == {"80mbit": 0.05, "8mbit": 0.15}
    assert out["local_step_time_over_compute_floor"] == {"80mbit": 1.4, "8mbit": None}
    assert out["local_step_time_ratios"]["80mbit"] == [1.2, 1.5, 1.4]
    assert out["local_floor_step_s"] == {"80mbit": [0.25, 0.2, 0.25], "8mbit": []}
    assert out["time_to_ddp_loss_lower_bound_s"] == {"80mbit": {}, "8mbit": {"swarm-h32": 20.0}}
    assert out["time_to_ddp_loss_s"]["8mbit"]["swarm-h32"] is None
    assert out["bytes_per_sample"]["80mbit"]["swarm-h32"] == 100
    json.dumps(out)


def test_probe_torchft_reports_why_not():
    version, why = wan.probe_torchft(sys.executable, code="import no_such_module_xyz")
    assert version is None and "no_such_module_xyz" in why and "--no-deps" in why
    version, why = wan.probe_torchft("/nonexistent/python3")
    assert version is None and "cannot run" in why
    version, why = wan.probe_torchft(sys.executable, code="import sys; sys.stdout.write('9.9')")
    assert (version, why) == ("9.9", None)


def test_the_table_says_which_rows_were_timed_and_which_missed_the_target():
    import types
    a = types.SimpleNamespace(batch_size=16)
    runs = {"ddp-dense": {**_run(100.0, 150.0, 2.0, [9_000_000] * 4), "timing": {"timing_steps": 4}},
            "swarm-h32": {**_run(None, 20.0, 2.3, [358_400] * 4), "max_steps": 448, "stopped_at_step": None},
            "swarm": _run(5.0, 20.0, 2.3, [358_400] * 4)}
    out = wan.table(runs, {"step_time_s": 0.25}, 2.0, a, "8mbit", None)
    rows = {line.split(" | ")[0].strip("| "): line for line in out.splitlines() if line.startswith("| ")}
    assert "timed 4 steps here; loss of its budget at unshaped" in rows["ddp-dense"]
    assert ">= 20.0 (missed)" in rows["swarm-h32"] and "up to 448 steps" in rows["swarm-h32"]
    assert "its budget here" in rows["swarm"] and "| 5.0 |" in rows["swarm"]


# ----------------------------------------------------------------------------- the delay line and the slow peer

dl = wan.delayline  # bench/delayline.py, as bench/wan.py imports it
_PING = Path(__file__).resolve().parent.parent / "bench" / "delayline_ping.py"
_pspec = importlib.util.spec_from_file_location("bench_delayline_ping", _PING)
dping = importlib.util.module_from_spec(_pspec)
_pspec.loader.exec_module(dping)


def test_delay_line_command_line_and_link_names():
    links = [dl.Link("swwan1-p0", "wan0", "swwan1-hub", "vp0"), dl.Link("swwan1-p1", "wan0", "swwan1-hub", "vp1")]
    argv = dl.argv("/tmp/x/delayline", 50, links, 1 << 20)
    assert argv == ["/tmp/x/delayline", "50000", "1048576", "/run/netns/swwan1-p0:wan0:/run/netns/swwan1-hub:vp0",
                    "/run/netns/swwan1-p1:wan0:/run/netns/swwan1-hub:vp1"]
    assert dl.argv("d", 0.25, links[:1])[1] == "250"  # microseconds
    for bad in (dl.Link("a:b", "wan0", "hub", "vp0"), dl.Link("ns", "x" * 16, "hub", "vp0"),
                dl.Link("ns", "wan0", "../hub", "vp0"), dl.Link("ns", "wan0", "hub", "")):
        with pytest.raises(ValueError):
            bad.arg()
    with pytest.raises(ValueError):
        dl.argv("d", -1, links)
    with pytest.raises(ValueError):
        dl.argv("d", 5, [])


def test_delay_line_output_and_proc_stat_parsing():
    assert dl.parse_ready("ready sched=fifo\n") == "fifo"
    assert dl.parse_ready("ready sched=other") == "other"
    assert dl.parse_ready("delayline: TUNSETIFF wan0: Operation not permitted") is None
    assert dl.parse_ready("") is None
    text = "ready sched=fifo\nframes_up 10 frames_down 12 bytes_up 1000 bytes_down 1200 dropped 1 write_errors 2\n"
    assert dl.parse_counters(text) == {"frames_up": 10, "frames_down": 12, "bytes_up": 1000, "bytes_down": 1200,
                                       "dropped": 1, "write_errors": 2}
    assert dl.parse_counters("frames_up 1 frames_down") is None
    assert dl.parse_counters("ready sched=fifo\n") is None
    assert dl.parse_counters("frames_up x frames_down 1 bytes_up 1 bytes_down 1 dropped 1") is None
    # /proc/PID/stat: utime and stime are fields 14 and 15; the name may hold spaces and ')'
    stat = "4242 (a b) c) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 1 0 12345 1000 10"
    assert dl.cpu_seconds(stat, 100) == pytest.approx(3.0)
    assert dl.cpu_seconds("garbage", 100) is None
    assert dl.cpu_seconds("1 (x) S 1 2 3", 100) is None


def test_ping_output_is_parsed_and_the_echo_request_has_a_valid_checksum():
    out = ("reply from 10.77.0.2: seq 1 time 201.90 ms\nreply from 10.77.0.2: seq 2 time 100.41 ms\n"
           "rtt min/avg/median/max = 100.34/117.31/100.41/201.90 ms, 6/6 replies\n")
    assert dl.parse_ping(out) == {"min_ms": 100.34, "avg_ms": 117.31, "median_ms": 100.41, "max_ms": 201.9,
                                  "replies": 6, "sent": 6}
    assert dl.parse_ping("rtt none, 0/6 replies\n") is None
    assert dl.parse_ping("") is None
    pkt = dping.echo_request(0x1234, 7)
    assert pkt[0] == 8 and dping.checksum(pkt) == 0  # a packet with its checksum in sums to 0
    assert dping.checksum(b"\x00\x01\xf2") == dping.checksum(b"\x00\x01\xf2\x00")  # odd length padded


def test_the_delay_line_source_compiles_and_refuses_bad_arguments(tmp_path):
    import shutil
    import subprocess
    if shutil.which("gcc") is None and shutil.which("cc") is None:
        pytest.skip("no C compiler")
    binary = dl.build(tmp_path)
    r = subprocess.run([str(binary)], capture_output=True, text=True, timeout=10)
    assert r.returncode == 2 and "usage" in r.stderr
    r = subprocess.run([str(binary), "5000", "10", "x:y:z:w"], capture_output=True, text=True, timeout=10)
    assert r.returncode == 2 and "bad arguments" in r.stderr  # a queue smaller than one frame


def test_delay_and_slow_peer_options_are_checked():
    assert wan.check_options(0, None, 4) == []
    assert wan.check_options(50, 0.5, 4) == []
    assert wan.check_options(25, 1.0, 2) == []
    assert "--delay-ms" in wan.check_options(-1, None, 4)[0]
    assert "--delay-ms" in wan.check_options(float("nan"), None, 4)[0]
    assert "--slow-peer" in wan.check_options(0, 0.0, 4)[0]
    assert "--slow-peer" in wan.check_options(0, 1.5, 4)[0]
    assert "at least 2 peers" in wan.check_options(0, 0.5, 1)[0]
    assert wan.slow_flags(0.5, 3, 4) == ["--compute-speed", "0.5"]
    assert wan.slow_flags(0.5, 0, 4) == [] and wan.slow_flags(None, 3, 4) == []
    assert wan.has_compute_speed("  --compute-speed COMPUTE_SPEED  for tests")
    assert not wan.has_compute_speed("usage: peer.py [-h]")


@pytest.mark.parametrize("argv, want", [
    (["--delay-ms", "-5"], "--delay-ms must be in [0, 1000]"),
    (["--slow-peer", "2"], "--slow-peer must be in (0, 1]"),
    (["--slow-peer", "0.5"], "peer.py --compute-speed"),
])
def test_bad_delay_or_slow_peer_is_one_line_and_exit_2(monkeypatch, capsys, argv, want):
    monkeypatch.setattr(wan, "root_check", lambda: None)
    monkeypatch.setattr(wan, "peer_help", lambda: "usage: peer.py [-h]")  # a peer.py without the knob
    monkeypatch.setattr(sys, "argv", ["wan.py", "--only", "swarm", "--steps", "8", *argv])
    called = []
    monkeypatch.setattr(wan, "sh", lambda *a, **k: called.append(a))
    assert wan.main() == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and want in err[0]
    assert called == []


def _summary(pid, samples, wait):
    return {"peer_id": "f" * 32, "name": pid, "samples": samples, "steps_contributed": samples // 16,
            "step_phases": {"steps": 10, "wait_share": wait}}


def test_fast_peer_wait_share_leaves_the_slow_peer_out():
    summaries = [_summary("p0", 160, 0.5), _summary("p1", 160, 0.6), _summary("p2", 160, None),
                 _summary("p3", 160, 0.05)]
    fast, slow = wan.fast_slow_split(summaries, "p3")
    assert [s["name"] for s in fast] == ["p0", "p1", "p2"] and slow["name"] == "p3"
    assert wan.peer_wait_share(fast) == 0.55  # p2 reported none
    out = wan.peer_split(summaries, 4, 0.5)
    assert out["fast_peer_wait_share"] == 0.55 and out["slow_peer_id"] == "p3"
    assert out["slow_peer_samples"] == 160 and out["slow_peer_steps_contributed"] == 10
    assert out["slow_peer_wait_share"] == 0.05
    assert out["samples_by_peer"] == {"p0": 160, "p1": 160, "p2": 160, "p3": 160}
    plain = wan.peer_split(summaries, 4, None)  # no slow peer: every peer is fast
    assert plain["fast_peer_wait_share"] == round((0.5 + 0.6 + 0.05) / 3, 3) and "slow_peer_id" not in plain
    missing = wan.peer_split(summaries[:3], 4, 0.5)  # the slow peer printed no summary
    assert missing["slow_peer_samples"] is None and missing["fast_peer_wait_share"] == 0.55
    assert wan.peer_wait_share([]) is None


def test_ddp_rank_wait_shares_from_the_step_lines():
    recs = [[{"step": 1, "compute_s": 0.1, "comm_s": 0.3}, {"step": 2, "compute_s": 0.1, "comm_s": 0.5}],
            [{"step": 1, "compute_s": 0.4, "comm_s": 0.0}], []]
    assert wan.rank_wait_shares(recs) == [0.8, 0.0, None]


def test_line_cpu_and_the_last_lines_link_keys():
    import types
    assert wan.line_cpu(None, 10.0, 5) is None
    assert wan.line_cpu(1.5, 100.0, 30) == {"cpu_s": 1.5, "core_share": 0.015, "cpu_ms_per_step": 50.0}
    assert wan.line_cpu(0.0, 0.0, None) == {"cpu_s": 0.0, "core_share": None, "cpu_ms_per_step": None}
    a = types.SimpleNamespace(delay_ms=50.0, slow_peer=0.5, peers=4)
    line = types.SimpleNamespace(sched="fifo", counters={"dropped": 0})
    w = types.SimpleNamespace(line=line)
    pings = {"unshaped": {"median_ms": 100.4}, "80mbit": None}
    per_rate = {"80mbit": {"swarm": {"fast_peer_wait_share": 0.4, "slow_peer_samples": 128,
                                     "samples_by_peer": {"p0": 128, "p3": 128}},
                           "ddp-dense": {"fast_peer_wait_share": 0.7}}}
    out = wan.link_figures(a, w, pings, {"80mbit": {"swarm": {"cpu_s": 1.0}}}, 2.0, 5.0, 100.0, per_rate)
    assert out["rtt_configured_ms"] == 100.0 and out["ping_rtt_ms"] == 100.4
    assert out["ping_rtt_ms_by_rate"] == {"unshaped": 100.4, "80mbit": None}
    assert out["delay_line"]["cpu_s_total"] == 3.0 and out["delay_line"]["core_share_total"] == 0.03
    assert out["delay_line"]["sched"] == "fifo" and out["delay_line_cpu"]["80mbit"]["swarm"]["cpu_s"] == 1.0
    assert out["fast_peer_wait_share"] == {"80mbit": {"swarm": 0.4, "ddp-dense": 0.7}}
    assert out["slow_peer_samples"] == {"80mbit": {"swarm": 128}} and out["slow_peer_id"] == "p3"
    plain = wan.link_figures(types.SimpleNamespace(delay_ms=0.0, slow_peer=None, peers=4),
                             types.SimpleNamespace(line=None), {}, {}, None, None, 10.0, {})
    assert plain["delay_line"] is None and plain["ping_rtt_ms"] is None and "slow_peer_samples" not in plain
    json.dumps(out)
