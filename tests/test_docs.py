"""The documentation: every example runs and prints what its page says, the site builds.

* Every ```python block and every ```bash / ```console block of the README and of docs/
  runs (the README's and the pages' own commands, as a reader would type them), unless the
  line before it says why it cannot run here: ``<!-- not run: REASON -->`` (a GPU, several
  hosts, root, an hour) or ``<!-- slow: REASON -->`` (run by ``pytest -m slow``).
* A python block whose first line is ``# NAME.py — run with: COMMAND`` runs as that file
  with that command; ``# NAME.py: ...`` only writes the file, for a later command of the
  page to run; any other python block runs as ``python FILE``. A python block followed by a
  ```text block titled ``Output`` must print that output.
* A bash block runs as one script (``set -e``); a console block runs each ``$ `` line and
  compares what it prints, stdout and stderr together, with the lines below it. ``...`` in
  the page matches any text within a line, and a line of its own ``...`` any lines.
  ``<!-- exit status: N -->`` before a block says its commands end with status ``N``.
* Each page's examples run in order in one folder of their own (with ``examples/``,
  ``benchmarks/`` and ``spec/`` linked in), with ``REFCOLL_CALIBRATION=default`` (auto's
  choice is the fixed calibration's, so what a page prints does not depend on this
  machine's timings) and a calibration cache of the session's own.
* ``mkdocs build --strict`` builds the site with no warning; no generated block of a
  committed page is stale; every public name is on an API page; every ``REFCOLL_``
  variable the code reads is in :mod:`refcoll.core.environment`'s list; the README stays
  short and keeps its two set-up commands.

``tests/test_docs_browser.py`` opens the built site in headless Chromium.
"""

from __future__ import annotations

import ast
import atexit
import difflib
import functools
import importlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

#: The README.
README = ROOT / "README.md"

#: Every page whose examples run: the README and the site's own pages.
PAGES = [README] + sorted(p for p in DOCS.rglob("*.md")
                          if not any(part.startswith("_") for part in p.relative_to(DOCS).parts))

#: The README's two set-up commands, which .ci/run runs (the second) word for word.
SETUP_COMMANDS = (
    "pip install '.[mpi]' && refcoll verify -n 4",
    "python3 -m venv .venv && . .venv/bin/activate && pip install -q '.[mpi,test]' "
    "torch==2.13.0 && ruff check . && python -m pytest",
)
README_MAX_LINES = 150

#: Markers a page may put on the line before a block, and whether each needs a reason.
MARKERS = {"not run": True, "slow": True, "exit status": True}
RUN_LANGUAGES = {"python", "bash", "sh", "shell", "console"}
TIMEOUT, SLOW_TIMEOUT = 240, 1800

_FENCE = re.compile(r"^(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*)$")
_MARKER = re.compile(r"^<!--\s*(?P<key>[a-z][a-z ]*?)\s*:\s*(?P<value>.*?)\s*-->$")
_HEADER = re.compile(r"^#\s*(?P<file>[\w.-]+\.py)\b(?P<rest>.*)$")


# ------------------------------------------------------------------------------ parsing

@dataclass
class Block:
    """A fenced code block of a page, with the markers on the lines before it."""

    page: Path
    line: int  # the opening fence's line, 1-based
    lang: str
    info: str
    text: str
    markers: dict = field(default_factory=dict)
    output: "Block | None" = None  # the ```text title="Output" block that follows

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def parse_blocks(page: Path) -> list[Block]:
    """Return the page's fenced blocks, each with its markers and its Output block."""
    lines = page.read_text().splitlines()
    blocks: list[Block] = []
    i = prev_end = 0
    while i < len(lines):
        m = _FENCE.match(lines[i].strip())
        if not m:
            i += 1
            continue
        fence, info = m["fence"], m["info"].strip()
        indent = len(lines[i]) - len(lines[i].lstrip())
        body, j = [], i + 1
        while j < len(lines) and not (lines[j].strip().startswith(fence)
                                      and not lines[j].strip()[len(fence):].strip()):
            body.append(lines[j][indent:] if lines[j][:indent].strip() == "" else lines[j])
            j += 1
        markers, k = {}, i - 1
        while k >= 0 and (not lines[k].strip() or _MARKER.match(lines[k].strip())):
            mm = _MARKER.match(lines[k].strip())
            if mm:
                markers[mm["key"]] = mm["value"]
            k -= 1
        lang = info.split()[0].lower() if info else ""
        block = Block(page, i + 1, lang, info, "\n".join(body) + "\n", markers)
        prev = blocks[-1] if blocks else None
        if (lang == "text" and 'title="Output"' in info and prev is not None
                and prev.lang == "python" and all(not s.strip() for s in lines[prev_end:i])):
            prev.output = block
        blocks.append(block)
        prev_end = j + 1
        i = j + 1
    return blocks


