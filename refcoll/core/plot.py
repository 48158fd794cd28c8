"""Figures: matplotlib's object interface, imported only when a picture is asked for.

No pyplot and no global figure state: each picture is one ``Figure`` written
with ``savefig``, which needs no display.
"""

from __future__ import annotations

import importlib

from .errors import UsageError

__all__ = ["PLOT_HINT", "require_matplotlib", "figure"]

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
