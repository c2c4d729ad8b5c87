#!/usr/bin/env bash
# Host groups and the examples on a CUDA machine (docs/design.md, "Host groups"):
#   1. tests/test_group.py on the GPU path: NCCL with one GPU per rank when there are >= 2 GPUs;
#      with one GPU, the model on the GPU and the collectives on gloo (NCCL needs a GPU per rank);
#      without CUDA, the CPU/gloo path CI runs;
#   2. the row exchange timed: the group's share of a pull (3 all_to_all stages) against the same
#      rows from the same owners over HTTP, median of 20, 8192 ids per table per rank;
#   3. on CUDA only: every example and the built-in LM trained by two peers on the GPU
#      (bench/gpu_examples.py --device cuda; CI trains them on CPUs), bounded to 3 minutes;
# and prints the tables last. Parts 1 and 2 are bounded to 5 minutes, all three to 8 (about 5 on
# one H200, 2026-12-04).
# Usage: bash bench/gpu_check.sh   (from anywhere)
set -u
cd "$(dirname "$0")/.."
start=$SECONDS
left() { echo $((300 - (SECONDS - start))); }

# what the tests import beside torch: name the missing ones in one line rather than fail in pytest
missing=$(python3 - <<'PY'
import importlib.util
mods = ("aiohttp", "msgpack", "safetensors", "numpy", "prometheus_client", "cryptography", "pytest",
        "pytest_asyncio", "pytest_timeout", "hypothesis")
print(" ".join(m for m in mods if importlib.util.find_spec(m) is None))
PY
)
if [ -n "$missing" ]; then
  echo "gpu_check: missing Python modules: $missing (pip install -e '.[test]' installs them)" >&2
  exit 2
fi

read -r gpus < <(python3 -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
if [ "$gpus" -ge 2 ]; then
  backend=nccl; device=cuda; ranks=$(( gpus < 3 ? gpus : 3 ))
elif [ "$gpus" -eq 1 ]; then
  backend=gloo; device=cuda; ranks=3
  echo "one GPU: NCCL needs one GPU per rank, so the ranks share it with gloo collectives"
else
  backend=gloo; device=cpu; ranks=3
  echo "no CUDA device: checking the CPU/gloo path instead"
fi
export OMP_NUM_THREADS=1

tests=FAILED
if GROUP_TEST_BACKEND=$backend GROUP_TEST_DEVICE=$device timeout "$(( $(left) - 90 ))" \
    python3 -m pytest -q -p no:cacheprovider tests/test_group.py; then
  tests=passed
fi

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
port=$(python3 -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
timeout "$(( $(left) > 10 ? $(left) - 5 : 5 ))" python3 -m torch.distributed.run --nproc-per-node "$ranks" \
  --master-addr 127.0.0.1 --master-port "$port" tests/group_worker.py "$out" --backend "$backend" \
  --device "$device" --rows 65536 --want 8192 --time 20 >"$out/log" 2>&1 || tail -5 "$out/log"

examples=""
if [ "$device" = cuda ]; then
  timeout 180 python3 bench/gpu_examples.py --device cuda --timeout 60 >"$out/examples" 2>&1 \
    || echo "bench/gpu_examples.py did not finish (exit $?)" >>"$out/examples"
  examples="$out/examples"
fi

python3 - "$out" "$backend" "$device" "$ranks" "$tests" <<'PY'
import json, pathlib, sys
out, backend, device, ranks, tests = sys.argv[1:]
reps = [json.loads(p.read_text()) for p in sorted(pathlib.Path(out).glob("rank*.json"))]
print()
print(f"host group check: {ranks} ranks, backend {backend}, device {device}; tests/test_group.py {tests}")
print(f"{'rank':>4} {'rows':>7} {'collective ms':>14} {'http ms':>9} {'speedup':>8} {'rows equal':>10} {'exactly once':>12}")
for r in reps:
    t = r.get("timing") or {}
    if not t:
        continue
    print(f"{r['rank']:>4} {t['rows']:>7} {t['collective'] * 1e3:>14.1f} {t['http'] * 1e3:>9.1f} "
          f"{t['http'] / t['collective']:>7.2f}x {str(r['rows_equal_http']):>10} "
          f"{str(all(u['exact'] for u in r['updates'].values())):>12}")
if not reps:
    print("row exchange: no result (see the log above)")
PY
if [ -n "$examples" ]; then
  echo
  echo "the examples on the GPU (bench/gpu_examples.py --device cuda):"
  grep -v '^{' "$examples"
fi
