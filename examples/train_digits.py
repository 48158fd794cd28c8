"""Data-parallel training from Python: the library call behind ``refcoll train``.

Run on four processes:

    mpiexec -n 4 python examples/train_digits.py

or on four simulated ranks in this one process (no MPI needed):

    python examples/train_digits.py --simulate 4

Needs scikit-learn (pip install 'refcoll[examples]').
"""

from __future__ import annotations

import argparse

from refcoll import SimWorld
from refcoll.training.train import TrainConfig, train


def main() -> None:
    """Train with and without top-k 1% + error feedback and print what each cost."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--simulate", type=int, metavar="P", help="simulate P ranks instead of MPI")
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    if args.simulate is not None and not 1 <= args.simulate <= 64:
        parser.error(f"--simulate {args.simulate}: give 1 to 64 simulated ranks")
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: give at least 1")
    for spec in ("none", "ef(topk:ratio=0.01)"):
        config = TrainConfig(compressor=spec, steps=args.steps)
        if args.simulate is not None:
            history = SimWorld(args.simulate).run(lambda t, config=config: train(t, config))[0]
            rank = 0
        else:
            from mpi4py import MPI

            history = train(MPI.COMM_WORLD, config)
            rank = MPI.COMM_WORLD.Get_rank()
        if rank == 0:
            final = history.final
            print(f"{spec:<22} test accuracy {100 * final.test_accuracy:6.2f}%   "
                  f"{final.bytes_sent:>10} bytes sent per rank "
                  f"({final.ratio:.1f}x fewer than dense)")


if __name__ == "__main__":
    main()
