"""Layers point down only (STYLE.md; docs/ARCHITECTURE.md, "Processes and packages").

Every module of every package (common, prefill_node, decode_node, proxy, pdserve) is read with
``ast`` and every import it makes is checked: at module level, inside functions (lazy), under
``if TYPE_CHECKING:`` (type-only), and the names a module hands to ``importlib.import_module``
or ``__import__`` (dynamic: every string in such a module that names one of our modules).

* The layer rules count every kind. A type-only import of an upper layer is a dependency on
  it all the same: the module cannot be read, checked or moved without that layer. A lower
  layer's types are allowed anyway, so no exemption is needed for them.
* Import cycles count what runs: module-level, lazy and dynamic imports may form no cycle
  at all. A type-only import never runs; it may close a circle between two modules of the same
  package only (two classes that name each other's types), never across packages.

A failure names the importing file, its line and the module it may not import.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("common", "prefill_node", "decode_node", "proxy", "pdserve")
ROLES = ("prefill_node", "decode_node", "proxy")
CLUSTER = ("zmq", "common.kv_transfer", "common.registry_client", "common.proxy_heartbeats", "common.cluster_auth",
           "common.config")
ABOVE_THE_ENGINE = ("common.serving", "common.node", *ROLES, "pdserve")

# (the importing layer, what it may not import, why): a module is in a layer when its name is the
# layer's or starts with it and a dot; so is an imported module in a forbidden one.
RULES: list[tuple[str, tuple[str, ...], str]] = [
    ("common.model", ("common.engine", *CLUSTER, *ABOVE_THE_ENGINE),
     "the model is the bottom layer: nothing of the engine, the cluster or above"),
    ("common.engine", (*CLUSTER, *ABOVE_THE_ENGINE),
     ("the engine imports nothing of the cluster (ZMQ, KV transfer, registry, cluster key, node config); "
      "the KV transfer plugs in through the connector and tp_worker.RankExtension")),
    ("common.serving", ("zmq", "common.kv_transfer", "common.registry_client", "common.node", *ROLES, "pdserve"),
     "the OpenAI serving layer moves no KV and speaks no ZMQ; nodes are built above it (common/node)"),
    ("common.kv_transfer", ("common.serving", "common.node", "common.config", "common.registry_client", *ROLES,
                            "pdserve"),
     "the KV transfer is a library the daemons wire (common/node/daemon.py): no HTTP, node config or registry"),
    ("common", (*ROLES, "pdserve"), "common/ holds the libraries the processes share"),
    ("prefill_node", ("decode_node", "proxy", "pdserve"), "a role imports no other role nor the command line"),
    ("decode_node", ("prefill_node", "proxy", "pdserve"), "a role imports no other role nor the command line"),
    ("proxy", ("prefill_node", "decode_node", "pdserve"), "a role imports no other role nor the command line"),
]
# layers that load no ZMQ (nor anything else their rule forbids), through anything they import at run time
ZMQ_FREE_LAYERS = ("common.model", "common.engine", "common.serving")
RUNS = ("module", "lazy", "dynamic")  # the kinds of import that run


@dataclass(frozen=True)
class Import:
    importer: str  # module name
    path: Path
    line: int
    module: str  # the imported module (``from a import b``: ``a.b`` if that is a module, else ``a``)
    kind: str  # "module", "lazy", "typing" or "dynamic"

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def in_layer(module: str, layer: str) -> bool:
    return module == layer or module.startswith(layer + ".")


def our_modules() -> dict[str, Path]:
    """Every module of the packages, by name."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _calls_import_module(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in ("import_module", "__import__"):
                return True
    return False


def imports_of(source: str, name: str, path: Path, is_package: bool, known: set[str]) -> list[Import]:
    """Every import in ``source`` (module ``name``), with its kind; relative imports resolved."""
    tree = ast.parse(source, filename=str(path))
    found: list[Import] = []
    package = name if is_package else name.rpartition(".")[0]

    def add(line: int, module: str, kind: str) -> None:
        found.append(Import(name, path, line, module, kind))

    def visit(node: ast.AST, kind: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    visit_stmt(stmt, "typing")
                for stmt in child.orelse:
                    visit_stmt(stmt, kind)
                continue
            visit_stmt(child, kind)

    def visit_stmt(node: ast.AST, kind: str) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(node.lineno, alias.name, kind)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                add(node.lineno, sub if sub in known else base, kind)
        inner = "lazy" if kind == "module" and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) \
            else kind
        visit(node, inner)

    visit(tree, "module")
    if _calls_import_module(tree):
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in known:
                add(node.lineno, node.value, "dynamic")
    return found


def all_imports() -> list[Import]:
    modules = our_modules()
    known = set(modules)
    found = []
    for name, path in modules.items():
        found += imports_of(path.read_text(), name, path, path.name == "__init__.py", known)
    return found


IMPORTS = all_imports()
MODULES = our_modules()


