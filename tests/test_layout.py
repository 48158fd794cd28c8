"""docs/layout.md against the tree: every module is named where its folder is described.

The page draws the package folder by folder; a module added without a word there, or a
name left on the page after its module went, fails here, so the map a reader starts
from stays the territory.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "refcoll"
PAGE = ROOT / "docs" / "layout.md"


def entries() -> dict[str, str]:
    """Return each ``refcoll/<part>`` entry of the page's text blocks and its description."""
    out, head = {}, None
    for line in PAGE.read_text(encoding="utf-8").splitlines():
        match = re.match(r"refcoll/([\w.]+)/?\s", line + " ")
        if match:
            head = match[1]
            out[head] = line[match.end():]
        elif line.startswith((" ", "\t")) and head is not None:
            out[head] += " " + line.strip()
        else:
            head = None
    return out


ENTRIES = entries()
PARTS = sorted(p.name for p in PACKAGE.iterdir()
               if p.is_dir() and (p / "__init__.py").exists())


def test_every_part_of_the_package_has_an_entry():
    assert sorted(k for k in ENTRIES if not k.endswith(".py")) == PARTS
    assert "__init__.py" in ENTRIES


def test_every_module_is_named_in_its_parts_entry():
    missing = [f"{path.relative_to(ROOT)}" for part in PARTS
               for path in sorted((PACKAGE / part).rglob("*.py"))
               if path.name != "__init__.py"
               and not re.search(rf"(?<![\w/]){re.escape(path.name)}", ENTRIES[part])]
    top = [p.name for p in PACKAGE.glob("*.py") if p.name not in ENTRIES["__init__.py"]
           and p.name != "__init__.py"]
    assert not missing + top, f"docs/layout.md does not name: {', '.join(missing + top)}"


def test_every_module_the_page_names_exists():
    gone = [f"refcoll/{part}/: {name}" for part in PARTS
            for name in re.findall(r"(?<![\w/.])(\w+\.py)\b", ENTRIES[part])
            if not any(True for _ in (PACKAGE / part).rglob(name))]
    assert not gone, f"docs/layout.md names modules that do not exist: {', '.join(gone)}"
