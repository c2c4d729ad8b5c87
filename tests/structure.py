"""The code-structure checks of tests/test_structure.py, as small functions over ``ast`` trees.

Two rules (docs/design.md, "Code structure"):

* no import cycle among the modules of the ``swarm`` package: imports at module level and inside
  functions count, imports under ``if TYPE_CHECKING:`` do not (type-only, never run);
* no access to another module's private (``_name``, not ``__dunder__``) members: ``from X import
  _name`` (or a private module), ``obj._name`` where ``_name`` is not a private this file defines
  (module-private is fine), ``module._name`` on an imported module, and ``self._name`` where
  ``_name`` is defined only in another file (a mixin or a subclass reaching into the class it
  extends); ``getattr``/``setattr``/``hasattr``/``delattr`` and ``monkeypatch.setattr`` with a
  literal private name count as the attribute access they spell. A few standard-library privates
  that are public by convention are allowed (``STDLIB_PRIVATES``).

Nothing is imported or run: each file is parsed.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

# Standard-library privates that are public API by convention (each with why). Keyed by
# (object, name); object None: the name on any object.
STDLIB_PRIVATES = {
    ("sys", "_getframe"): "documented in the sys module (CPython's frame access)",
    ("os", "_exit"): "documented in the os module: exit without cleanup (in a forked child)",
    (None, "_replace"): "namedtuple's documented API (underscored so as not to clash with fields)",
    (None, "_asdict"): "namedtuple's documented API",
    (None, "_fields"): "namedtuple's documented API",
    (None, "_make"): "namedtuple's documented API",
}

_ATTR_FUNCS = {"getattr", "setattr", "hasattr", "delattr"}


def is_private(name: str) -> bool:
    """``_name`` but not ``__dunder__`` (and not a bare ``_``)."""
    return name.startswith("_") and name != "_" and not (name.startswith("__") and name.endswith("__"))


# ---------------------------------------------------------------------------------------------
# import graph


def module_name(path: Path, root: Path) -> str:
    """``root/swarm/a/b.py`` -> ``swarm.a.b``; ``root/swarm/a/__init__.py`` -> ``swarm.a``."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules(root: Path, package: str = "swarm") -> dict[str, tuple[Path, bool]]:
    """Every module of ``package`` under ``root``: name -> (path, is a package's __init__)."""
    return {module_name(p, root): (p, p.name == "__init__.py") for p in sorted((root / package).rglob("*.py"))}


def is_type_checking(test: ast.expr) -> bool:
    """``TYPE_CHECKING`` or ``typing.TYPE_CHECKING``."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """The import statements of ``tree`` that can run: at any depth, less the bodies of
    ``if TYPE_CHECKING:`` (their ``else:`` runs, so it counts)."""
    found: list[ast.Import | ast.ImportFrom] = []

    def walk(node: ast.AST) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        if isinstance(node, ast.If) and is_type_checking(node.test):
            children: list[ast.AST] = list(node.orelse)
        else:
            children = list(ast.iter_child_nodes(node))
        for child in children:
            walk(child)

    walk(tree)
    return found


def resolve_from(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The module a ``from ... import`` reads from, made absolute (``from . import x`` in
    ``swarm.node`` reads from ``swarm``; in ``swarm/tables/__init__.py`` from ``swarm.tables``)."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
    return ".".join(base + ([node.module] if node.module else []))


def imported_modules(tree: ast.AST, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``module`` imports at run time, resolved exactly:
    ``from pkg import sub`` is ``pkg.sub`` when that is a module, else ``pkg`` (a name it defines);
    ``import a.b.c`` is the longest known prefix of ``a.b.c``. Importing ``a.b.c`` also runs the
    ``__init__`` of ``a`` and ``a.b``: those count too, except the packages ``module`` is itself in
    (they are imported before it, so a package's ``__init__`` may import its submodules)."""
    own_packages = {module.rsplit(".", k)[0] for k in range(1, module.count(".") + 1)}
    out: set[str] = set()
    for node in runtime_imports(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            source = resolve_from(node, module, is_package)
            targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source
                       for alias in node.names]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if not target:
                continue
            out.add(target)  # what it names, even a package of its own (``from . import name``)
            parent = target.rpartition(".")[0]
            while parent:  # the packages that importing it initializes first
                if parent in known and parent not in own_packages:
                    out.add(parent)
                parent = parent.rpartition(".")[0]
    out.discard(module)
    return out


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """module -> the modules (among ``sources``) it imports; ``sources``: name -> (source, is_package)."""
    known = set(sources)
    return {name: imported_modules(ast.parse(src), name, is_pkg, known) for name, (src, is_pkg) in sources.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


# ---------------------------------------------------------------------------------------------
# private access


@dataclass(frozen=True)
class Violation:
    file: str
    line: int
    expr: str
    why: str = ""

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.expr}" + (f"  ({self.why})" if self.why else "")


