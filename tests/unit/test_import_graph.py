"""The import graph of shm, ipu_emulator, host_runtime and tools: layers, privacy, cycles.

Read from the source with ``ast`` (nothing is imported). What counts as an edge:

- every ``import`` and ``from ... import`` statement, wherever it is: at module level,
  inside a function (a function-local import that dodges a cycle *is* that cycle), and
  under ``if TYPE_CHECKING:``. TYPE_CHECKING imports do not run, but they count in every
  check: a type-level cycle still means that neither module can be read, changed or
  tested without the other, and a private name imported "only for a type" still ties the
  importer to another package's internals. ``importlib.import_module("literal")`` counts
  too;
- ``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to
  ``pkg``; relative imports are resolved;
- an edge goes to the module named, not to the packages Python initialises on the way
  (``host_runtime/runner/__init__.py`` re-exports its modules: counting those would make
  every package one cycle with its own modules).

The checks, each with a short list of today's exceptions in files of other owners. Every
entry says who must remove it; an entry that no longer matches anything fails the test, so
the lists only shrink:

(a) layers: shm imports nothing of ours; ipu_emulator imports shm and itself; host_runtime
    imports shm, ipu_emulator and itself; tools imports anything;
(b) no private module or private name crosses a top-level package: a module of one package
    importing ``_x`` (a module or a name) of another -> ALLOWED_PRIVATE;
(c) no cycles: no strongly connected component of more than one module -> KNOWN_CYCLES
    (an actual component must lie inside a known one);
(d) no private state read across modules: an attribute ``x._name`` (read, written or
    deleted; also ``getattr(x, "_name")`` and its kin) is fine only where ``_name`` is
    defined by a class of the same module: in the class body, in ``__slots__``, or as
    ``self._name``/``cls._name`` stored by a method. So ``self._x`` of a base class in
    another module, ``other._x`` of another module's object and ``lock._waiters`` of the
    standard library all fail; a module's own objects and helpers do not (by name: for an
    ``other._x``, some class of the module must define ``_x``). A ``Protocol``
    does not define names: a protocol listing private members is a private interface
    between modules, and the reads through it count. Likewise ``from stdlib import _x``.
    DOCUMENTED names the few documented APIs spelt with an underscore (``os._exit``);
    ALLOWED_PRIVATE_READS the cases of today, each with its count and who must remove it.

LAZY: the one kind of function-local import that may close a cycle: an import kept local so
that importing the module stays cheap (the imported module is heavy). It is left out of
the cycle check only if listed here with its reason; it must still be a function-local
import, and still be needed (without it the graph would have a cycle). Today no lazy import
closes a cycle: ``ModelRunner.metrics_collector`` imports ``host_runtime.runner.runner_metrics``
(and with it prometheus_client, ~60 ms) on first use, and that module types the runner by
a protocol instead of importing ``_model_runner``.

The synthetic-tree tests at the end show each check failing on a new violation.
"""

from __future__ import annotations

import ast
import functools
import pathlib
from dataclasses import dataclass
from typing import Iterable

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("shm", "ipu_emulator", "host_runtime", "tools")
LAYERS = {
    "shm": {"shm"},
    "ipu_emulator": {"shm", "ipu_emulator"},
    "host_runtime": {"shm", "ipu_emulator", "host_runtime"},
    "tools": set(PACKAGES),
}

