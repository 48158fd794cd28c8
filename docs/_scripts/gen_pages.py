"""Pages the site generates at build time (mkdocs-gen-files runs this script).

* ``spec/``: spec/'s pages, read from where they are (nothing is copied into
  docs/), with a nav that puts what every collective must do first, then the
  algorithms in the registry's order, then the other pages;
* ``reference/cli/``: a page per ``refcoll`` command, from its click command
  (mkdocs-click), and an index of them;
* ``reference/algorithms.md``, ``reference/environment.md``,
  ``reference/errors.md``: tables from the registry, :mod:`refcoll.core.environment`
  and :mod:`refcoll.core.errors` (``blocks.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import mkdocs_gen_files

sys.path.insert(0, str(Path(__file__).resolve().parent))
import blocks  # noqa: E402  (beside this script)

ROOT = blocks.ROOT
SPEC = ROOT / "spec"


def _title(path: Path) -> str:
    for line in path.read_text().splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return path.stem


def spec_pages() -> None:
    """Put spec/'s pages into the site under spec/, and their nav in spec/.nav.md."""
    from refcoll.algorithms import REGISTRY

    pages = sorted(SPEC.glob("*.md")) + sorted(SPEC.glob("*/README.md"))
    for path in pages:
        rel = path.relative_to(SPEC).as_posix()
        with mkdocs_gen_files.open(f"spec/{rel}", "w") as f:
            f.write(path.read_text())
        mkdocs_gen_files.set_edit_path(f"spec/{rel}", f"../spec/{rel}")
    by_algorithm = [Path(a.spec).name for a in REGISTRY.values()
                    if a.spec and Path(a.spec).name != "README.md"]
    first = ["README.md"] + list(dict.fromkeys(by_algorithm))
    rest = [p.relative_to(SPEC).as_posix() for p in pages
            if p.relative_to(SPEC).as_posix() not in first]
    with mkdocs_gen_files.open("spec/.nav.md", "w") as nav:
        for rel in first + rest:
            nav.write(f"* [{_title(SPEC / rel)}]({rel})\n")


def cli_pages() -> None:
    """Write reference/cli/: an index of the commands and one page per command."""
    cmds = blocks.commands()
    with mkdocs_gen_files.open("reference/cli/index.md", "w") as f:
        f.write("# Command line\n\n"
                "Every command is `refcoll NAME [OPTIONS]`; `refcoll NAME --help` prints the "
                "same as its page. Commands that need several processes take `-n N` and start "
                "`mpiexec` themselves; run under `mpiexec` already, they use the existing "
                "world. Every command that reports takes `--json FILE`.\n\n")
        f.write(blocks.commands_table(root="../../"))
        f.write("\nWhat each exit status means: [Errors and exit codes]"
                "(../errors.md#exit-codes-of-the-command-line).\n")
    with mkdocs_gen_files.open("reference/cli/.nav.md", "w") as nav:
        nav.write("* [Command line](index.md)\n")
        for name, cmd in cmds.items():
            module = cmd.callback.__module__
            attr = next(k for k, v in vars(sys.modules[module]).items() if v is cmd)
            with mkdocs_gen_files.open(f"reference/cli/{name}.md", "w") as f:
                f.write(f"::: mkdocs-click\n    :module: {module}\n    :command: {attr}\n"
                        f"    :prog_name: refcoll {name}\n    :depth: 0\n    :style: table\n"
                        f"    :list_subcommands: true\n")
            mkdocs_gen_files.set_edit_path(f"reference/cli/{name}.md",
                                           "../" + module.replace(".", "/") + ".py")
            nav.write(f"* [refcoll {name}]({name}.md)\n")


def table_pages() -> None:
    """Write the reference's generated tables."""
    with mkdocs_gen_files.open("reference/algorithms.md", "w") as f:
        f.write("# Algorithms\n\n"
                "Every algorithm in the registry (`refcoll.REGISTRY`, `refcoll list`), in its "
                "order: the collectives it implements, its summary, the spec page that gives "
                "its schedule, reduction order and cost, and how many golden vectors "
                "(`spec/vectors/manifest.json`) hold its bits. `refcoll list` prints each "
                "one's cost formulas.\n\n")
        f.write(blocks.algorithms_table(root="../", vectors=True))
    with mkdocs_gen_files.open("reference/environment.md", "w") as f:
        f.write("# Environment variables\n\n"
                "Every variable refcoll reads, from the one list in the code "
                "(`refcoll.core.environment.VARIABLES`; a test fails when a module reads one "
                "the list lacks). *Set by* says who sets it: the user, or refcoll for the "
                "processes it starts.\n\n")
        f.write(blocks.environment_table(root="../"))
    with mkdocs_gen_files.open("reference/errors.md", "w") as f:
        f.write("# Errors and exit codes\n\n"
                "refcoll's exceptions, from `refcoll.core.errors`: every one is a "
                "`refcoll.RefcollError`, and each names what was wrong, where, and what to do. "
                "A collective raises the same error on every rank where the ranks can know it "
                "(a mismatch, a bad setting), before any data moves.\n\n")
        f.write(blocks.errors_table(root="../"))
        f.write("\n## Exit codes of the command line\n\n::: refcoll.cli\n    options:\n"
                "      show_root_heading: false\n      show_root_toc_entry: false\n"
                "      members: false\n")


spec_pages()
cli_pages()
table_pages()