def _is_self(node: ast.expr) -> bool:
    """``self``, ``cls`` or ``super()``."""
    return (isinstance(node, ast.Name) and node.id in ("self", "cls")) or (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super")


def owned_privates(tree: ast.Module) -> set[str]:
    """The private attribute names a file defines itself: what its classes define in their bodies
    (methods, nested classes, class attributes, dataclass fields) and the attributes it assigns on
    ``self``/``cls``. (Attributes it assigns on other objects are ``tagged_privates``; its
    module-level names are used bare, never as an attribute of something else.)"""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for stmt in node.body:
                if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(stmt.name)
                elif isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                    for target in stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]:
                        names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _is_self(node.value):
            names.add(node.attr)
    return {n for n in names if is_private(n)}


def tagged_privates(tree: ast.Module) -> set[str]:
    """Private attributes a file assigns on objects other than ``self``/``cls`` (``fn._cache = {}``):
    its own only where no other file owns that name (else it is writing into another's private)."""
    return {n.attr for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and not _is_self(n.value)
            and is_private(n.attr)}


def module_aliases(tree: ast.Module) -> set[str]:
    """Names bound by ``import x`` / ``import x.y`` / ``import x as y`` anywhere in the file."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.asname or a.name.split(".")[0] for a in node.names)
    return names


def _allowed_stdlib(obj: ast.expr, name: str) -> bool:
    target = ast.unparse(obj)
    return (target, name) in STDLIB_PRIVATES or (None, name) in STDLIB_PRIVATES


def _attribute_uses(tree: ast.Module):
    """(line, object, name, expression) for each ``obj.name`` and each attribute function call
    with a literal name (``getattr(obj, "name")``, ``monkeypatch.setattr(obj, "name", v)``)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            yield node.lineno, node.value, node.attr, ast.unparse(node)
        elif isinstance(node, ast.Call) and len(node.args) >= 2:
            func = node.func
            by_name = isinstance(func, ast.Name) and func.id in _ATTR_FUNCS
            patched = isinstance(func, ast.Attribute) and func.attr in ("setattr", "delattr")
            name = node.args[1]
            if (by_name or patched) and isinstance(name, ast.Constant) and isinstance(name.value, str):
                yield node.lineno, node.args[0], name.value, ast.unparse(node)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("setattr", "delattr") and node.args
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            # monkeypatch.setattr("pkg.mod.name", value): a dotted target
            for part in node.args[0].value.split("."):
                if is_private(part):
                    yield node.lineno, None, part, ast.unparse(node)
                    break


def _imports_of_privates(tree: ast.Module, path: str) -> list[Violation]:
    """``from X import _name`` and imports of a private module (``import a._b``, ``from a._b import c``)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if is_private(alias.name):
                    found.append(Violation(path, node.lineno, f"from {'.' * node.level}{node.module or ''} "
                                                              f"import {alias.name}", "another module's private"))
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            dotted = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if any(is_private(part) for name in dotted for part in name.split(".")):
                found.append(Violation(path, node.lineno, ast.unparse(node), "a private module"))
    return found


def private_violations(files: dict[str, str]) -> list[Violation]:
    """Every access to another module's private in ``files`` (relative path -> source): the rules
    of the module docstring. A private a file owns (``owned_privates``, or ``tagged_privates``
    that no other file owns) may be used on any object in that file, except on an imported module;
    on ``self``/``cls``/``super()`` only an owned one may (one a mixin or a base class in another
    file defines is that file's private)."""
    trees = {path: ast.parse(src, path) for path, src in files.items()}
    owned = {path: owned_privates(tree) for path, tree in trees.items()}
    found: list[Violation] = []
    for path, tree in trees.items():
        others = set().union(*(names for p, names in owned.items() if p != path))
        own = owned[path] | (tagged_privates(tree) - others)
        modules = module_aliases(tree)
        found += _imports_of_privates(tree, path)
        for line, obj, name, expr in _attribute_uses(tree):
            if not is_private(name):
                continue
            if obj is None:
                found.append(Violation(path, line, expr, "a private in a dotted name"))
            elif _allowed_stdlib(obj, name):
                continue
            elif isinstance(obj, ast.Name) and obj.id in modules:
                found.append(Violation(path, line, expr, f"a private of module {obj.id}"))
            elif _is_self(obj):
                if name not in owned[path]:
                    found.append(Violation(path, line, expr, "defined in another file (a base class or mixin)"))
            elif name not in own:
                found.append(Violation(path, line, expr, "another module's private"))
    return sorted(set(found), key=lambda v: (v.file, v.line, v.expr))
