"""The import rule of the package: no import circle between modules, and no import from a lower
layer to a higher one. docs/architecture.md opens with the same table.

Layers, lowest first; a module may import from its own layer and the layers below it:

0. ``ops``: plain-PyTorch references and Triton kernels. Knows no config, no model, no engine.
1. ``config``, ``sampling_params``, ``tokenizer``, ``chat``, ``outputs``, ``cpu_threads``,
   ``transfer``: values and leaf utilities (frozen configs, the request's sampling options, the
   tokenizer and chat template, vLLM's output shapes, the CPU thread policy, host-to-device copies
   through pinned memory, which the engine and the MTP proposer both make). Everything above reads them; they import
   nothing above.
2. ``ssm``: the Mamba state backends and ``layout.py``: state shapes from the model config, and the
   seam a Mamba2 mixer calls. Below ``layers`` because the mixer calls it, never the reverse.
3. ``layers``: mixers, norms, the step context the runner installs, and the tensor-parallel layers
   (``layers/tensor_parallel.py``: vocab-parallel embedding and head, the all-reduce hook).
4. ``models``: the model families, their registry, the loader and writer, and tensor-parallel
   sharding beside the models it cuts.
5. ``cache``: block and slot pools, the prefix-cache coordinator (it sees requests through a
   Protocol, not ``engine.Request``), and the bytes and sizes of the caches (which read a rank's
   model slice from ``models/sharding.py``).
6. ``speculative``: proposers and acceptance. The MTP proposer runs the target model; the draft
   proposer is handed an engine (a Protocol) that the composition root builds.
7. ``engine``: the step loop, scheduler, runner, sampler. Handed its runner and proposer; imports
   no process management and no proposer factory.
8. ``distributed``: process management of tensor parallelism (worker processes, rank 0's mirroring
   runner and the workers' runner, subclasses of the engine's runner).
9. ``build``: the composition root: options -> config -> caches -> runner -> proposer -> Engine.
10. ``llm`` and the package itself (``replayserve/__init__.py``): the offline API over the root.
11. ``server``, ``demo``, ``builtin``, ``tp_worker``, ``quantize``: programs and tools over the API
    and the root (the OpenAI server and its engine-core process, the demo, the built-in model's
    checks and training, a tensor-parallel worker's main, the FP8 quantizer).
12. ``cli``, ``__main__``: the command line, which reaches all of them.

Every import counts: at module level, inside functions and under ``TYPE_CHECKING``. Imports inside
functions remain only where they are lazy on purpose (Triton kernels, optional server packages,
keeping ``replayserve --help`` fast); they obey the same rule.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "replayserve"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("ops",),
    ("config", "sampling_params", "tokenizer", "chat", "outputs", "cpu_threads", "structured", "transfer"),
    ("ssm",),
    ("layers",),
    ("models",),
    ("cache",),
    ("speculative",),
    ("engine",),
    ("distributed",),
    ("build",),
    ("llm", ""),  # "": replayserve/__init__.py
    ("server", "demo", "builtin", "tp_worker", "quantize"),
    ("cli", "__main__"),
)


@dataclass(frozen=True)
class Edge:
    """`source` imports `target` (dotted module names) at `path`:`line`."""

    source: str
    target: str
    path: str
    line: int

    def __str__(self) -> str:
        return f"{self.source} -> {self.target} ({self.path}:{self.line})"


def modules(root: Path) -> dict[str, Path]:
    """Every module of the package at `root`, by dotted name (a package by its own name)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def import_edges(root: Path) -> list[Edge]:
    """Every import of one module of the package by another, wherever it stands in the file.
    `from pkg import name` imports the module `pkg.name` when there is one, else `pkg`."""
    known = modules(root)
    edges = []
    for source, path in known.items():
        package = source if path.name == "__init__.py" else source.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in node.names]
            else:
                continue
            for target in dict.fromkeys(targets):
                while target and target not in known and "." in target:  # `import pkg.mod.attr`
                    target = target.rpartition(".")[0]
                if target in known and target != source:
                    edges.append(Edge(source, target, str(path.relative_to(root.parent)), node.lineno))
    return edges


def layer_of(module: str, layers: tuple[tuple[str, ...], ...]) -> int | None:
    """The layer of the longest entry that names `module` or a package above it."""
    name = module.partition(".")[2]  # without the package's own name
    best: tuple[int, int] | None = None
    for rank, entries in enumerate(layers):
        for entry in entries:
            if name == entry or (entry and name.startswith(entry + ".")):
                if best is None or len(entry) > best[1]:
                    best = (rank, len(entry))
    return None if best is None else best[0]


def circles(edges: list[Edge]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.source, set()).add(e.target)
        graph.setdefault(e.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def rule_breaks(root: Path, layers: tuple[tuple[str, ...], ...]) -> list[str]:
    """What breaks the rule in the package at `root`: modules no layer names, upward imports (with
    their layers), and circles (with the imports that close them)."""
    edges = import_edges(root)
    problems = [f"{m}: in no layer; add it to LAYERS (and to docs/architecture.md)"
                for m in modules(root) if layer_of(m, layers) is None]
    for e in edges:
        low, high = layer_of(e.source, layers), layer_of(e.target, layers)
        if low is not None and high is not None and high > low:
            problems.append(f"upward import, layer {low} -> layer {high}: {e}")
    for component in circles(edges):
        inside = [str(e) for e in edges if e.source in component and e.target in component]
        problems.append(f"import circle between {component}:\n    " + "\n    ".join(inside))
    return problems


def test_the_package_keeps_the_import_rule() -> None:
    problems = rule_breaks(PACKAGE, LAYERS)
    assert not problems, "\n".join(problems)


def test_the_engine_is_handed_its_proposer() -> None:
    """The layers allow `engine/` to import `speculative/`, but the proposer is built by the
    composition root and handed to the engine: no module of `engine/` reaches for the factory."""
    reaching = [str(e) for e in import_edges(PACKAGE)
                if e.source.startswith("replayserve.engine.") and e.target == "replayserve.speculative.factory"]
    assert not reaching, reaching


def test_the_check_finds_circles_upward_imports_and_unplaced_modules(tmp_path: Path) -> None:
    """The checker itself, on a package made to break the rule in each way it knows."""
    pkg = tmp_path / "pkg"
    (pkg / "low").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "__init__.py").write_text("")
    (pkg / "low" / "a.py").write_text("def f():\n    from pkg.high import g\n")
    (pkg / "low" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import c\n")
    (pkg / "low" / "c.py").write_text("from pkg.low import b\n")
    (pkg / "high.py").write_text("import pkg.low.a\n")
    (pkg / "stray.py").write_text("")
    problems = rule_breaks(pkg, (("low",), ("high", "")))
    assert any(p.startswith("upward import, layer 0 -> layer 1: pkg.low.a -> pkg.high (pkg/low/a.py:2)")
               for p in problems), problems
    assert any(p.startswith("import circle between ['pkg.high', 'pkg.low.a']") for p in problems), problems
    assert any(p.startswith("import circle between ['pkg.low.b', 'pkg.low.c']") for p in problems), problems
    assert "pkg.stray: in no layer; add it to LAYERS (and to docs/architecture.md)" in problems
    assert len(problems) == 4, problems
