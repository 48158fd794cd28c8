"""A peer that never makes its first call, or dies in the middle: run by tests/test_torch.py.

``python peer_gone.py absent|dead`` in a 2-process job. Rank 1 either never calls
(``absent``: it waits, then leaves) or leaves after one call (``dead``); rank 0 must
get refcoll's error naming the wait, not hang. Prints ``OK <error>`` on rank 0.
"""

import os
import sys
import time

import torch

import refcoll.torch as rt
from refcoll.core.errors import CollectiveTimeout, PeerFailure

mode = sys.argv[1]
rt.init_process_group("gloo")
t = rt.transport_for()
if mode == "dead":
    rt.allreduce(torch.ones(4))
if t.rank == 1:
    if mode == "absent":
        time.sleep(float(os.environ["REFCOLL_TIMEOUT"]) + 1)  # past rank 0's deadline
    os._exit(0)
try:
    rt.allreduce(torch.ones(1000), algorithm="ring")
except (CollectiveTimeout, PeerFailure) as exc:
    print(f"OK {type(exc).__name__}: {exc}", flush=True)
    os._exit(0)
print("no error", flush=True)
os._exit(1)
