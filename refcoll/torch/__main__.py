"""``python -m refcoll.torch SCRIPT [ARGS...]``: a torch program, the "refcoll" backend registered.

For a program that cannot be edited to ``import refcoll.torch``: ``torchrun
--nproc-per-node 2 -m refcoll.torch train.py --backend refcoll`` runs
``train.py`` as its own ``__main__``, with ``sys.argv`` as it expects, after
registering the backend. ``-m MODULE`` runs a module instead of a script.
"""

from __future__ import annotations

import os
import runpy
import sys

from . import backend


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        sys.exit(0 if argv else 2)
    backend.register()
    if argv[0] == "-m":
        if len(argv) < 2:
            print("python -m refcoll.torch -m MODULE [ARGS...]: name the module", file=sys.stderr)
            sys.exit(2)
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        if not os.path.isfile(argv[0]):
            print(f"python -m refcoll.torch: no such script: {argv[0]}", file=sys.stderr)
            sys.exit(2)
        sys.argv = argv
        # as `python SCRIPT` does: the script's folder first, so its own modules import
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