# (file, private attribute) -> (how many accesses, who must remove them or why they stay)
ALLOWED_PRIVATE_READS: dict[tuple[str, str], tuple[int, str]] = {
    # the runner: a marker the monitor sets on a failed request's error and reads back
    ("host_runtime/runner/monitoring.py", "_ipu_monitored"): (2, "engine: set on and read "
                                                              "from an exception"),
    # other libraries' private state, read where no public name does the job
    ("host_runtime/runner/_submission.py", "_is_owned"):
        (1, "intr: RLock._is_owned (C), whether this thread holds the submit lock: an "
            "interrupt may come as acquire() returns, before a try can see it"),
    ("ipu_emulator/ipu/_execute.py", "_sess"):
        (1, "onnxruntime's C session: its public run_with_iobinding adds ~2 us of checks "
            "per run (WebGPU capture); falls back to it when the attribute is gone"),
    ("ipu_emulator/ipu/_execute.py", "_iobinding"):
        (1, "onnxruntime's C IO binding, with the C session above"),
    ("tools/_stress_host.py", "_run_exitfuncs"):
        (1, "atexit's: the stress fork scenario runs a normal exit's hooks in a child forked "
            "from a thread; Python has no public call for it, and such a child cannot exit "
            "the interpreter normally"),
    ("ipu_emulator/compiler/_shapes.py", "_preprocess"):
        (1, "onnxruntime's SymbolicShapeInference steps, run without its infer_shapes, which "
            "saves an incomplete result as sym_shape_infer_temp.onnx (and a .data file) in "
            "the working directory; skipped (shapes measured instead) when the steps are gone"),
    ("ipu_emulator/compiler/_shapes.py", "_infer_impl"): (1, "the same steps"),
    ("ipu_emulator/compiler/_shapes.py", "_update_output_from_vi"): (1, "the same steps"),
    ("tools/conformance.py", "_NodeTestCases"):
        (2, "onnx's node cases of one module: its public loader generates all of them "
            "(~6 s)"),
}

# (module or object name as written, attribute): documented public APIs spelt with "_"
DOCUMENTED: dict[tuple[str, str], str] = {
    ("os", "_exit"): "exit at once, without cleanup (a forked child, a killed IPU)",
}

# (importer, imported module or module.name) -> who must remove it
ALLOWED_PRIVATE: dict[tuple[str, str], str] = {
}

# strongly connected components allowed today -> who must break them
KNOWN_CYCLES: dict[frozenset[str], str] = {
}

# (importer, imported module) -> why it is imported lazily; see the module docstring
LAZY: dict[tuple[str, str], str] = {}


# --------------------------------------------------------------------------- the graph
@dataclass(frozen=True)
class Edge:
    source: str          # importing module
    target: str          # imported module
    name: str | None     # the name imported from it (None: the module itself)
    kind: str            # "module" (module level), "local" (in a function), "typing"
    line: int

    @property
    def imported(self) -> str:
        return self.target if self.name is None else f"{self.target}.{self.name}"


def _modules(root: pathlib.Path, packages: Iterable[str]) -> dict[str, pathlib.Path]:
    mods = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


