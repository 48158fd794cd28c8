"""The libraries refcoll is measured and judged against: MPI's own collectives, NCCL and Gloo.

:mod:`.mpi` (the MPI library's ``MPI_Allreduce``...), :mod:`.nccl` (through CuPy) and
:mod:`.gloo` (torch.distributed's Gloo backend, an optional extra: PyTorch is imported
only when it runs).
"""
