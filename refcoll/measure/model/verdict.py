"""Why one all-reduce beats another: the sentence ``refcoll model`` prints under its table.

The gap between two estimates is split into latency (``Σ rounds·α``) and moving
and reducing data (the rest); the larger names the reason, with what makes it
(links used at once or one after the other, bytes per GPU, channels on NICs).
"""

from __future__ import annotations

from ...core.units import human_bytes, human_time
from .channels import CHANNELLED
from .phases import Estimate

__all__ = ["step_text", "why", "allreduce_verdict"]


def step_text(seconds: float) -> str:
    """Return a step time with four digits (steps differ by less than human_time shows)."""
    return f"{seconds:.4f} s" if seconds >= 1 else human_time(seconds)


def _split(e: Estimate) -> dict:
    by_link = {"intra": 0.0, "inter": 0.0, "slowest": 0.0, "local": 0.0}
    for ph in e.phases:
        by_link[ph.link] += ph.seconds
    return by_link


def why(cluster, w: Estimate, r: Estimate) -> str:
    """Name what separates the winner ``w`` from the runner-up ``r``."""
    latency_gap = r.latency - w.latency
    data_gap = (r.seconds - r.latency) - (w.seconds - w.latency)
    if latency_gap > data_gap:
        rounds_w = sum(ph.rounds for ph in w.phases)
        rounds_r = sum(ph.rounds for ph in r.phases)
        return (f"the gap is latency: {rounds_w} rounds ({human_time(w.latency)}) against "
                f"{rounds_r} ({human_time(r.latency)})")
    sw, sr = _split(w), _split(r)
    text = (f"the gap is in moving and reducing data ({human_time(w.seconds - w.latency)} against "
            f"{human_time(r.seconds - r.latency)})")
    if sw["slowest"] > sw["intra"] + sw["inter"] and sr["intra"] and sr["inter"]:
        channels = (f"its {cluster.channel_count} channels cross on {cluster.nic_count} NICs "
                    f"per node and " if w.algorithm in CHANNELLED else "its steps ")
        return (f"{text}: {channels}keep NVLink and the NICs busy at once, where {r.algorithm} "
                f"runs {human_time(sr['intra'])} of intra-node phases with the NICs idle and "
                f"{human_time(sr['inter'])} across nodes one after the other")
    if w.bytes < r.bytes:
        return (f"{text}: it sends {human_bytes(w.bytes)} per GPU against "
                f"{human_bytes(r.bytes)}")
    if w.algorithm in CHANNELLED and r.algorithm not in CHANNELLED and sr["slowest"] and not (
            sr["intra"] or sr["inter"]):
        return (f"{text}: its {cluster.channel_count} channels cross every node boundary on "
                f"{min(cluster.channel_count, cluster.nic_count)} NICs at once, where "
                f"{r.algorithm} runs one schedule, each of its steps waiting for one NIC")
    return text


def allreduce_verdict(cluster, dense) -> tuple[str, ...]:
    """Return which all-reduce of ``dense`` (estimates of the whole gradient) wins and why,
    against the next best and, when a channelled collective wins, against the best of
    refcoll's own schedules."""
    ranked = sorted(dense, key=lambda e: e.seconds)
    if len(ranked) < 2 or ranked[0].seconds >= ranked[1].seconds:
        return ()
    w, r = ranked[0], ranked[1]
    out = [f"{w.algorithm} wins the all-reduce of the {human_bytes(w.dense)} gradient: "
           f"{human_time(w.seconds)} against {human_time(r.seconds)} for {r.algorithm}, the "
           f"next best; {why(cluster, w, r)}."]
    own = [e for e in ranked if e.algorithm not in CHANNELLED]
    if w.algorithm in CHANNELLED and own and own[0] is not r:
        out.append(f"Against {own[0].algorithm}, the best of refcoll's own schedules "
                   f"({human_time(own[0].seconds)}, {own[0].seconds / w.seconds:.2f}× slower): "
                   f"{why(cluster, w, own[0])}.")
    return tuple(out)