def runnable(blocks: list[Block]) -> list[Block]:
    """Return the blocks that are examples: python, shell and console blocks."""
    return [b for b in blocks if b.lang in RUN_LANGUAGES]


def console_commands(text: str) -> list[tuple[str, str]]:
    """Return a console block's ``(command, expected output)`` pairs."""
    out: list[tuple[str, list[str]]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("$ "):
            cmd = line[2:]
            while cmd.endswith("\\") and i + 1 < len(lines):
                i += 1
                cmd = cmd[:-1] + " " + lines[i].strip().removeprefix("> ")
            out.append((cmd, []))
        elif out:
            out[-1][1].append(line)
        i += 1
    return [(cmd, "\n".join(expected)) for cmd, expected in out]


def python_file(block: Block) -> tuple[str, str | None]:
    """Return the file a python block is saved as, and the command that runs it (None: none)."""
    first = block.text.splitlines()[0] if block.text.strip() else ""
    m = _HEADER.match(first)
    if not m:
        name = f"example_{block.line}.py"
        return name, f"python {name}"
    rest = m["rest"]
    if "run with:" not in rest:
        return m["file"], None
    cmd = rest.split("run with:", 1)[1].strip()
    cmd = re.sub(r"\s+\(.*\)$", "", cmd)  # "(or mpiexec -n 4 python x.py)": the first one runs
    return m["file"], cmd


def output_matches(expected: str, actual: str) -> bool:
    """Return whether ``actual`` is what the page shows: ``...`` matches any text in a line,
    a line ``...`` any lines; trailing spaces and the outer blank lines do not count."""
    exp = [line.rstrip() for line in expected.strip("\n").splitlines()]
    act = "\n".join(line.rstrip() for line in actual.strip("\n").splitlines()) + "\n"
    if not exp:
        return not actual.strip()
    parts = []
    for line in exp:
        if line.strip() == "...":
            parts.append(r"(?:[^\n]*\n)*?")
        else:
            parts.append("[^\n]*?".join(re.escape(piece) for piece in line.split("...")) + r"\n")
    return re.fullmatch("".join(parts), act) is not None


def _diff(expected: str, actual: str) -> str:
    return "\n".join(difflib.unified_diff(expected.strip("\n").splitlines(),
                                          [s.rstrip() for s in actual.strip("\n").splitlines()],
                                          "the page", "the run", lineterm=""))


BLOCKS = {page: parse_blocks(page) for page in PAGES}
EXAMPLES = [b for page in PAGES for b in runnable(BLOCKS[page])]


# ------------------------------------------------------------------------------ running

_JOB_VARIABLES = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS",
                  "SLURM_PMIX_MAPPING_SERV", "RANK", "WORLD_SIZE", "LOCAL_RANK")


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("docs-examples")


