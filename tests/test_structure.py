"""The architecture, read from the source: layers import downwards only, and nothing loops.

The import graph is built from refcoll's files with ``ast`` (nothing is imported or
run), so a cycle hidden behind a function-level import is found too.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "refcoll"

#: Each top-level part of refcoll and its layer; a module may import only its own
#: layer or lower ones (DESIGN.md: core <- transport <- algorithms <- calls <- {...} <- cli).
LAYERS = {
    "core": 0,
    "transport": 1,
    "algorithms": 2,
    "calls": 3,
    "compressors": 4,
    "verify": 4,
    "measure": 4,
    "baselines": 4,
    "train": 4,
    "reducer": 4,
    "reducer_buckets": 4,
    "overlap": 4,
    "torch": 4,
    "cli": 5,
    "__main__": 6,
    "": 6,  # refcoll/__init__.py: the public API, re-exports only
}

#: Third-party packages a function may import late: optional or heavy ones.
LATE_ALLOWED = {"mpi4py", "cupy", "matplotlib", "sklearn", "torch"}

#: Function-level imports of refcoll's own modules the whole package may have.
MAX_INNER = 10

MAX_LINES = 500


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


def _layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS[parts[1] if len(parts) > 1 else ""]


def test_the_layers_import_downwards_only():
    upward = [f"{a} (layer {_layer(a)}) imports {b} (layer {_layer(b)})"
              for a, targets in EDGES.items() for b in targets if _layer(b) > _layer(a)]
    assert not upward, "\n".join(upward)


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
def test_no_file_is_over_the_limit(module):
    lines = MODULES[module].read_text().count("\n") + 1
    assert lines <= MAX_LINES, f"{MODULES[module]} has {lines} lines"


def test_algorithm_names_are_compared_only_in_their_own_modules():
    """A fact about one algorithm or compressor lives in its module (its registry record)."""
    from refcoll import REGISTRY
    from refcoll.compressors import COMPRESSORS

    # "none" is also the word for no baseline (bench --against none): not a compressor's fact.
    names = (set(REGISTRY) | set(COMPRESSORS)) - {"none"}
    found = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(
                    isinstance(o, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for o in node.ops):
                for side in [node.left, *node.comparators]:
                    if (isinstance(side, ast.Constant) and side.value in names
                            and side.value not in path.stem):
                        found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} "
                                     f"compares with {side.value!r}")
    assert not found, "\n".join(found)
