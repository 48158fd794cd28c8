"""A griffe extension: Sphinx's roles in refcoll's docstrings, as Markdown code.

refcoll's docstrings name other objects the way Sphinx does (``:func:`~refcoll.simulate```,
``:class:`Plan```); mkdocstrings reads Markdown, where those would show as written. This
turns each into a code span of the name (the last part with ``~``, as Sphinx shows it).
mkdocs.yml loads it (``extensions:``); the docstrings stay as they are.
"""

from __future__ import annotations

import re

from griffe import Extension

ROLE = re.compile(r":(?:py:)?(?:func|class|mod|meth|attr|data|exc|obj|const|term):`(~?)([^`]+)`")


def plain(text: str) -> str:
    """Return ``text`` with every Sphinx role written as a Markdown code span."""
    return ROLE.sub(lambda m: f"`{m[2].rsplit('.', 1)[-1] if m[1] else m[2]}`", text)


class SphinxRoles(Extension):
    """Rewrite the roles of every docstring griffe loads."""

    def on_instance(self, *, obj, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = plain(obj.docstring.value)