@pytest.fixture(scope="session")
def example_env(session_dir) -> dict:
    """A reader's shell: no REFCOLL_ settings but a cache of its own and the fixed calibration."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("REFCOLL_") and k not in _JOB_VARIABLES}
    env.update(REFCOLL_CACHE=str(session_dir / "cache"), REFCOLL_CALIBRATION="default",
               PYTHONUNBUFFERED="1", COLUMNS="200",
               PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]))
    return env


_workdirs: dict[Path, Path] = {}


def workdir(page: Path, session_dir: Path) -> Path:
    """Return the page's folder: its python files written, the repository's folders linked."""
    if page not in _workdirs:
        name = str(page.relative_to(ROOT)).replace("/", "_").removesuffix(".md")
        where = session_dir / name
        where.mkdir()
        for folder in ("examples", "benchmarks", "spec"):
            (where / folder).symlink_to(ROOT / folder)
        _workdirs[page] = where
    where = _workdirs[page]
    for block in BLOCKS[page]:
        if block.lang == "python":
            (where / python_file(block)[0]).write_text(block.text)
    return where


def _run(cmd: str, cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-o", "pipefail", "-c", cmd], cwd=cwd, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)


def _tail(text: str, lines: int = 60) -> str:
    return "\n".join(text.splitlines()[-lines:])


def _param(block: Block):
    marks = []
    if "not run" in block.markers:
        marks.append(pytest.mark.skip(reason=f"not run: {block.markers['not run']}"))
    if "slow" in block.markers:
        marks.append(pytest.mark.slow)
    return pytest.param(block, id=block.where, marks=marks)


@pytest.mark.parametrize("block", [_param(b) for b in EXAMPLES])
def test_example_runs_as_its_page_says(block, session_dir, example_env):
    cwd = workdir(block.page, session_dir)
    timeout = SLOW_TIMEOUT if "slow" in block.markers else TIMEOUT
    status = int(block.markers.get("exit status", 0))
    if block.lang == "python":
        name, cmd = python_file(block)
        if cmd is None:  # a file a later command of the page runs
            compile(block.text, name, "exec")
            return
        assert name in cmd, f"{block.where}: its command {cmd!r} does not run {name}"
        done = _run(cmd, cwd, example_env, timeout)
        assert done.returncode == status, \
            f"{block.where}: {cmd} exited {done.returncode}:\n{_tail(done.stdout)}"
        if block.output is not None:
            assert output_matches(block.output.text, done.stdout), \
                f"{block.where}: {cmd} printed what the page does not say:\n" \
                + _diff(block.output.text, done.stdout)
    elif block.lang == "console":
        commands = console_commands(block.text)
        assert commands, f"{block.where}: a console block without a $ line"
        for cmd, expected in commands:
            done = _run(cmd, cwd, example_env, timeout)
            assert done.returncode == status, \
                f"{block.where}: {cmd} exited {done.returncode}:\n{_tail(done.stdout)}"
            assert output_matches(expected, done.stdout), \
                f"{block.where}: {cmd} printed what the page does not say:\n" \
                + _diff(expected, done.stdout)
    else:
        done = _run("set -e\n" + block.text, cwd, example_env, timeout)
        assert done.returncode == status, \
            f"{block.where}: the block exited {done.returncode}:\n{_tail(done.stdout)}"
    for drawn in re.findall(r"--plot\s+(\S+\.png)", block.text):
        assert (cwd / drawn).is_file(), f"{block.where}: --plot {drawn} drew nothing"
        for committed in DOCS.rglob(Path(drawn).name):
            assert png_size(cwd / drawn) == png_size(committed), \
                f"{block.where}: draws {drawn} at {png_size(cwd / drawn)}, " \
                f"but {committed.relative_to(ROOT)} is {png_size(committed)}"


def png_size(path: Path) -> tuple[int, int]:
    """Return a PNG's width and height, from its header."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


MEASUREMENTS = DOCS / "measurements.md"


def test_every_figure_is_drawn_by_the_command_above_it_on_the_measurements_page():
    """A committed figure is kept with the command that draws it, and is what it draws."""
    text = MEASUREMENTS.read_text()
    blocks = [b for b in BLOCKS[MEASUREMENTS] if b.lang in RUN_LANGUAGES]
    lines = text.splitlines()
    shown = {}
    for n, line in enumerate(lines, 1):
        for target in re.findall(r"!\[[^\]]*\]\(([^)\s]+\.png)\)", line):
            above = [b for b in blocks if b.line < n]
            assert above, f"measurements.md:{n}: {target} has no command above it"
            name = Path(target).name
            assert f"--plot {name}" in above[-1].text, \
                f"measurements.md:{n}: the command above {target} does not draw {name}"
            shown[(MEASUREMENTS.parent / target).resolve()] = n
    for png in DOCS.rglob("*.png"):
        if png.parent == DOCS / "screenshots":  # the browser test's record of one run, off the site
            continue
        assert png.resolve() in shown, \
            f"{png.relative_to(ROOT)} is not on the measurements page under its command"
        png_size(png)


# --------------------------------------------------------------------- the pages' rules

