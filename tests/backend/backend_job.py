"""The job every tests/backend/ module runs in: started by tests/test_torch_backend.py.

The default group is the ``"refcoll"`` backend, started as the launcher asks
(torchrun or mpiexec). Tests that need a group of other settings
(``REFCOLL_ALGO``, ``REFCOLL_TIMEOUT``, ``REFCOLL_WATCH``) make one with
:func:`group_with`, collectively, on every rank.
"""

import contextlib
import os
from unittest import mock

import pytest


@pytest.fixture(scope="session")
def world():
    """The job's default group, on the "refcoll" backend."""
    import torch.distributed as dist

    import refcoll.torch as rt

    rt.init_process_group("refcoll")
    assert dist.get_backend() == "refcoll"
    return dist.group.WORLD


@contextlib.contextmanager
def environment(**values):
    """Set environment variables (``None``: unset) for the block; restore them all after."""
    with mock.patch.dict(os.environ, {k: str(v) for k, v in values.items() if v is not None}):
        for k in [k for k, v in values.items() if v is None]:
            os.environ.pop(k, None)
        yield


def group_with(ranks=None, **env):
    """Make a "refcoll" group (every rank calls) with these environment settings at creation."""
    import torch.distributed as dist

    with environment(**env):
        return dist.new_group(ranks, backend="refcoll")
