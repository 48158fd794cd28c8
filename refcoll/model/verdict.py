"""Why one all-reduce beats another: the sentence ``refcoll model`` prints under its table.

The gap between two estimates is split into latency (``Σ rounds·α``) and moving
and reducing data (the rest); the larger names the reason, with what makes it
(links used at once or one after the other, bytes per GPU, channels on NICs).
"""

from __future__ import annotations

from ..core.units import counted, human_bytes, human_time
from .channels import CHANNELLED
from .phases import Estimate

__all__ = ["step_text", "why", "allreduce_verdict", "distinct_times", "TIE"]

#: Estimates whose times differ by less than this fraction of the larger are a tie: the
#: same schedule priced two ways (``ring`` and ``ring/ch`` on one channel) differs by
#: rounding only.
TIE = 1e-12


def step_text(seconds: float) -> str:
    """Return a step time with four digits (steps differ by less than human_time shows)."""
    return f"{seconds:.4f} s" if seconds >= 1 else human_time(seconds)


def _ties(a: float, b: float) -> bool:
    return abs(a - b) <= TIE * max(abs(a), abs(b))


def _with_digits(seconds: float, digits: int) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.{digits}g} {unit}"
    return f"{seconds * 1e9:.{digits}g} ns" if seconds else "0"


def distinct_times(a: float, b: float) -> tuple[str, str]:
    """Return ``a`` and ``b`` as human_time does, with more digits where three show them equal."""
    for digits in range(3, 8):
        ta, tb = _with_digits(a, digits), _with_digits(b, digits)
        if ta != tb:
            break
    return ta, tb


def _split(e: Estimate) -> dict:
    by_link = {"intra": 0.0, "inter": 0.0, "slowest": 0.0, "local": 0.0}
    for ph in e.phases:
        kind = "slowest" if ph.link == "flat" else ph.link  # a flat ring's: both kinds at once
        by_link[kind] = by_link.get(kind, 0.0) + ph.seconds
    return by_link


def _reduced(e: Estimate) -> int:
    return sum(ph.reduced for ph in e.phases)


def _elements(count: int) -> str:
    """Return an element count with three digits: ``6.89 G`` elements."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if count >= scale:
            return f"{count / scale:.3g} {unit}"
    return str(count)


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
    data_w, data_r = distinct_times(w.seconds - w.latency, r.seconds - r.latency)
    text = f"the gap is in moving and reducing data ({data_w} against {data_r})"
    if sw["slowest"] > sw["intra"] + sw["inter"] and sr["intra"] and sr["inter"]:
        channels = (f"its {counted(cluster.channel_count, 'channel')} cross on "
                    f"{counted(cluster.nic_count, 'NIC')} per node and "
                    if w.algorithm in CHANNELLED else "its steps ")
        return (f"{text}: {channels}keep NVLink and the NICs busy at once, where {r.algorithm} "
                f"runs {human_time(sr['intra'])} of intra-node phases with the NICs idle and "
                f"{human_time(sr['inter'])} across nodes one after the other")
    if w.bytes < r.bytes:
        fewer = _reduced(w) < _reduced(r) and cluster.seconds_per_byte_reduced() > 0
        also = (f" and reduces {_elements(_reduced(w))} elements against "
                f"{_elements(_reduced(r))}"
                if fewer else "")
        return (f"{text}: it sends {human_bytes(w.bytes)} per GPU against "
                f"{human_bytes(r.bytes)}{also}")
    if w.algorithm in CHANNELLED and r.algorithm not in CHANNELLED and sr["slowest"] and not (
            sr["intra"] or sr["inter"]):
        return (f"{text}: its {counted(cluster.channel_count, 'channel')} cross every node "
                f"boundary on {counted(min(cluster.channel_count, cluster.nic_count), 'NIC')} "
                f"at once, where "
                f"{r.algorithm} runs one schedule, each of its steps waiting for one NIC")
    net_w, net_r = sw["inter"] + sw["slowest"], sr["inter"] + sr["slowest"]
    if net_w < net_r:
        return (f"{text}: its phases that wait for the network take {human_time(net_w)} "
                f"against {human_time(net_r)} for {r.algorithm}")
    return text


def allreduce_verdict(cluster, dense) -> tuple[str, ...]:
    """Return which all-reduce of ``dense`` (estimates of the whole gradient) wins and why,
    against the next best and, when a channelled collective wins, against the best of
    refcoll's own schedules.

    Estimates within :data:`TIE` of the fastest share the win (the sentence names them);
    the next best is then the fastest of the others. When every one ties, the sentence
    says so.
    """
    ranked = sorted(dense, key=lambda e: e.seconds)
    if len(ranked) < 2:
        return ()
    if cluster.gpus == 1:
        return ("On one GPU an all-reduce moves nothing: every algorithm takes "
                f"{human_time(ranked[-1].seconds)}.",)
    tied = [e for e in ranked if _ties(e.seconds, ranked[0].seconds)]
    size = human_bytes(ranked[0].dense)
    if len(tied) == len(ranked):
        return (f"{', '.join(e.algorithm for e in tied)} tie on the all-reduce of the {size} "
                f"gradient: {human_time(ranked[0].seconds)} each.",)
    w, r = tied[0], ranked[len(tied)]
    with_ = (f" (tied with {', '.join(e.algorithm for e in tied[1:])})"
             if len(tied) > 1 else "")
    tw, tr = distinct_times(w.seconds, r.seconds)
    out = [f"{w.algorithm}{with_} wins the all-reduce of the {size} gradient: {tw} against "
           f"{tr} for {r.algorithm}, the next best; {why(cluster, w, r)}."]
    own = [e for e in ranked if e.algorithm not in CHANNELLED]
    if w.algorithm in CHANNELLED and own and all(own[0] is not e for e in (r, *tied)):
        out.append(f"Against {own[0].algorithm}, the best of refcoll's own schedules "
                   f"({human_time(own[0].seconds)}, {own[0].seconds / w.seconds:.2f}× slower): "
                   f"{why(cluster, w, own[0])}.")
    return tuple(out)
