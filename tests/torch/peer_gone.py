"""A peer that never makes its first call, or dies in the middle: run by tests/test_torch.py.

``python peer_gone.py absent|dead DONE`` in a 2-process job. Rank 1 either never calls
(``absent``) or, after one call, closes its connections as a dead process's close
(``dead``); it stays until rank 0 has its error, since MPI's launcher ends the whole job
once a process leaves. Rank 0 must get refcoll's error naming the wait, not hang: it writes
``OK <error>`` to the file ``DONE``.
"""

import gc
import os
import sys
import time
from pathlib import Path

import torch

import refcoll.torch as rt
import refcoll.transport.torch
from refcoll.core.errors import CollectiveTimeout, PeerFailure

mode, done = sys.argv[1], Path(sys.argv[2])
rt.init_process_group("gloo")
t = rt.transport_for()
if mode == "dead":
    rt.allreduce(torch.ones(4))
if t.rank == 1:
    if mode == "dead":  # its connections close as a dead process's do; the process stays,
        torch.distributed.destroy_process_group()  # since MPI's launcher would end the job
        refcoll.transport.torch.forget_groups()   # (rank 0 too) the moment it left
        del t
        gc.collect()
    deadline = time.monotonic() + 60  # until rank 0 has its error (a minute at most)
    while not done.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    os._exit(0)
try:
    rt.allreduce(torch.ones(1000), algorithm="ring")
except (CollectiveTimeout, PeerFailure) as exc:
    done.write_text(f"OK {type(exc).__name__}: {exc}")
    os._exit(0)
done.write_text("no error")
os._exit(1)
