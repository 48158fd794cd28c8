"""The libraries refcoll is measured and judged against: MPI's own collectives and NCCL."""
