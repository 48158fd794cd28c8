"""Checking collectives: the oracle, deterministic inputs, the conformance battery, the spec.

:mod:`.oracle` (expected results, error bounds, judging another
implementation's outputs), :mod:`.inputs` (inputs every rank can regenerate),
:mod:`.conformance` (the battery ``refcoll verify`` runs), :mod:`.trace` and
:mod:`.spec_pages` (the spec pages' generated step tables and reduction trees,
``refcoll spec``) and :mod:`.vectors` (the golden test vectors,
``refcoll vectors``).
"""