def test_every_marker_is_known_and_says_why():
    wrong = []
    for page in PAGES:
        for block in BLOCKS[page]:
            for key, value in block.markers.items():
                if key not in MARKERS:
                    wrong.append(f"{block.where}: unknown marker {key!r} (known: {list(MARKERS)})")
                elif MARKERS[key] and not value:
                    wrong.append(f"{block.where}: <!-- {key}: --> needs a reason")
            if block.markers and block.lang not in RUN_LANGUAGES:
                wrong.append(f"{block.where}: a marker on a {block.lang or 'plain'} block, "
                             "which never runs")
    assert not wrong, "\n".join(wrong)


def test_every_refcoll_command_of_a_page_is_in_a_block_that_runs():
    """A ``refcoll ...`` line outside a bash or console block would escape the runner."""
    wrong = []
    for page in PAGES:
        for block in BLOCKS[page]:
            if block.lang in RUN_LANGUAGES or block.lang == "text":
                continue
            for n, line in enumerate(block.text.splitlines(), block.line + 1):
                if re.match(r"^(\$ )?([A-Z_]+=\S+ )*refcoll [a-z][\w-]*(\s|$)", line):
                    wrong.append(f"{page.relative_to(ROOT)}:{n}: {line.strip()} "
                                 f"(in a {block.lang or 'plain'} block: make it bash or console)")
    assert not wrong, "\n".join(wrong)


def test_output_matching_rules():
    assert output_matches("a\n...\nd", "a\nb\nc\nd\n")
    assert output_matches("a ... d", "a bc d")
    assert output_matches("x  \n\n", "x")
    assert not output_matches("a\nb", "a\nc")
    assert not output_matches("a ... d", "a b\nc d")  # in-line ... stays in its line
    assert output_matches("", "\n") and not output_matches("", "x")
    assert console_commands("$ refcoll a \\\n  --b\nout\n$ x\n") == [("refcoll a  --b", "out"),
                                                                     ("x", "")]


# --------------------------------------------------------------------- generated blocks

def _blocks_module():
    spec = importlib.util.spec_from_file_location("docs_blocks", DOCS / "_scripts" / "blocks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_generated_blocks_are_current(page):
    blocks = _blocks_module()
    stale = [name for name, args, body in blocks.blocks(page.read_text())
             if body != blocks.render(name, args)]
    assert not stale, (f"{page.relative_to(ROOT)}: generated blocks {stale} are stale; "
                       f"run: python docs/_scripts/blocks.py {page.relative_to(ROOT)}")


def test_the_readme_has_the_table_of_algorithms_generated():
    names = [name for name, _, _ in _blocks_module().blocks(README.read_text())]
    assert "algorithms-table" in names


# ------------------------------------------------------------------------------ README

def test_the_readme_is_short_and_keeps_its_setup_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    for command in SETUP_COMMANDS:
        assert f"```bash\n{command}\n```" in text, f"the README lost {command!r}"


def test_ci_runs_the_readmes_test_command():
    assert SETUP_COMMANDS[1] in (ROOT / ".ci" / "run").read_text()


def test_the_readmes_links_lead_somewhere():
    """The README's links are relative to the repository's root, where README.md lives."""
    missing = []
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text()):
        if "://" not in target and not (ROOT / target).exists():
            missing.append(target)
    assert not missing, f"the README links to files that do not exist: {missing}"


# ------------------------------------------------------------------------------ the site

def _docs_packages():
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python",
                   "mkdocs_click", "mkdocs_gen_files", "mkdocs_literate_nav"):
        pytest.importorskip(module, reason=f"{module} is missing: pip install '.[docs]'")


@functools.lru_cache(maxsize=None)
def build_site() -> tuple[Path, subprocess.CompletedProcess]:
    """Build the site once per session with ``mkdocs build --strict``; return where, and the run."""
    site = Path(tempfile.mkdtemp(prefix="refcoll-site-"))
    atexit.register(shutil.rmtree, site, ignore_errors=True)
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", DISABLE_MKDOCS_2_WARNING="true")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(site)], cwd=ROOT, env=env, text=True, capture_output=True,
                          timeout=600)
    return site, done


