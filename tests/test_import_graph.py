"""The package's shape, read from the AST: no import cycles, between modules or between the
stage folders, lazy imports inside functions included; and each folder holds what its name says.

Modules are nodes; `import asyncrl.a.b` and `from asyncrl.a import b` (b a module) are edges to
`asyncrl.a.b`, `from asyncrl.a.b import name` an edge to `asyncrl.a.b`. Imports under
`if TYPE_CHECKING:` count too: a type-only cycle is still a cycle in the reader's head.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "asyncrl"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(path: Path, name: str, known: set[str]) -> set[str]:
    """Every asyncrl module `path` imports, wherever the import statement sits."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "asyncrl")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            if base.split(".")[0] != "asyncrl":
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else base)
    return {m for m in found if m in known and m != name}


def module_graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(path, name, known) for name, path in mods.items()}


def stage(module: str) -> str:
    """The top-level folder (or top-level module) a module belongs to."""
    parts = module.split(".")
    return ".".join(parts[:2])


def stage_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = defaultdict(set)
    for src, dsts in graph.items():
        out[stage(src)].update(stage(d) for d in dsts if stage(d) != stage(src))
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path [a, b, ..., a], or None (iterative DFS, colours)."""
    colour: dict[str, int] = {}
    for root in sorted(graph):
        if colour.get(root):
            continue
        stack = [(root, iter(sorted(graph.get(root, ()))))]
        path, colour[root] = [root], 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                colour[node] = 2
                stack.pop()
                path.pop()
            elif colour.get(child) == 1:
                return path[path.index(child) :] + [child]
            elif not colour.get(child):
                colour[child] = 1
                path.append(child)
                stack.append((child, iter(sorted(graph.get(child, ())))))
    return None


def test_the_checker_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    graph = module_graph()
    assert "asyncrl.engine.client" in graph["asyncrl.engine.fleet"]  # edges are really read
    assert "asyncrl.rollout.multiturn" in graph["asyncrl.rollout.worker"]


def test_no_import_cycle_between_modules():
    cycle = find_cycle(module_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_import_cycle_between_stage_folders():
    cycle = find_cycle(stage_graph(module_graph()))
    assert cycle is None, "import cycle between folders: " + " -> ".join(cycle or [])


def test_lower_layers_stay_below():
    """What must not reach up: pure algorithms, wire types and the replay queue import neither
    Ray nor the stages above them; the weight sender does not know the engine client (it
    selects the learner's device through `asyncrl.device`, itself a leaf)."""
    graph = stage_graph(module_graph())
    allowed_below = {
        "asyncrl.algo": set(),
        "asyncrl.types": set(),
        "asyncrl.net": {"asyncrl.reaper"},  # a local Ray's watchdog, itself a leaf
        "asyncrl.reaper": set(),
        "asyncrl.device": set(),
        "asyncrl.replay": {"asyncrl.types", "asyncrl.transport"},
        "asyncrl.transport": {"asyncrl.types"},
        "asyncrl.weights": {"asyncrl.net", "asyncrl.device"},
    }
    for folder, allowed in allowed_below.items():
        assert graph.get(folder, set()) <= allowed, f"{folder} imports {graph[folder] - allowed}"


def test_rollout_holds_only_rollout_workers():
    names = {p.stem for p in (PACKAGE / "rollout").glob("*.py")}
    assert not {n for n in names if n.startswith(("hf_", "sglang", "client", "engine", "cluster"))}
    assert not any((PACKAGE / "learner").glob("megatron_*.py"))
