"""The documentation's generated tables, from the code: one function per table.

Two kinds of pages use them:

* pages the site generates at build time (``gen_pages.py``): the algorithms,
  the environment variables, the errors, the commands;
* committed Markdown (README.md, docs/index.md), where a table sits between
  ``<!-- generated: NAME -->`` and ``<!-- end generated -->``, as the spec
  pages' blocks do. ``tests/test_docs.py`` fails when one is stale, and
  ``python docs/_scripts/blocks.py FILE...`` rewrites them.

Every link a table makes is relative to the page it goes on: ``root`` is the
path from that page to the repository root (``""`` for README.md) or, inside
the site, to the site's root (``"../"`` for reference/algorithms.md).
"""

from __future__ import annotations

import inspect
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: A generated block in committed Markdown: its name and options, then its body.
BLOCK = re.compile(r"(<!-- generated: (?P<name>[\w-]+)(?P<args>[^>]*?) -->\n)(?P<body>.*?)"
                   r"(<!-- end generated -->)", re.S)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def algorithms_table(root: str = "", vectors: bool = False) -> str:
    """Return the table of algorithms, from the registry: name, collectives, summary, spec page.

    ``vectors``: add how many golden vectors each has (``spec/vectors/manifest.json``).
    """
    from refcoll.algorithms import COLLECTIVES, REGISTRY

    counts: dict[str, int] = {}
    if vectors:
        manifest = json.loads((ROOT / "spec" / "vectors" / "manifest.json").read_text())
        for entry in manifest["vectors"]:
            counts[entry["algorithm"]] = counts.get(entry["algorithm"], 0) + 1
    head = ["algorithm", "collectives", "what it is", "spec"] + (["vectors"] if vectors else [])
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for algo in REGISTRY.values():
        colls = ("all five" if len(algo.collectives) == len(COLLECTIVES)
                 else ", ".join(algo.collectives))
        spec = f"[{algo.spec}]({root}{algo.spec})" if algo.spec else ""
        row = [f"`{algo.name}`", colls, _cell(algo.summary), spec]
        if vectors:
            row.append(str(counts.get(algo.name, 0)))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def environment_table(root: str = "") -> str:
    """Return the table of environment variables, from :mod:`refcoll.core.environment`."""
    from refcoll.core.environment import VARIABLES

    lines = ["| variable | unset | what it does | set by | read by |",
             "| --- | --- | --- | --- | --- |"]
    for v in VARIABLES:
        readers = ", ".join(f"`{r}`" for r in v.readers)
        lines.append(f"| `{v.name}` | {_cell(v.default)} | {_cell(v.effect)} | "
                     f"{_cell(v.set_by)} | {readers} |")
    return "\n".join(lines) + "\n"


def error_classes() -> list[type]:
    """Return refcoll's exception classes, in :mod:`refcoll.core.errors`' order."""
    from refcoll.core import errors

    return [cls for cls in (getattr(errors, name) for name in errors.__all__)
            if isinstance(cls, type)]


def errors_table(root: str = "") -> str:
    """Return the table of refcoll's exceptions, from :mod:`refcoll.core.errors`."""
    lines = ["| exception | is a | raised when |", "| --- | --- | --- |"]
    for cls in error_classes():
        bases = ", ".join(f"`{b.__name__}`" for b in cls.__bases__)
        doc = inspect.getdoc(cls) or ""
        lines.append(f"| [`refcoll.{cls.__name__}`]({root}reference/api/errors.md"
                     f"#refcoll.core.errors.{cls.__name__}) | {bases} | {_cell(doc)} |")
    return "\n".join(lines) + "\n"


def commands() -> dict:
    """Return the ``refcoll`` commands, ``{name: click.Command}``, in the order ``--help`` lists."""
    from refcoll.cli import all_commands

    return all_commands()


def commands_table(root: str = "") -> str:
    """Return the table of commands: each name linked to its reference page, its short help."""
    lines = ["| command | what it does |", "| --- | --- |"]
    for name, cmd in commands().items():
        lines.append(f"| [`refcoll {name}`]({root}reference/cli/{name}.md) | "
                     f"{_cell(cmd.get_short_help_str(limit=200))} |")
    return "\n".join(lines) + "\n"


GENERATORS = {
    "algorithms-table": algorithms_table,
    "environment-table": environment_table,
    "errors-table": errors_table,
    "commands-table": commands_table,
}


def _options(args: str) -> dict:
    out = {}
    for word in args.split():
        key, _, value = word.partition("=")
        out[key] = value if value else True
    return out


def render(name: str, args: str = "") -> str:
    """Return the body of the block ``<!-- generated: NAME ARGS -->``."""
    opts = _options(args)
    root = opts.pop("root", "")
    return GENERATORS[name](root="" if root is True else root, **opts)


def regenerate(text: str) -> str:
    """Return ``text`` with every generated block's body rendered afresh."""
    return BLOCK.sub(lambda m: m.group(1) + render(m["name"], m["args"]) + m.group(5), text)


def blocks(text: str) -> list[tuple[str, str, str]]:
    """Return each generated block of ``text`` as ``(name, args, body)``."""
    return [(m["name"], m["args"].strip(), m["body"]) for m in BLOCK.finditer(text)]


if __name__ == "__main__":
    for arg in sys.argv[1:] or ["README.md", "docs/index.md"]:
        path = Path(arg)
        old = path.read_text()
        new = regenerate(old)
        if new != old:
            path.write_text(new)
            print(f"rewrote {path}")