def test_the_site_builds_strict_with_no_warning():
    _docs_packages()
    site, done = build_site()
    log = done.stdout + done.stderr
    assert done.returncode == 0, _tail(log)
    assert "WARNING" not in log, _tail(log)
    for page in ("index.html", "reference/api/collectives/index.html",
                 "reference/cli/bench/index.html", "spec/ring/index.html",
                 "reference/environment/index.html", "search/search_index.json"):
        assert (site / page).is_file(), page


def test_the_specification_is_spec_itself_not_a_copy():
    """spec/'s pages are read from spec/ at build time: none is kept under docs/."""
    _docs_packages()
    site, done = build_site()
    assert done.returncode == 0, _tail(done.stdout + done.stderr)
    spec = ROOT / "spec"
    texts = {p.read_text() for p in spec.rglob("*.md")}
    copies = [p for p in DOCS.rglob("*.md") if p.read_text() in texts]
    assert not copies, f"copies of spec pages under docs/: {copies}"
    for page in spec.rglob("*.md"):
        rel = page.relative_to(spec).with_suffix("")
        built = site / "spec" / (rel.parent if rel.name == "README" else rel) / "index.html"
        assert built.is_file(), f"{page.relative_to(ROOT)} is not in the site"


def _api_directives() -> list[tuple[str, str]]:
    found = []
    for page in sorted((DOCS / "reference" / "api").glob("*.md")):
        text = page.read_text()
        for m in re.finditer(r"^::: ([\w.]+)\n((?:    .*\n)*)", text, re.M):
            found.append((m[1], m[2]))
    return found


def _module_all(module: str) -> list[str]:
    """Return a module's ``__all__``, read from its source (nothing imported: torch is heavy)."""
    spec = importlib.util.find_spec(module)
    tree = ast.parse(Path(spec.origin).read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__"
                                                for t in node.targets):
            return list(ast.literal_eval(node.value))
    return []


#: The public modules whose every ``__all__`` name has its place on an API page.
PUBLIC_MODULES = ("refcoll", "refcoll.torch", "refcoll.compressors", "refcoll.transport",
                  "refcoll.cluster")


def _documented(module: str, name: str, shown: set, whole: set) -> bool:
    """Return whether ``module.name`` is on an API page, under its own path or another's."""
    if f"{module}.{name}" in shown:
        return True
    if module == "refcoll.torch":  # not imported here (torch is heavy): its own path only
        return False
    obj = getattr(importlib.import_module(module), name)
    for other in PUBLIC_MODULES:
        if other not in (module, "refcoll.torch") and f"{other}.{name}" in shown \
                and getattr(importlib.import_module(other), name, None) is obj:
            return True
    home = getattr(obj, "__module__", None)  # a class shown with its module
    return bool(home) and (f"{home}.{name}" in shown or home in whole)


def test_every_public_name_is_on_an_api_page():
    directives = _api_directives()
    shown = {target for target, _ in directives}
    whole = {target for target, options in directives if "members: false" not in options}
    missing = [f"{module}.{name}" for module in PUBLIC_MODULES for name in _module_all(module)
               if not _documented(module, name, shown, whole)]
    assert not missing, "public names on no page of docs/reference/api/: " + ", ".join(missing)


# ------------------------------------------------------------------ environment variables

def _variables_read() -> dict[str, set[str]]:
    """Return every ``REFCOLL_`` name the package's source holds, with the modules holding it."""
    package = ROOT / "refcoll"
    found: dict[str, set[str]] = {}
    for path in package.rglob("*.py"):
        if path == package / "core" / "environment.py":
            continue
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for name in re.findall(r"\bREFCOLL_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()):
            found.setdefault(name, set()).add(module)
    return found


def test_the_list_of_environment_variables_is_the_codes():
    from refcoll.core.environment import VARIABLES

    listed = {v.name for v in VARIABLES}
    read = _variables_read()
    assert len(listed) == len(VARIABLES), "a variable is listed twice"
    assert not set(read) - listed, \
        f"read by the code but not in refcoll/core/environment.py: {sorted(set(read) - listed)}"
    assert not listed - set(read), \
        f"listed but read by no module: {sorted(listed - set(read))}"
    for v in VARIABLES:
        assert v.readers and set(v.readers) <= read[v.name], \
            f"{v.name}: readers {v.readers}, but the name is in {sorted(read[v.name])}"
        assert v.default and v.effect, v.name
