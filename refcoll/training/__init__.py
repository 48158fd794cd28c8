"""Training with refcoll: DDP's bucketed gradient reducer and the small models it trains.

:mod:`~refcoll.training.reducer` is the :class:`~refcoll.training.reducer.Reducer`
(PyTorch DDP's bucketing, point by point) and :mod:`~refcoll.training.buckets` the
layout it applies; :mod:`~refcoll.training.mlp` is the one model trained:
:mod:`~refcoll.training.train` trains it on the digits data over N ranks
(``refcoll train``), and :mod:`~refcoll.training.overlap` trains a deeper one through
the Reducer, timing how much of the all-reduce hides behind the
backward pass (``refcoll train --overlap``). They import the reference; nothing in
the reference imports them.
"""
