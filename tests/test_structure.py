"""The architecture, read from the source: layers import downwards only, and nothing loops.

The import graph is built from refcoll's files with ``ast`` (nothing is imported or
run), so a cycle hidden behind a function-level import is found too.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "refcoll"

#: Each top-level part of refcoll and its layer; a module may import only its own
#: layer or lower ones (DESIGN.md: core <- transport <- algorithms <- calls <- verify, the
#: reference; then the tools, then cli).
LAYERS = {
    "core": 0,
    "transport": 1,
    "algorithms": 2,
    "calls": 3,
    "verify": 4,
    # the tools around the reference: each imports the reference, never the other way
    "compressors": 5,
    "cluster": 5,
    "training": 5,
    "bench": 5,
    "model": 5,
    "baselines": 5,
    "torch": 5,
    "cli": 6,
    "__main__": 7,
    "": 7,  # refcoll/__init__.py: the public API, re-exports only
}

#: The reference (DESIGN.md's Layout) and the tools around it, by top-level part: the
#: tools import the reference, never the other way.
REFERENCE = {"core", "transport", "algorithms", "calls", "verify"}
TOOLS = {"compressors", "training", "bench", "model", "baselines", "cluster", "torch", "cli"}

#: Third-party packages a function may import late: optional or heavy ones (ml_dtypes:
#: half a second to load, so core/ops.py imports it when one of its types is first needed).
LATE_ALLOWED = {"mpi4py", "cupy", "matplotlib", "sklearn", "torch", "ml_dtypes"}

#: Function-level imports of refcoll's own modules the whole package may have.
MAX_INNER = 10

#: Not a cap to split files at (modules are split by idea, whatever their size): a file
#: past this many lines almost surely holds more than one idea, so it asks for a look.
LINES_THAT_ASK_FOR_A_LOOK = 1000


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _targets(module: str, path: Path, node) -> list[str]:
    """Return the refcoll modules an import statement names (module or package)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        if node.level:
            base = base[: len(base) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        names = [f"{target}.{a.name}" if f"{target}.{a.name}" in MODULES else target
                 for a in node.names]
    out = []
    for name in names:
        while name and name not in MODULES and "." in name:
            name = name.rsplit(".", 1)[0]
        if name in MODULES and name != module:
            out.append(name)
    return out


def _graph():
    edges, inner, late_third_party = {}, [], []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        edges[module] = set()
        for func in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef,
                                                                 ast.AsyncFunctionDef))]:
            for node in ast.walk(func):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    internal = _targets(module, path, node)
                    if internal:
                        inner.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
                    elif isinstance(node, ast.ImportFrom) and node.level == 0 or \
                            isinstance(node, ast.Import):
                        top = (node.module if isinstance(node, ast.ImportFrom)
                               else node.names[0].name).split(".")[0]
                        if top not in LATE_ALLOWED:
                            late_third_party.append(
                                f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {top}")
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges[module].update(_targets(module, path, node))
    return edges, inner, late_third_party


EDGES, INNER, LATE = _graph()


def _part(module: str) -> str:
    """Return the top-level part of refcoll a module is in (``""``: refcoll/__init__.py)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _layer(module: str) -> int:
    return LAYERS[_part(module)]


def test_the_layers_import_downwards_only():
    upward = [f"{a} (layer {_layer(a)}) imports {b} (layer {_layer(b)})"
              for a, targets in EDGES.items() for b in targets if _layer(b) > _layer(a)]
    assert not upward, "\n".join(upward)


def test_the_reference_imports_none_of_the_tools():
    """Every import, module- or function-level, from the reference to a tool is a defect."""
    unsorted = sorted(set(LAYERS) - REFERENCE - TOOLS - {"", "__main__"})
    assert not unsorted, f"parts of refcoll neither reference nor tool: {unsorted}"
    found = sorted(f"{a} imports {b}" for a, targets in EDGES.items() for b in targets
                   if _part(a) in REFERENCE and _part(b) in TOOLS)
    assert not found, "the reference imports the tools:\n" + "\n".join(found)


def test_there_is_no_import_cycle():
    state, stack, cycles = {}, [], []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(EDGES[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(EDGES):
        if node not in state:
            visit(node)
    assert not cycles, "\n".join(cycles)


def test_function_level_imports_are_few_and_only_of_optional_packages():
    assert len(INNER) <= MAX_INNER, "function-level imports of refcoll modules:\n" + \
        "\n".join(INNER)
    assert not LATE, "late imports of packages that are neither optional nor heavy:\n" + \
        "\n".join(LATE)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_each_module_says_the_one_idea_it_holds(module):
    """One idea per module: its docstring names it in one line, and it is not sprawling."""
    path = MODULES[module]
    doc = ast.get_docstring(ast.parse(path.read_text()))
    assert doc, f"{path}: no module docstring saying what idea it holds"
    first = doc.splitlines()[0]
    assert first.strip() and len(first) <= 100 and first.rstrip()[-1] in ".:", \
        f"{path}: its docstring's first line should say its idea in one sentence: {first!r}"
    lines = path.read_text().count("\n") + 1
    assert lines <= LINES_THAT_ASK_FOR_A_LOOK, \
        f"{path} has {lines} lines: look for two ideas in one file"


def test_algorithm_names_are_compared_only_in_their_own_modules():
    """A fact about one algorithm or compressor lives in its module (its registry record)."""
    from refcoll import REGISTRY
    from refcoll.compressors import COMPRESSORS

    # "none" is also the word for no baseline (bench --against none): not a compressor's fact.
    names = (set(REGISTRY) | set(COMPRESSORS)) - {"none"}
    found = []
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(
                    isinstance(o, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for o in node.ops):
                for side in [node.left, *node.comparators]:
                    if (isinstance(side, ast.Constant) and side.value in names
                            and side.value not in path.stem):
                        found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} "
                                     f"compares with {side.value!r}")
    assert not found, "\n".join(found)


def _path_to_the_algorithm(algorithm: str, p: int = 2) -> list[list[str]]:
    """Return, per rank, the refcoll files on the stack when the algorithm's function is entered.

    From the public ``refcoll.allreduce`` down: the call path a reader follows.
    """
    import sys
    import threading

    import numpy as np

    import refcoll
    from refcoll import algorithms
    from refcoll.calls.auto import resolve

    paths: dict[int, list[str]] = {}
    targets: set = set()

    def profile(frame, event, arg):
        if event != "call" or frame.f_code not in targets:
            return
        files, at = [], frame
        while at is not None:
            name = at.f_code.co_filename
            if "/refcoll/" in name:
                files.append(str(Path(name).relative_to(PACKAGE.parent)))
            at = at.f_back
        files.reverse()
        start = next(i for i, f in enumerate(files) if f.endswith("calls/collectives.py"))
        paths.setdefault(threading.get_ident(), files[start:])  # from the public call down

    def body(t):
        name = resolve(t, "allreduce", 10, 4) if algorithm == "auto" else algorithm
        targets.add(algorithms.implementation(name, "allreduce").__code__)
        sys.setprofile(profile)
        try:
            refcoll.allreduce(np.arange(10, dtype=np.float32), t, algorithm=algorithm)
        finally:
            sys.setprofile(None)

    refcoll.SimWorld(p).run(body)
    return list(paths.values())


@pytest.mark.parametrize("algorithm", ["ring", "auto", "rabenseifner", "tree"])
def test_a_reader_reaches_the_algorithm_through_three_files_never_coming_back(algorithm):
    """DESIGN.md: check, agree, choose, run, in at most three files, none left and re-entered."""
    paths = _path_to_the_algorithm(algorithm)
    assert len(paths) == 2  # every rank reached the algorithm
    for path in paths:
        collapsed = [f for i, f in enumerate(path) if i == 0 or f != path[i - 1]]
        assert collapsed[0] == "refcoll/calls/collectives.py", path
        assert len(collapsed) <= 3, " -> ".join(collapsed)
        assert len(set(collapsed)) == len(collapsed), " -> ".join(collapsed)  # none re-entered


def test_no_call_path_keys_a_cache_by_a_buffers_identity():
    """The fast paths are objects found by name (plans), not caches keyed by ``id(buffer)``."""
    found = []
    for module, path in MODULES.items():
        if not module.startswith("refcoll.calls"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id == "id"):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert set(found) <= {f"refcoll/calls/plans.py:{line}" for line in _LIVE_PLAN_LINES}, found


#: ``id(plan)`` keys the table of live plans (renewed after a failed agreement): a plan's
#: identity, never a buffer's. Read from the source, so a new ``id(...)`` elsewhere fails.
_LIVE_PLAN_LINES = [n.lineno for n in ast.walk(ast.parse((PACKAGE / "calls" / "plans.py")
                                                         .read_text()))
                    if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                    and n.func.id == "id" and isinstance(n.args[0], ast.Name)
                    and n.args[0].id == "self"]
