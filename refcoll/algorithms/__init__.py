"""The algorithms: one module per algorithm, each registering its record in the registry.

Every module here (but the private ones, ``_util`` and ``_nodes``, and
``registry`` itself) is imported in turn, and each ends by registering its
:class:`~refcoll.algorithms.registry.Algorithm`: its implementations, its cost
functions, and every fact the rest of refcoll needs about it. Adding an
algorithm is adding its module (and its spec page and tests); nothing else
names it. A module may also hold steps several algorithms share
(:mod:`~refcoll.algorithms.recursive`) and register nothing.
"""

from __future__ import annotations

import importlib
import pkgutil

from ._nodes import NodeLayout, node_layout, node_sizes, node_traffic
from .registry import (
    COLLECTIVES,
    REGISTRY,
    Algorithm,
    LinkCost,
    NodeShape,
    check_options,
    get,
    implementation,
    names,
    options,
    register,
)

__all__ = ["Algorithm", "REGISTRY", "COLLECTIVES", "get", "implementation", "names", "options",
           "check_options", "register", "NodeShape", "LinkCost", "NodeLayout", "node_layout",
           "node_sizes", "node_traffic"]

for _module in pkgutil.iter_modules(__path__):
    if not _module.name.startswith("_") and _module.name != "registry":
        importlib.import_module(f"{__name__}.{_module.name}")
