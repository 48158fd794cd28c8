"""The job every tests/torch/ module runs in: started by tests/test_torch.py under torchrun or
mpiexec."""

import pytest


@pytest.fixture(scope="session")
def transport():
    """refcoll's transport over the job's Gloo group, started as the launcher asks."""
    import refcoll.torch as rt

    rt.init_process_group("gloo")
    return rt.transport_for()
