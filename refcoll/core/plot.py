"""Figures: matplotlib's object interface, imported only when a picture is asked for.

No pyplot and no global figure state: each picture is one ``Figure`` written
by :func:`save` (``savefig`` into a file that replaces the target whole, never
through a link), which needs no display.
"""

from __future__ import annotations

import importlib
import os

from . import writing
from .errors import UsageError

__all__ = ["PLOT_HINT", "require_matplotlib", "figure", "save"]

#: What to install for ``--plot``.
PLOT_HINT = "--plot needs matplotlib: pip install 'refcoll[plot]'"


def require_matplotlib():
    """Return ``matplotlib.figure``: a command with ``--plot`` calls it before any work.

    Raises:
        UsageError: matplotlib is not installed.
    """
    try:
        return importlib.import_module("matplotlib.figure")
    except ImportError:
        raise UsageError(PLOT_HINT) from None


def figure(**kwargs):
    """Return a new ``matplotlib.figure.Figure(**kwargs)``.

    Raises:
        UsageError: matplotlib is not installed.
    """
    return require_matplotlib().Figure(**kwargs)


def save(fig, path, **kwargs) -> None:
    """Write ``fig`` to ``path`` in the format its suffix names (PNG for any other suffix).

    ``kwargs`` go to ``savefig`` (``dpi``). The file is written to a temporary beside
    ``path`` and renamed over it (:func:`refcoll.core.writing.write_file`).
    """
    kind = os.path.splitext(str(path))[1].lstrip(".").lower()
    if kind not in fig.canvas.get_supported_filetypes():
        kind = "png"
    with writing.write_file(path) as fh:
        fig.savefig(fh, format=kind, **kwargs)
