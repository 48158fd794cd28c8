"""``refcoll model``'s question read from text: the cluster, the workload, the options.

:class:`ModelRequest` holds the command's option values as the user wrote them
(``900GB/s``, ``2us``, ``1.3e9``); its :meth:`~ModelRequest.plan` checks them in the order
the command documents, resolves how each bandwidth is quoted, and returns the
:class:`~refcoll.model.stack.Plan`. :func:`calibration_request` does the
same for ``--calibrate``, before any process starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.errors import UsageError
from ..core.reading import MAX_JSON_BYTES, loads_json, number, read_bytes
from ..core.units import parse_bandwidth, parse_count, parse_duration, parse_size, parse_sizes
from .calibrate import CALIBRATE_LIMIT
from .cluster import (
    MAX_GPUS,
    Cluster,
    Options,
    Workload,
    buckets_for_size,
    check_buckets,
    load_layers,
    select_algorithms,
)
from .search import plan_and_search
from .stack import Plan, plan
from .systems import PCIE_GBPS, SYSTEM_PRESETS, System, system_preset

__all__ = ["QUOTED", "PRESETS", "preset_values", "preset_notes", "quoted_links", "ModelRequest",
           "calibration_request", "IN_NETWORK_ON_ONE_NODE"]

#: Why ``--in-network`` is refused on one node (the step report's and the sweep's word).
IN_NETWORK_ON_ONE_NODE = ("--in-network: the network's switches reduce across nodes, and one "
                          "node has no network to cross; give --nodes 2 or more")

#: How a bandwidth may be quoted: the words the options take, and what they mean.
QUOTED = {"bidirectional": True, "unidirectional": False}

#: Named sets of option values (``--preset``); an option given on the command line wins.
#: ``seed``: 8 nodes × 8 GPUs, NVLink 300 GB/s per direction, a 25 GB/s NIC per GPU, a
#: 7-billion-parameter fp32 gradient (28 GB), forward 2 s and backward 4 s.
PRESETS = {
    "seed": {"nodes": "8", "gpus_per_node": "8", "intra_bw": "300GB/s", "inter_bw": "25GB/s",
             "bidirectional": False, "params": "7e9", "bytes_per_element": "4",
             "forward": "2s", "backward": "4s"},
}


def preset_values(name: str) -> dict:
    """Return the option values of the preset ``name``; an unknown one is a UsageError.

    A system preset (:data:`~refcoll.model.systems.SYSTEM_PRESETS`: ``dgx-h100``...)
    gives its GPUs per node, links and generation, on one node as its sweep prices it
    (``--nodes`` says how many); the model is the options'.
    """
    if name in SYSTEM_PRESETS:
        system = System(**system_preset(name))
        line = (system.gen.nvlink_links * system.gen.nvlink_line if system.nvlink
                else PCIE_GBPS[system.pcie_gen])  # per GPU and direction, as quoted
        if system.intra == "pcie" and not system.p2p:
            line /= 2  # through host memory: each byte crosses the root port twice
        values = {"nodes": "1", "gpus_per_node": str(system.gpus_per_node),
                  "gpu_arch": system.generation,
                  "intra_bw": f"{line / 1e9:.6g}GB/s", "bidirectional": False}
        if system.nics:
            values.update(inter_bw=f"{system.nic_bw / 1e9:.6g}GB/s",
                          nics_per_node=str(system.nics))
        return values
    if name not in PRESETS:
        raise UsageError(f"unknown preset {name!r} (--preset): choose "
                         f"{', '.join(sorted(PRESETS) + sorted(SYSTEM_PRESETS))}")
    return dict(PRESETS[name])


def preset_notes(name: str) -> list[str]:
    """Return what the step report cannot express of system preset ``name`` (its sweep can):
    a transport other than InfiniBand, PCIe through host memory."""
    if name not in SYSTEM_PRESETS:
        return []
    system = System(**system_preset(name))
    notes = []
    if system.nics and system.transport != "ib":
        notes.append(f"not expressed: {name}'s NICs are {system.transport}; the step report "
                     "prices them as InfiniBand at their line rate (refcoll model --preset "
                     f"{name} --sweep prices {system.transport}'s floor and achieved fraction)")
    if system.intra == "pcie" and not system.p2p:
        notes.append(f"not expressed: {name}'s GPUs talk through host memory (no PCIe P2P); "
                     "the step report prices half the PCIe rate as their link (--sweep "
                     "prices the host path)")
    return notes


def _quoted(text: str | None, option: str) -> bool | None:
    if text is None:
        return None
    if text not in QUOTED:
        raise UsageError(f"{option} {text!r}: say {' or '.join(QUOTED)}")
    return QUOTED[text]


def quoted_links(both: bool | None, intra: str | None, inter: str | None) -> tuple[bool, bool]:
    """Return whether the intra- and inter-node bandwidths count both directions added.

    ``intra`` and ``inter`` (``unidirectional``, ``bidirectional`` or None) say it
    per link and override ``both`` (``--bidirectional``/``--unidirectional``;
    None: not said). A link nobody said it for is a :class:`UsageError`.
    """
    intra_both = both if intra is None else _quoted(intra, "--intra-quoted")
    inter_both = both if inter is None else _quoted(inter, "--inter-quoted")
    if intra_both is None or inter_both is None:
        raise UsageError("say how the bandwidths are quoted: --unidirectional (per direction) "
                         "or --bidirectional (both directions added), or per link with "
                         "--intra-quoted and --inter-quoted")
    return intra_both, inter_both


def _cluster(nodes, gpus_per_node, intra_bw, inter_bw, bidirectional, intra_quoted,
             inter_quoted, intra_latency, inter_latency, in_network, reduce_bw, *,
             params, layers_text, nics_per_node=None, channels=None, rail=True, spine_bw=None,
             gpu_arch="hopper") -> Cluster:
    if nodes is None or gpus_per_node is None:
        raise UsageError("give --nodes and --gpus-per-node (or --calibrate)")
    nodes = parse_count(nodes, name="--nodes", example="4")
    gpus_per_node = parse_count(gpus_per_node, name="--gpus-per-node", example="8")
    if in_network and nodes < 2:
        raise UsageError(IN_NETWORK_ON_ONE_NODE)
    if bidirectional is None:  # a link that is absent takes the other's figure, as quoted
        if nodes == 1 and inter_bw is None and inter_quoted is None:
            inter_quoted = intra_quoted
        if gpus_per_node == 1 and intra_bw is None and intra_quoted is None:
            intra_quoted = inter_quoted
    intra_both, inter_both = quoted_links(bidirectional, intra_quoted, inter_quoted)
    if (params is None) == (layers_text is None):
        raise UsageError("give the model as exactly one of --params N or --layers FILE")
    if gpus_per_node > 1 and intra_bw is None or nodes > 1 and inter_bw is None:
        raise UsageError("give --intra-bw (more than one GPU per node) and --inter-bw (more "
                         "than one node)")
    # A link that is absent (one GPU a node, or one node) takes the other's figure.
    intra_b = parse_bandwidth(intra_bw, name="--intra-bw") if intra_bw is not None else None
    inter_b = parse_bandwidth(inter_bw, name="--inter-bw") if inter_bw is not None else None
    return Cluster(nodes, gpus_per_node, intra_b or inter_b, inter_b or intra_b,
                   intra_latency=parse_duration(intra_latency, name="--intra-latency",
                                                unit=True),
                   inter_latency=parse_duration(inter_latency, name="--inter-latency",
                                                unit=True),
                   intra_bidirectional=intra_both, inter_bidirectional=inter_both,
                   in_network=in_network,
                   reduce_bw=parse_bandwidth(reduce_bw, name="--reduce-bw", zero=True),
                   nics=(parse_count(nics_per_node, name="--nics-per-node", example="8")
                         if nics_per_node is not None else None),
                   channels=(parse_count(channels, name="--channels", example="8")
                             if channels is not None else None),
                   rail=rail,
                   spine_bw=(parse_bandwidth(spine_bw, name="--spine-bw")
                             if spine_bw is not None else None),
                   gpu_arch=gpu_arch)


def _workload(params, layers_text, bytes_per_element, forward, backward,
              layers_name: str = "the layers file") -> Workload:
    compute = dict(bytes_per_element=parse_count(bytes_per_element, name="--bytes-per-element",
                                                 example="4"),
                   forward=parse_duration(forward, name="--forward"),
                   backward=parse_duration(backward, name="--backward"))
    if layers_text is not None:
        return Workload(load_layers(layers_text, layers_name), **compute)
    return Workload.from_params(parse_count(params, name="--params", example="1.3e9"),
                                **compute)


def _bucket_count(workload: Workload, buckets, bucket_size) -> int:
    if buckets is not None and bucket_size is not None:
        raise UsageError("give --buckets or --bucket-size, not both")
    if bucket_size is not None:
        return buckets_for_size(workload, parse_size(bucket_size, name="--bucket-size"),
                                name="--bucket-size")
    if buckets is not None:
        return check_buckets(parse_count(buckets, name="--buckets", minimum=None, example="25"),
                             workload, name="--buckets")
    return 1


@dataclass(frozen=True)
class ModelRequest:
    """``refcoll model``'s question: its options as the user wrote them, each with its default.

    One object for the many settings of one call, as Gloo's ``AllreduceOptions`` holds
    an all-reduce's: every field is the option of the same name (``layers_text`` the
    contents of ``--layers FILE``, ``layers_name`` what a refusal of it calls it), and
    numbers with units are read by :mod:`refcoll.core.units` when :meth:`plan` runs.
    ``compressor`` is one spec or a sequence of them (``--compressor`` repeated);
    ``search`` runs the automatic search for the best stack as well.

    Example:
        >>> ModelRequest(nodes="2", gpus_per_node="8", intra_bw="300GB/s",
        ...              inter_bw="50GB/s", bidirectional=False, params="7e9").plan()
        ... # doctest: +SKIP
    """

    nodes: str | None = None
    gpus_per_node: str | None = None
    intra_bw: str | None = None
    inter_bw: str | None = None
    bidirectional: bool | None = None
    intra_quoted: str | None = None
    inter_quoted: str | None = None
    intra_latency: str = "2us"
    inter_latency: str = "5us"
    in_network: bool = False
    reduce_bw: str = "1TB/s"
    params: str | None = None
    layers_text: str | None = None
    bytes_per_element: str = "4"
    forward: str = "0"
    backward: str = "0"
    algorithm: str | None = "all"
    inter: str = "ring"
    compressor: object = None
    pattern: str | None = None
    buckets: str | None = None
    bucket_size: str | None = None
    nics_per_node: str | None = None
    channels: str | None = None
    rail: bool = True
    spine_bw: str | None = None
    gpu_arch: str = "hopper"
    search: bool = False
    layers_name: str = "the layers file"

    def plan(self) -> Plan:
        """Return the plan these options ask for (and the search's, with ``search``).

        Raises:
            UsageError: the first option that is missing, unreadable or out of range,
                named, with what to give instead.
        """
        cluster = _cluster(self.nodes, self.gpus_per_node, self.intra_bw, self.inter_bw,
                           self.bidirectional, self.intra_quoted, self.inter_quoted,
                           self.intra_latency, self.inter_latency, self.in_network,
                           self.reduce_bw, params=self.params, layers_text=self.layers_text,
                           nics_per_node=self.nics_per_node, channels=self.channels,
                           rail=self.rail, spine_bw=self.spine_bw, gpu_arch=self.gpu_arch)
        workload = _workload(self.params, self.layers_text, self.bytes_per_element,
                             self.forward, self.backward, self.layers_name)
        algorithms = select_algorithms(self.algorithm, in_network=self.in_network)
        count = _bucket_count(workload, self.buckets, self.bucket_size)
        given = self.compressor
        specs = tuple(dict.fromkeys((given,) if isinstance(given, str)
                                    else tuple(given or ())))  # each spec once, in order
        if any(not spec.strip() for spec in specs):  # (an empty one was ignored in silence)
            raise UsageError("--compressor '' names no compressor: give a spec such as fp16 "
                             "or topk:ratio=0.01, or drop the option")
        options = Options(algorithms, specs[0] if specs else None, self.pattern, count,
                          self.inter, specs[1:])
        return (plan_and_search if self.search else plan)(cluster, workload, options)


#: The fields :func:`calibration_options` reads: ``(name, whole number, least, most)``.
#: Seconds per message and per byte are finite and not negative (at most a second a byte:
#: slower is no link); the nodes and ranks per node are whole numbers.
_CALIBRATION_FIELDS = (("alpha", False, 0.0, 3600.0), ("beta", False, 0.0, 1.0),
                       ("gamma_per_byte", False, 0.0, 1.0), ("inter_alpha", False, 0.0, 3600.0),
                       ("inter_beta", False, 0.0, 1.0), ("nodes", True, 0, MAX_GPUS),
                       ("per_node", True, 0, MAX_GPUS))

#: The fewest seconds per byte a link or a reduction may take (1 EB/s): a figure below it
#: is a broken file, and its reciprocal would not be a bandwidth.
_LEAST_PER_BYTE = 1e-18


def calibration_options(path) -> dict:
    """Return ``refcoll model``'s option values for the cluster a two-level calibration measured.

    ``path`` is the JSON ``refcoll model --calibrate --json`` wrote across nodes
    (or a calibration record alone): nodes and ranks per node as measured, one
    NIC a node at the β measured across nodes, the intra-node link at the β
    measured inside one, both quoted one way, their α as latencies, and γ as
    the reduction rate. The file is read through :mod:`refcoll.core.reading` (a
    regular file of bounded JSON) and every field checked
    (:data:`_CALIBRATION_FIELDS`).

    Raises:
        UsageError: the file is unreadable, is not such a JSON, holds a number that
            is missing, not finite or out of range, or holds a one-level calibration.
    """
    where = f"{path} (--from-calibration)"
    data = loads_json(read_bytes(path, max_bytes=MAX_JSON_BYTES,
                                 what="calibration (--from-calibration)"), source=where)
    record = data.get("calibration", data) if isinstance(data, dict) else data
    if not isinstance(record, dict):
        raise UsageError(f"{where} is not the JSON of refcoll model --calibrate --json: it "
                         "must be an object holding the calibration")
    missing = [name for name, *_ in _CALIBRATION_FIELDS if name not in record]
    if missing:
        raise UsageError(f"{where} is not the JSON of refcoll model --calibrate --json: it "
                         f"lacks {', '.join(missing)}")
    fields = {name: number(record[name], where=f"{where}: {name}", integer=whole, least=least,
                           most=most)
              for name, whole, least, most in _CALIBRATION_FIELDS}
    if fields["nodes"] < 2 or fields["inter_beta"] <= 0:
        raise UsageError(f"{path} (--from-calibration) was measured on one node: run refcoll "
                         "model --calibrate across the nodes (refcoll cluster run -- refcoll "
                         "model --calibrate --json FILE)")
    number(fields["per_node"], where=f"{where}: per_node", least=1)
    per_byte = {"intra_bw": fields["beta"], "inter_bw": fields["inter_beta"],
                "reduce_bw": fields["gamma_per_byte"]}
    for option, value in per_byte.items():
        name = {"intra_bw": "beta", "inter_bw": "inter_beta"}.get(option, "gamma_per_byte")
        if value == 0 and option != "reduce_bw":  # a free reduction is a rate; a free link not
            raise UsageError(f"{where}: {name}: 0 s/B, a link of no cost per byte: the "
                             "calibration measured none (noise); measure it again")
        if 0 < value < _LEAST_PER_BYTE:
            raise UsageError(f"{where}: {name}: must be 0 or at least {_LEAST_PER_BYTE:g} s/B "
                             f"(1 EB/s), not {value!r}")
    return {"nodes": str(fields["nodes"]), "gpus_per_node": str(fields["per_node"]),
            **{k: f"{1 / v!r}B/s" if v > 0 else "0" for k, v in per_byte.items()},
            "intra_latency": f"{fields['alpha']!r}s",
            "inter_latency": f"{fields['inter_alpha']!r}s",
            "nics_per_node": "1", "intra_quoted": "unidirectional",
            "inter_quoted": "unidirectional"}


def calibration_request(nprocs, sizes) -> tuple[int, list[int]]:
    """Return ``--calibrate``'s ``(processes, byte sizes)`` from ``-n`` and ``--sizes``.

    Raises:
        UsageError: fewer than 2 processes (one cannot measure messages), or
            sizes that are unreadable, not positive or over :data:`CALIBRATE_LIMIT`.
    """
    nprocs = parse_count(nprocs, name="-n", minimum=None, example="2")
    if nprocs < 2:
        raise UsageError(f"-n {nprocs}: --calibrate needs at least 2 processes to measure "
                         f"messages; give -n 2 or more")
    return nprocs, parse_sizes(sizes, name="--sizes", largest=CALIBRATE_LIMIT)
