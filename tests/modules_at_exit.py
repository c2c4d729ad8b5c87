"""Run a script as `python SCRIPT ARGS...` would, then write one line to stderr at exit naming which
of torch's compiler modules it imported: ``modules at exit: {"torch._dynamo": false, ...}``.

For tests/test_memory.py, as the launcher of `peer.py` processes (conftest's ``spawn``).
"""

from __future__ import annotations

import atexit
import json
import runpy
import sys

WATCHED = ("torch._dynamo", "torch._inductor", "sympy")


def _report() -> None:
    sys.stderr.write("modules at exit: " + json.dumps({m: m in sys.modules for m in WATCHED}) + "\n")
    sys.stderr.flush()


if __name__ == "__main__":
    script, sys.argv = sys.argv[1], sys.argv[1:]
    sys.path.insert(0, str(__import__("pathlib").Path(script).resolve().parent))
    atexit.register(_report)
    runpy.run_path(script, run_name="__main__")
