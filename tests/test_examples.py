"""Every example in examples/ trains with two `python peer.py --task examples/...` peers: replicas
bit-identical (param_sketch, buffers included) and the held-out loss at least 10% below its first
value. The transformers examples skip, saying why, where transformers is not installed."""

from __future__ import annotations

import importlib.util

import pytest

from .conftest import free_port, join_at

pytestmark = pytest.mark.timeout(300)

EXAMPLES = [
    ("ctr", ("--steps", "60", "--eval-every", "30", "--table-slots", "64"), None),
    ("gpt2", ("--steps", "40", "--eval-every", "20", "--table-slots", "16"), "transformers"),
    ("resnet", ("--steps", "30", "--eval-every", "15"), "transformers"),
]


@pytest.mark.parametrize("name,flags,needs", EXAMPLES, ids=[e[0] for e in EXAMPLES])
async def test_example_trains_with_two_peers(spawn, name, flags, needs):
    if needs and importlib.util.find_spec(needs) is None:
        pytest.skip(f"{needs} is not installed (pip install -e '.[examples]')")
    task = ("--task", f"examples/{name}.py:task")
    port = free_port()  # both start at once: the second retries its join until the first listens
    first = spawn(*task, *flags, "--min-peers", "2", "--port", str(port), small=False, env={"OMP_NUM_THREADS": "1"})
    second = spawn(*task, *flags, "--min-peers", "2", *join_at(port), small=False, env={"OMP_NUM_THREADS": "1"})
    c2, s2 = await second.finish(240)
    c1, s1 = await first.finish(120)
    assert c1 == 0 and c2 == 0, (first.stderr_tail(), second.stderr_tail())
    assert s1["steps"] == s2["steps"] == int(flags[1])
    assert s1["param_sketch"] == s2["param_sketch"]
    for s in (s1, s2):
        hist = s["val_history"]
        assert hist[0][0] == 0 and hist[-1][1] <= 0.9 * hist[0][1], hist
    if name == "resnet":
        assert s1["task"]["buffers"] > 0  # BatchNorm's statistics, covered by the sketch
    if name == "ctr":
        assert s1["task"]["tables"][0]["path"] == "features.emb"
