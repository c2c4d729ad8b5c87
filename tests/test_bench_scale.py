"""The pure parts of bench/scale.py: argument parsing, per-step figures, replica identity, the
16-vs-4 target, the paper model and the last line's shape. No namespaces, no processes, no root."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parent.parent / "bench" / "scale.py"
_spec = importlib.util.spec_from_file_location("bench_scale", _PATH)
scale = importlib.util.module_from_spec(_spec)
sys.modules["bench_scale"] = scale  # its dataclasses look their module up there
_spec.loader.exec_module(scale)


def test_parse_peers():
    assert scale.parse_peers("2,4,8,16") == [2, 4, 8, 16]
    assert scale.parse_peers(" 4, 2 ") == [4, 2]
    for bad, why in (("2,x", "comma-separated"), ("1,2", "at least 2"), ("2,2", "twice"), ("", "comma"),
                     ("-2", "comma")):
        with pytest.raises(scale.ArgError, match=why):
            scale.parse_peers(bad)


def test_parse_peer_args_passes_flags_and_refuses_the_benchmarks_own():
    assert scale.parse_peer_args('--max-contributors 4 --ratio 0.02') == ["--max-contributors", "4", "--ratio", "0.02"]
    assert scale.parse_peer_args("") == []
    for bad in ("--steps 3", "--batch-size=4", "--join 1.2.3.4:5", "--name x"):
        with pytest.raises(scale.ArgError, match="set by the benchmark"):
            scale.parse_peer_args(bad)
    with pytest.raises(scale.ArgError, match="--peer-args"):
        scale.parse_peer_args('--ratio "0.1')


def test_main_bad_input_is_one_line_and_exit_2(capsys):
    assert scale.main(["--peers", "2,zz"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("scale.py: error: --peers") and "\n" not in err and "Traceback" not in err
    assert scale.main(["--steps", "5"]) == 2
    assert "--steps" in capsys.readouterr().err


def test_listen_addr():
    assert scale.listen_addr("listening on http://10.77.0.1:7100 as peer p0 (task bytelm)") == "10.77.0.1:7100"
    assert scale.listen_addr("listening on http://127.0.0.1:36507") == "127.0.0.1:36507"
    assert scale.listen_addr("step 1 loss 5.0") is None


def test_per_step_and_ratio():
    assert scale.per_step(300, 30) == 10.0
    assert scale.per_step(None, 30) is None and scale.per_step(5, 0) is None
    # the floor ratio: swarm step time over the contended floor's
    assert scale.ratio(0.3, 0.15) == 2.0
    assert scale.ratio(0.3, None) is None and scale.ratio(0.3, 0) is None


def test_loss_windows_and_fell():
    curve = [(s, float(s), 5.0 - 0.05 * s) for s in range(1, 61)]
    first, last = scale.loss_windows(curve)
    assert first == pytest.approx(5.0 - 0.5) and last == pytest.approx(2.0)
    assert scale.loss_fell(first, last) is True
    rising = [(s, float(s), 1.0 + 0.01 * s) for s in range(1, 31)]
    assert scale.loss_fell(*scale.loss_windows(rising)) is False
    assert scale.loss_windows([]) == (None, None) and scale.loss_fell(None, 1.0) is None
    assert scale.loss_fell(float("nan"), 1.0) is None


def test_replicas_identical():
    a = {"steps": 60, "param_sketch": [0.5, -1.25]}
    assert scale.replicas_identical([a, dict(a), dict(a)], 3)
    assert not scale.replicas_identical([a, dict(a)], 3)  # a peer printed no summary
    assert not scale.replicas_identical([a, None], 2)
    assert not scale.replicas_identical([a, {**a, "param_sketch": [0.5, -1.2500001]}], 2)
    assert not scale.replicas_identical([a, {**a, "steps": 59}], 2)
    assert not scale.replicas_identical([{"steps": 60}, {"steps": 60}], 2)  # no sketch: not evidence


def test_summary_rates_and_payload():
    s = [{"bytes_sent": 3000, "bytes_received": 6000, "steps_contributed": 10, "row_bytes_sent": 100,
          "row_bytes_received": 50, "sent_by_kind": {"control": 20}, "received_by_kind": {"control": 40}},
         {"bytes_sent": 1000, "bytes_received": 2000, "steps_contributed": 5, "row_bytes_sent": 300,
          "row_bytes_received": 150, "sent_by_kind": {"control": 40}, "received_by_kind": {"control": 0}}]
    r = scale.summary_rates(s, 10)
    assert r["grad_bytes_sent_per_peer_step"] == 200.0 and r["grad_bytes_received_per_peer_step"] == 400.0
    assert r["grad_bytes_sent_per_peer_step_max"] == 300.0
    assert r["row_bytes_sent_per_peer_step"] == 20.0 and r["control_bytes_received_per_peer_step"] == 2.0
    assert r["sent_by_kind_per_peer_step"] == {"control": 3.0} and r["received_by_kind_per_peer_step"] == {"control": 2.0}
    # per contributed round and recipient: 3000 / (10 x 3), 1000 / (5 x 3)
    assert scale.payload_bytes(s, 4) == pytest.approx((100 + 200 / 3) / 2, abs=0.1)
    assert scale.payload_bytes([{"bytes_sent": 5}], 4) is None


def test_target_check_both_directions():
    runs = {"4": {"grad_bytes_sent_per_peer_step": 100.0, "grad_bytes_received_per_peer_step": 100.0},
            "16": {"grad_bytes_sent_per_peer_step": 150.0, "grad_bytes_received_per_peer_step": 250.0}}
    t = scale.target_check(runs)
    assert t["sent_ratio"] == 1.5 and t["received_ratio"] == 2.5 and t["met"] is False
    runs["16"]["grad_bytes_received_per_peer_step"] = 200.0
    assert scale.target_check(runs)["met"] is True
    assert scale.target_check({"4": runs["4"]}) is None
    assert scale.target_check(runs)["met_steady"] is None  # not polled
    runs["4"]["grad_bytes_sent_per_peer_step_steady"] = runs["4"]["grad_bytes_received_per_peer_step_steady"] = 10.0
    runs["16"]["grad_bytes_sent_per_peer_step_steady"] = runs["16"]["grad_bytes_received_per_peer_step_steady"] = 30.0
    t = scale.target_check(runs)
    assert t["steady_sent_ratio"] == 3.0 and t["met_steady"] is False and t["met"] is True


def test_paper_model():
    m = scale.paper_model(50_000.0, 1000.0, 800.0, 4)
    assert m["100"]["all_to_all"] == {"sent": 50_000 * 99 + 1000, "received": 50_000 * 99 + 800}
    # the default, --cap-by bytes: every peer every step at 1/floor(P/C) of a payload, about C
    # payloads each way at any size; the count of requests still grows with P
    assert m["1000"]["capped"]["payload_share"] == 250 and m["100"]["capped"]["payload_share"] == 25
    one = (50_000 - scale.PAYLOAD_FIXED_BYTES) / 250 + scale.PAYLOAD_FIXED_BYTES  # what does not shrink stays
    assert m["1000"]["capped"]["sent"] == round(one * 999 + 1000) and m["1000"]["capped"]["received"] == round(one * 999 + 800)
    assert m["1000"]["capped"]["sent"] < 2.5 * m["100"]["capped"]["sent"]
    assert m["1000"]["capped"]["requests"] == {"per_step": 999, "bytes": 999 * scale.REQUEST_BYTES}
    # --cap-by rounds: a whole payload every floor(P/C) rounds, at most every 8th
    # (cadence.MAX_STRIDE), so past 8C peers its bytes grow with P again, 8x below all-to-all
    by_rounds = m["1000"]["capped_by_rounds"]
    assert by_rounds["rounds_between_contributions"] == m["100"]["capped_by_rounds"]["rounds_between_contributions"] == 8
    assert by_rounds["sent"] == round(50_000 * 999 / 8 + 1000) and by_rounds["received"] == round(50_000 * 999 / 8 + 800)
    assert m["1000"]["all_to_all"]["sent"] / by_rounds["sent"] > 7.9
    small = scale.paper_model(50_000.0, 0.0, 0.0, 4, sizes=(4, 16))
    assert small["4"]["capped"]["sent"] == small["4"]["capped_by_rounds"]["sent"] == 150_000
    assert small["16"]["capped_by_rounds"]["sent"] == round(50_000 * 15 / 4)
    assert small["16"]["capped"]["sent"] == round(((50_000 - scale.PAYLOAD_FIXED_BYTES) / 4 + scale.PAYLOAD_FIXED_BYTES) * 15)
    assert scale.paper_model(None, 0, 0, 4) is None


def test_last_line_shape():
    run = {k: 1.0 for k in scale.REQUIRED}
    run.update(grad_bytes_sent_per_peer_step=10.0, grad_bytes_received_per_peer_step=10.0, replicas_identical=True)
    runs = {n: dict(run) for n in ("2", "4", "8", "16")}
    line = scale.last_line(runs, None, {"seconds": 1.0})
    for key in scale.REQUIRED:
        assert set(line[key]) == {"2", "4", "8", "16"}, key
    assert line["target_16_vs_4"]["met"] is True
    assert json.loads(json.dumps(line)) == line  # one JSON object
    off = scale.last_line({"2": dict(run)}, "unavailable (not root)")
    assert off["all_traffic"].startswith("unavailable") and off["target_16_vs_4"] is None


def test_full_samples_drops_those_before_every_peer_ran():
    s = [(0.0, [1]), (1.0, [2, 5]), (2.0, [4, 9])]
    assert scale.full_samples(s, 2) == s[1:]



def test_steady_rates_between_two_polls():
    a = [{"step": 30, "bytes_sent": {"grads": 1000, "rows": 5}, "bytes_received": {"grads": 3000}},
         {"step": 31, "bytes_sent": {"grads": 0}, "bytes_received": {}}, None]
    b = [{"step": 55, "bytes_sent": {"grads": 26000}, "bytes_received": {"grads": 53000}},
         {"step": 56, "bytes_sent": {"grads": 50000}, "bytes_received": {"grads": 25000}},
         {"step": 55, "bytes_sent": {"grads": 9}, "bytes_received": {"grads": 9}}]
    r = scale.steady_rates(a, b)
    assert r["steady_peers_polled"] == 2  # the third peer was not polled twice
    assert r["grad_bytes_sent_per_peer_step_steady"] == (1000 + 2000) / 2
    assert r["grad_bytes_received_per_peer_step_steady"] == (2000 + 1000) / 2
    assert r["sent_by_kind_per_peer_step_steady"] == {"grads": 1500.0, "rows": -0.1}
    assert scale.steady_rates([a[0]], [a[0]])["grad_bytes_sent_per_peer_step_steady"] is None  # no steps between


def test_flag_value_and_marks():
    assert scale.flag_value(["--warmup-steps", "5", "--ratio", "0.1"], "--warmup-steps", 20) == 5
    assert scale.flag_value(["--warmup-steps=7"], "--warmup-steps", 20) == 7
    assert scale.flag_value([], "--warmup-steps", 20) == 20
    assert scale.steady_marks(60) == (30, 55)
    assert scale.steady_marks(200) == (100, 195)
    first, last = scale.steady_marks(30, warmup=20)
    assert first < last <= 30