# ---- the walk itself ---------------------------------------------------------------------------
def test_the_walk_sees_every_kind_of_import() -> None:
    source = '''
from typing import TYPE_CHECKING
import zmq
from . import sibling
from ..engine import scheduler
if TYPE_CHECKING:
    from common.kv_transfer.endpoint import KVEndpoint
else:
    import json
class A:
    import msgpack
    def f(self):
        from common.config import NodeConfig
        lambda: __import__("common.serving.app")
'''
    known = {"common.model.sibling", "common.engine.scheduler", "common.serving.app"}
    got = {(i.module, i.kind) for i in imports_of(source, "common.model.x", ROOT / "x.py", False, known)}
    assert got == {("typing", "module"), ("zmq", "module"), ("common.model.sibling", "module"),
                   ("common.engine.scheduler", "module"), ("common.kv_transfer.endpoint", "typing"),
                   ("json", "module"), ("msgpack", "module"), ("common.config", "lazy"),
                   ("common.serving.app", "dynamic")}


def test_the_walk_reads_every_package() -> None:
    for package in PACKAGES:
        assert any(in_layer(m, package) for m in MODULES), package
    assert len(MODULES) > 100
    assert any(i.importer == "common.engine.llm_engine" and i.module == "common.engine.scheduler" for i in IMPORTS)


# ---- the layer rules ----------------------------------------------------------------------------
def test_layers_import_only_downward() -> None:
    offences = []
    for layer, forbidden, why in RULES:
        for imp in IMPORTS:
            if in_layer(imp.importer, layer):
                for bad in forbidden:
                    if in_layer(imp.module, bad):
                        offences.append(f"{imp.where()}: {imp.importer} imports {imp.module} ({imp.kind}); "
                                        f"{layer} may not import {bad}: {why}")
    assert not offences, "\n" + "\n".join(sorted(set(offences)))


def _between_ours(kinds: tuple[str, ...]) -> list[Import]:
    """The imports of these kinds from one of our modules to another."""
    return [i for i in IMPORTS if i.kind in kinds and i.module in MODULES and i.module != i.importer]


def _by_importer(imports: list[Import]) -> dict[str, list[Import]]:
    found: dict[str, list[Import]] = defaultdict(list)
    for imp in imports:
        found[imp.importer].append(imp)
    return found


def test_model_engine_and_serving_reach_no_zmq() -> None:
    """Nothing the model, the engine or the serving layer imports at run time, however far down,
    imports ZMQ: the shortest chain to each ZMQ import is shown."""
    graph = _by_importer(_between_ours(RUNS))
    zmq_imports = _by_importer([i for i in IMPORTS if i.kind in RUNS and in_layer(i.module, "zmq")])
    offences = []
    for start in (m for m in MODULES if any(in_layer(m, layer) for layer in ZMQ_FREE_LAYERS)):
        chain: dict[str, list[Import]] = {start: []}
        todo = [start]
        while todo:
            module = todo.pop(0)
            for imp in zmq_imports[module]:
                steps = " -> ".join(f"{i.module} ({i.where()})" for i in chain[module])
                offences.append(f"{start} -> {steps or '(itself)'}: {imp.where()} imports {imp.module}")
            for imp in graph[module]:
                if imp.module not in chain:
                    chain[imp.module] = chain[module] + [imp]
                    todo.append(imp.module)
    assert not offences, "\n" + "\n".join(sorted(set(offences)))


def test_model_engine_and_serving_load_nothing_they_may_not_import() -> None:
    """The same, as Python sees it: importing every module of a layer in a fresh interpreter loads
    none of the modules its rule forbids (so an import the walk cannot read does not slip by)."""
    for layer in ZMQ_FREE_LAYERS:
        forbidden = next(bads for name, bads, _ in RULES if name == layer)
        code = ("import importlib, pkgutil, sys\n"
                f"package = importlib.import_module({layer!r})\n"
                f"for info in pkgutil.walk_packages(package.__path__, {layer + '.'!r}):\n"
                "    importlib.import_module(info.name)\n"
                f"print(sorted(m for m in sys.modules if any(m == b or m.startswith(b + '.') for b in {forbidden!r})))")
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                             check=False)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "[]", f"importing every module of {layer} loads {out.stdout.strip()}"


# ---- cycles ---------------------------------------------------------------------------------------
def _cycles(imports: list[Import]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for imp in imports:
        graph[imp.importer].add(imp.module)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _describe(component: list[str], imports: list[Import]) -> str:
    inside = set(component)
    edges = sorted({f"  {i.where()}: {i.importer} -> {i.module} ({i.kind})" for i in imports
                    if i.importer in inside and i.module in inside})
    return "circle of " + ", ".join(component) + ":\n" + "\n".join(edges)


def test_no_import_cycle() -> None:
    """No module reaches itself through imports that run (module level, lazy or dynamic)."""
    runtime = _between_ours(RUNS)
    cycles = _cycles(runtime)
    assert not cycles, "\n" + "\n".join(_describe(c, runtime) for c in cycles)


def test_type_only_circles_stay_inside_one_package() -> None:
    """With type-only imports counted too, a circle may only join modules of one package."""
    every = _between_ours((*RUNS, "typing"))
    across = [c for c in _cycles(every) if len({MODULES[m].parent for m in c}) > 1]
    assert not across, "\n" + "\n".join(_describe(c, every) for c in across)