class _Collector(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool, mods: dict[str, pathlib.Path]) -> None:
        self.module, self.is_package, self.mods = module, is_package, mods
        self.edges: list[Edge] = []
        self._typing = 0
        self._depth = 0      # functions we are in

    def _kind(self) -> str:
        return "typing" if self._typing else ("local" if self._depth else "module")

    def _add(self, target: str, name: str | None, line: int) -> None:
        self.edges.append(Edge(self.module, target, name, self._kind(), line))

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self._depth += 1
        self.generic_visit(node)
        self._depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            self._typing += 1
            for stmt in node.body:
                self.visit(stmt)
            self._typing -= 1
            for stmt in node.orelse:
                self.visit(stmt)
        else:
            self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, None, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.module.split(".")
            if not self.is_package:
                base.pop()
            base = base[:len(base) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        for alias in node.names:
            sub = f"{target}.{alias.name}"
            if sub in self.mods:
                self._add(sub, None, node.lineno)
            else:
                self._add(target, alias.name, node.lineno)

    def visit_Call(self, node: ast.Call) -> None:
        fn = node.func
        name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
        if name == "import_module" and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            self._add(node.args[0].value, None, node.lineno)
        self.generic_visit(node)


def import_graph(root: pathlib.Path = ROOT, packages: Iterable[str] = PACKAGES
                 ) -> tuple[set[str], list[Edge]]:
    """(our modules, every import edge between them)."""
    packages = tuple(packages)
    mods = _modules(root, packages)
    edges: list[Edge] = []
    for module, path in mods.items():
        c = _Collector(module, path.name == "__init__.py", mods)
        c.visit(ast.parse(path.read_text(), str(path)))
        edges += [e for e in c.edges if e.target.split(".")[0] in packages]
    return set(mods), edges


def _top(module: str) -> str:
    return module.split(".")[0]


def layer_violations(edges: Iterable[Edge], layers: dict[str, set[str]] = LAYERS
                     ) -> list[Edge]:
    return [e for e in edges if _top(e.target) not in layers[_top(e.source)]]


def private_crossings(edges: Iterable[Edge]) -> list[Edge]:
    """Edges into a private module or name from outside the package that owns it.

    A private module ``a.b._c`` belongs to package ``a.b``, and a private name of a module
    ``a.b.m`` to that module's package ``a.b``: only modules of ``a.b`` may import it. So concept packages (``host_runtime.session``,
    ``ipu_emulator.ipu`` ...) talk through the names their ``__init__`` (or a public
    module) exports, and no private name crosses a top-level package either."""
    def private(part: str) -> bool:
        return part.startswith("_") and not part.startswith("__")
    found = []
    for e in edges:
        parts = e.target.split(".")
        k = next((i for i in range(1, len(parts)) if private(parts[i])), None)
        if k is not None:                       # a private module: its package owns it
            owner = ".".join(parts[:k])
        elif e.name is not None and private(e.name):   # a private name: its module's package
            owner = e.target.rsplit(".", 1)[0] if "." in e.target else e.target
        else:
            continue
        if e.source != owner and not e.source.startswith(owner + "."):
            found.append(e)
    return found


def cycles(modules: set[str], edges: Iterable[Edge],
           excluded: Iterable[tuple[str, str]] = ()) -> list[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    skip = set(excluded)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for e in edges:
        if e.target in modules and e.source != e.target and (e.source, e.target) not in skip:
            graph[e.source].add(e.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(frozenset(comp))
    return found


def _show(edges: Iterable[Edge]) -> str:
    return "\n".join(f"  {e.source}:{e.line} imports {e.imported} ({e.kind})" for e in edges)


# --------------------------------------------------------------------------- private reads
@dataclass(frozen=True)
class PrivateRead:
    path: str        # relative to the root
    line: int
    expr: str        # the access as written: ``io._redirect``, ``getattr(x, '_y')``
    attr: str        # the private name

    def __str__(self) -> str:
        return f"  {self.path}:{self.line}: {self.expr} (attribute {self.attr})"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _is_protocol(cls: ast.ClassDef) -> bool:
    for base in cls.bases:
        if isinstance(base, ast.Subscript):
            base = base.value
        if (base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "")) \
                == "Protocol":
            return True
    return False


def _strings(node: ast.expr) -> list[str]:
    elts = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return [e.value for e in elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]


_ATTR_FUNCS = ("getattr", "setattr", "hasattr", "delattr")


class _Module:
    """One walk over a module: what each of its classes defines, and every access of a
    private attribute with the class it is written in.

    A class defines what its body defines or assigns, its ``__slots__``, and what its
    methods store on or delete from ``self``/``cls``; a Protocol defines nothing (a
    protocol listing private members is a private interface between modules)."""

    def __init__(self, tree: ast.Module, packages: tuple[str, ...]) -> None:
        self.defines: dict[int, set[str]] = {}      # id(class) -> names
        self.by_name: dict[str, ast.ClassDef] = {}
        # (node, the object's expression, attribute, enclosing class)
        self.accesses: list[tuple[ast.AST, ast.expr, str, ast.ClassDef | None]] = []
        self.imports: list[tuple[ast.ImportFrom, str]] = []   # (statement, private name)
        stack: list[tuple[ast.AST, ast.ClassDef | None]] = [(tree, None)]
        while stack:
            node, cls = stack.pop()
            if isinstance(node, ast.ClassDef):
                cls = node
                self.by_name[node.name] = node
                self.defines[id(node)] = set() if _is_protocol(node) else self._body(node)
            elif isinstance(node, ast.Attribute):
                if _private(node.attr):
                    self.accesses.append((node, node.value, node.attr, cls))
                if isinstance(node.ctx, (ast.Store, ast.Del)) and cls is not None \
                        and isinstance(node.value, ast.Name) \
                        and node.value.id in ("self", "cls") and not _is_protocol(cls):
                    self.defines[id(cls)].add(node.attr)
            elif isinstance(node, ast.Call):
                args = node.args
                if isinstance(node.func, ast.Name) and node.func.id in _ATTR_FUNCS \
                        and len(args) >= 2 and isinstance(args[1], ast.Constant) \
                        and isinstance(args[1].value, str) and _private(args[1].value):
                    self.accesses.append((node, args[0], args[1].value, cls))
            elif isinstance(node, ast.ImportFrom):
                # our own packages' imports are check (b)'s; this is other libraries'
                if not node.level and node.module \
                        and node.module.split(".")[0] not in packages:
                    dotted = any(_private(p) for p in node.module.split(".")[1:])
                    self.imports += [(node, a.name) for a in node.names
                                     if dotted or _private(a.name)]
            stack += [(child, cls) for child in ast.iter_child_nodes(node)]
        self.anywhere = set().union(*self.defines.values())
        self._inherited: dict[int, set[str]] = {}

    @staticmethod
    def _body(cls: ast.ClassDef) -> set[str]:
        names: set[str] = set()
        for stmt in cls.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(stmt.name)
            targets = stmt.targets if isinstance(stmt, ast.Assign) else \
                [stmt.target] if isinstance(stmt, ast.AnnAssign) else []
            for t in targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        names.add(n.id)
                        if n.id == "__slots__" and stmt.value is not None:
                            names.update(_strings(stmt.value))
        return names

    def inherited(self, cls: ast.ClassDef) -> set[str]:
        """What ``cls`` and its bases of this module define (not bases of other modules)."""
        if id(cls) not in self._inherited:
            names: set[str] = set()
            todo, seen = [cls], set()
            while todo:
                c = todo.pop()
                if id(c) in seen:
                    continue
                seen.add(id(c))
                names |= self.defines.get(id(c), set())
                for b in c.bases:
                    b = b.value if isinstance(b, ast.Subscript) else b   # Base[T]
                    if isinstance(b, ast.Name) and b.id in self.by_name:
                        todo.append(self.by_name[b.id])
            self._inherited[id(cls)] = names
        return self._inherited[id(cls)]

    def private_reads(self, path: str, documented: dict[tuple[str, str], str]
                      ) -> list[PrivateRead]:
        """``self._x``/``cls._x`` must be defined by the enclosing class or its bases of
        the module; any other ``obj._x`` by some class of the module."""
        found = [PrivateRead(path, node.lineno, ast.unparse(node), name)
                 for node, name in self.imports]
        for node, base, attr, cls in self.accesses:
            is_self = isinstance(base, ast.Name) and base.id in ("self", "cls")
            own = self.inherited(cls) if is_self and cls is not None else self.anywhere
            if attr in own or (isinstance(base, ast.Name) and (base.id, attr) in documented):
                continue
            found.append(PrivateRead(path, getattr(node, "lineno", 0), ast.unparse(node),
                                     attr))
        return found


def private_reads(root: pathlib.Path = ROOT, packages: Iterable[str] = PACKAGES,
                  documented: dict[tuple[str, str], str] = DOCUMENTED) -> list[PrivateRead]:
    """Every access of a private attribute that the module does not define (see (d))."""
    packages = tuple(packages)
    found: list[PrivateRead] = []
    for path in _modules(root, packages).values():
        module = _Module(ast.parse(path.read_text(), str(path)), packages)
        found += module.private_reads(path.relative_to(root).as_posix(), documented)
    return sorted(found, key=lambda r: (r.path, r.line, r.expr))


# --------------------------------------------------------------------------- the tree
# read once per test process, when a test first needs it (not at collection: every xdist
# worker collects this module)
@functools.cache
def _graph() -> tuple[set[str], list[Edge]]:
    return import_graph()


@functools.cache
def _private_reads() -> list[PrivateRead]:
    return private_reads()


def test_the_graph_is_read():
    modules, edges = _graph()
    assert {"shm.ring", "ipu_emulator.ipu.process", "host_runtime.runner._replica",
            "tools.cli"} <= modules
    kinds = {e.kind for e in edges}
    assert kinds == {"module", "local", "typing"}


def test_layers():
    _, edges = _graph()
    bad = layer_violations(edges)
    assert not bad, "imports against the layers (shm <- ipu_emulator <- host_runtime " \
        "<- tools):\n" + _show(bad)


def test_no_private_names_cross_packages():
    _, edges = _graph()
    found = private_crossings(edges)
    new = [e for e in found if (e.source, e.imported) not in ALLOWED_PRIVATE]
    assert not new, ("private modules or names imported across packages (export a public "
                     "name instead):\n" + _show(new))
    stale = set(ALLOWED_PRIVATE) - {(e.source, e.imported) for e in found}
    assert not stale, f"ALLOWED_PRIVATE entries that are fixed now; remove them: {sorted(stale)}"


def test_no_private_state_read_across_modules():
    found = _private_reads()
    new = [r for r in found if (r.path, r.attr) not in ALLOWED_PRIVATE_READS]
    assert not new, ("private attributes of another module's objects (or the standard "
                     "library's) read, written or imported; use or add a public name:\n"
                     + "\n".join(map(str, new)))
    counts = {k: sum((r.path, r.attr) == k for r in found) for k in ALLOWED_PRIVATE_READS}
    changed = {k: (counts[k], n) for k, (n, _who) in ALLOWED_PRIVATE_READS.items()
               if counts[k] != n}
    assert not changed, ("ALLOWED_PRIVATE_READS entries whose count changed (found, listed): "
                         "remove a new access; lower the count (or drop the entry) for a "
                         f"fixed one: {changed}")


def test_no_import_cycles():
    modules, edges = _graph()
    comps = cycles(modules, edges, LAZY)
    new = [c for c in comps if not any(c <= known for known in KNOWN_CYCLES)]
    detail = "\n".join(
        "  " + " <-> ".join(sorted(c)) + "\n" + _show(e for e in edges
                                              if e.source in c and e.target in c)
        for c in new)
    assert not new, "import cycles (function-local and TYPE_CHECKING imports count):\n" + detail
    stale = [sorted(k) for k in KNOWN_CYCLES if not any(c & k for c in comps)]
    assert not stale, f"KNOWN_CYCLES entries that are broken now; remove them: {stale}"


def test_lazy_imports_are_local_and_needed():
    modules, edges = _graph()
    for (source, target), why in LAZY.items():
        assert why
        kinds = {e.kind for e in edges if (e.source, e.target) == (source, target)}
        assert kinds == {"local"}, f"LAZY {source} -> {target}: expected only " \
            f"function-local imports, found {sorted(kinds) or 'none'}"
        others = {k: v for k, v in LAZY.items() if k != (source, target)}
        assert len(cycles(modules, edges, others)) > len(cycles(modules, edges, LAZY)), \
            f"LAZY {source} -> {target} closes no cycle: remove it from LAZY"


# --------------------------------------------------------------------------- the checks fail
def _tree(tmp_path: pathlib.Path, files: dict[str, str]) -> tuple[set[str], list[Edge]]:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return import_graph(tmp_path, ("shm", "ipu_emulator", "host_runtime", "tools"))


_BASE = {
    "shm/__init__.py": "", "shm/_core.py": "", "shm/ring.py": "from . import _core\n",
    "ipu_emulator/__init__.py": "", "ipu_emulator/ipu/__init__.py": "",
    "ipu_emulator/ipu/process.py": "from shm.ring import Ring\n",
    "host_runtime/__init__.py": "", "host_runtime/a.py": "", "host_runtime/b.py": "",
    "tools/__init__.py": "", "tools/cli.py": "import host_runtime.a\n",
}


def test_synthetic_clean_tree_passes(tmp_path):
    mods, edges = _tree(tmp_path, _BASE)
    assert ("shm.ring", "shm._core") in {(e.source, e.target) for e in edges}  # relative
    assert not layer_violations(edges) and not private_crossings(edges)
    assert not cycles(mods, edges)


def test_synthetic_layer_violation_fails(tmp_path):
    mods, edges = _tree(tmp_path, {**_BASE, "shm/ring.py": "def f():\n    import tools.cli\n"})
    assert [(e.source, e.target, e.kind) for e in layer_violations(edges)] == [
        ("shm.ring", "tools.cli", "local")]


def test_synthetic_private_crossing_fails(tmp_path):
    mods, edges = _tree(tmp_path, {
        **_BASE,
        "host_runtime/a.py": "from shm._core import fast\nfrom shm.ring import _helper\n"
                             "from typing import TYPE_CHECKING\n"
                             "if TYPE_CHECKING:\n    from ipu_emulator.ipu import process\n",
    })
    assert sorted(e.imported for e in private_crossings(edges)) == [
        "shm._core.fast", "shm.ring._helper"]


def test_synthetic_cycles_fail_through_local_and_typing_imports(tmp_path):
    mods, edges = _tree(tmp_path, {
        **_BASE,
        "host_runtime/a.py": "import host_runtime.b\n",
        "host_runtime/b.py": "def f():\n    from host_runtime import a\n",
    })
    assert cycles(mods, edges) == [frozenset({"host_runtime.a", "host_runtime.b"})]
    # listed as a lazy import, the local one is left out
    assert cycles(mods, edges, {("host_runtime.b", "host_runtime.a"): "heavy"}) == []
    mods, edges = _tree(tmp_path, {
        **_BASE,
        "host_runtime/a.py": "import host_runtime.b\n",
        "host_runtime/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                             "    from host_runtime.a import A\nelse:\n    A = None\n",
    })
    assert cycles(mods, edges) == [frozenset({"host_runtime.a", "host_runtime.b"})]
    assert {e.kind for e in edges if e.source == "host_runtime.b"} == {"typing"}


def test_synthetic_private_reads_fail(tmp_path):
    _tree(tmp_path, {
        **_BASE,
        "shm/ring.py": (
            "class Ring:\n"
            "    __slots__ = ('_slot',)\n"
            "    _depth = 4\n"
            "    def __init__(self):\n"
            "        self._n = 0\n"
            "    def _wake(self):\n"
            "        pass\n"),
        "host_runtime/a.py": (
            "import os, threading\n"
            "from typing import Protocol\n"
            "from threading import _shutdown\n"
            "from shm.ring import Ring\n"
            "class Core(Protocol):\n"
            "    def _activate(self) -> None: ...\n"
            "class Mine(Ring):\n"
            "    def __init__(self, other, core: Core):\n"
            "        self._own = 1\n"
            "        self._own += other._own        # a Mine of this module: fine\n"
            "        self._wake()                   # the base's, of shm.ring\n"
            "        core._activate()               # through a protocol\n"
            "        other._n = 2                   # written\n"
            "        threading.Condition()._waiters\n"
            "        getattr(other, '_depth')\n"
            "        os._exit(0)                    # documented\n"
            "class Sub(Mine):\n"
            "    def f(self):\n"
            "        return self._own               # its base of this module: fine\n"),
    })
    found = private_reads(tmp_path, ("shm", "ipu_emulator", "host_runtime", "tools"))
    assert [(r.path, r.line, r.expr, r.attr) for r in found] == [
        ("host_runtime/a.py", 3, "from threading import _shutdown", "_shutdown"),
        ("host_runtime/a.py", 11, "self._wake", "_wake"),
        ("host_runtime/a.py", 12, "core._activate", "_activate"),
        ("host_runtime/a.py", 13, "other._n", "_n"),
        ("host_runtime/a.py", 14, "threading.Condition()._waiters", "_waiters"),
        ("host_runtime/a.py", 15, "getattr(other, '_depth')", "_depth"),
    ]
    assert str(found[1]) == "  host_runtime/a.py:11: self._wake (attribute _wake)"
    # the module that defines them reads them freely
    assert not [r for r in found if r.path == "shm/ring.py"]
