"""Code structure (docs/design.md, "Code structure"): no import cycle among the modules of swarm/,
and no access to another module's private (``_name``) members, in swarm/ and in the tests alike.
The checks parse the files (tests/structure.py); nothing is imported or run."""

from __future__ import annotations

from pathlib import Path

from .structure import cycles, import_graph, package_modules, private_violations

ROOT = Path(__file__).resolve().parent.parent

# Private accesses still waiting for a public interface, (file, expression) as the failure message
# spells them. Empty now: every coupling goes through a public interface. Add none; an entry that
# matches nothing fails the test too.
PENDING: set[tuple[str, str]] = set()


def scanned_files() -> dict[str, str]:
    """Every Python file of the package, the launcher, the examples, the benchmarks and the tests."""
    paths = [*(ROOT / "swarm").rglob("*.py"), ROOT / "peer.py", *(ROOT / "examples").glob("*.py"),
             *(ROOT / "bench").glob("*.py"), *(ROOT / "tests").glob("*.py")]
    return {p.relative_to(ROOT).as_posix(): p.read_text() for p in sorted(paths)}


def test_no_import_cycle_among_swarm_modules():
    modules = package_modules(ROOT)
    assert "swarm.node" in modules and "swarm.tables.shard" in modules
    graph = import_graph({name: (path.read_text(), is_pkg) for name, (path, is_pkg) in modules.items()})
    found = cycles(graph)
    assert not found, "import cycles among swarm's modules (type-only imports excluded):\n" + "\n".join(
        " <-> ".join(c) for c in found)


def test_no_access_to_another_modules_privates():
    found = private_violations(scanned_files())
    new = [v for v in found if (v.file, v.expr) not in PENDING]
    assert not new, "access to another module's private members (file:line: expression):\n" + "\n".join(
        map(str, new))
    stale = PENDING - {(v.file, v.expr) for v in found}
    assert not stale, f"PENDING entries that match nothing any more: remove them: {sorted(stale)}"


# -- the checker itself, on small sources -------------------------------------------------------------

def graph_of(**modules: str) -> dict[str, set[str]]:
    """Module name (dots as __) -> source; a name ending in __init is a package."""
    sources = {}
    for key, src in modules.items():
        name = key.replace("__", ".")
        is_pkg = name.endswith(".init")
        sources[name.removesuffix(".init")] = (src, is_pkg)
    return import_graph(sources)


def test_checker_finds_cycles_through_function_level_and_relative_imports():
    g = graph_of(p__init="", p__a="from . import b\n", p__b="def f():\n    from .c import x\n",
                 p__c="import p.a\n", p__d="")
    assert g["p.a"] == {"p.b"} and g["p.b"] == {"p.c"} and g["p.c"] == {"p.a"}
    assert cycles(g) == [["p.a", "p.b", "p.c"]]
    assert cycles(graph_of(p__init="", p__a="import p.b\n", p__b="from p import a\n", p__c="")) == [["p.a", "p.b"]]


def test_checker_leaves_out_type_only_imports():
    g = graph_of(p__init="", p__node="def run():\n    from .runner import go\n",
                 p__runner="from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .node import Peer\n"
                           "else:\n    import json\n")
    assert g["p.runner"] == set() and cycles(g) == []
    g = graph_of(p__init="", p__a="import typing\nif typing.TYPE_CHECKING:\n    pass\nelse:\n    from . import b\n",
                 p__b="from . import a\n")
    assert cycles(g) == [["p.a", "p.b"]]  # the else branch runs


def test_checker_resolves_packages_exactly():
    # a package's __init__ importing its submodules, which import each other through `from . import x`
    g = graph_of(p__init="from .a import A\nfrom .b import B\n", p__a="from . import b\nA = 1\n", p__b="B = 2\n")
    assert g["p.a"] == {"p.b"} and cycles(g) == []
    # ... but `from . import NAME` of a name the __init__ defines depends on the __init__ itself
    g = graph_of(p__init="from .a import A\nX = 1\n", p__a="from . import X\nA = 2\n")
    assert g["p.a"] == {"p"} and cycles(g) == [["p", "p.a"]]
    # importing p.q.m runs p.q's __init__ first: a cycle through it counts
    g = graph_of(p__init="", p__m="import p.q.n\n", p__q__init="from .. import m\n", p__q__n="")
    assert g["p.m"] == {"p.q", "p.q.n"} and cycles(g) == [["p.m", "p.q"]]
    # from two levels down: `from ..x import y` is p.x.y when that is a module
    g = graph_of(p__init="", p__x__init="", p__x__y="", p__q__init="", p__q__n="from ..x import y\n")
    assert g["p.q.n"] == {"p.x", "p.x.y"}


def violations(**files: str) -> list[str]:
    """file:line: expression of each violation in ``files`` (name -> source)."""
    return [f"{v.file}:{v.line}: {v.expr}" for v in private_violations(files)]


def test_checker_finds_private_access():
    core = "class Core:\n    def __init__(self):\n        self._state = 1\n    def _step(self):\n        return 1\n" \
           "_TABLE = {}\n"
    assert violations(core=core, user="from core import Core, _TABLE\n") == ["user:1: from core import _TABLE"]
    assert violations(core=core, user="def f(c):\n    c._step()\n    return c._state\n") == [
        "user:2: c._step", "user:3: c._state"]
    assert violations(core=core, user="import core\nx = core._TABLE\n") == ["user:2: core._TABLE"]
    # spelled as a string, it is the same access
    assert violations(core=core, user="def f(c, monkeypatch):\n    getattr(c, '_state')\n"
                                       "    monkeypatch.setattr(c, '_step', None)\n"
                                       "    monkeypatch.setattr('core._TABLE', {})\n") == [
        "user:2: getattr(c, '_state')", "user:3: monkeypatch.setattr(c, '_step', None)",
        "user:4: monkeypatch.setattr('core._TABLE', {})"]
    # writing another module's private is no way to make it one's own
    assert violations(core=core, user="def f(c):\n    c._state = 2\n    return c._state\n") == [
        "user:2: c._state", "user:3: c._state"]
    # a mixin (or subclass) in another file reaching the privates of the class it is mixed into
    assert violations(core=core, mixin="class M:\n    def go(self):\n        return self._step()\n") == [
        "mixin:3: self._step"]


def test_checker_allows_module_private_and_conventional_names():
    core = ("import os, sys, collections\n"
            "class Core:\n    _limit = 3\n    def __init__(self):\n        self._peers = {}\n"
            "    def merge(self, other):\n        return other._peers, other._limit, self.__class__\n"
            "def tag(fn):\n    fn._seen = True\n    return fn._seen\n"
            "P = collections.namedtuple('P', 'x')\n"
            "def f(p):\n    sys._getframe(0)\n    os._exit(0) if p is None else None\n    return p._replace(x=1)._asdict()\n")
    assert violations(core=core, user="def f(c):\n    return c.__dict__, c.peers\n") == []
