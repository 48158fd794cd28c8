"""``refcoll cluster``: an emulated cluster on this machine (namespaces, veth links, ``tc``).

::

    refcoll cluster up --nodes 2 --ranks-per-node 2 --link 1gbit [--delay 50us]
    refcoll cluster run -- refcoll bench -b 1M -e 64M -f 4 --against mpi
    refcoll cluster check            # each link's rate and round trip, measured
    refcoll cluster status
    refcoll cluster down             # --force: a cluster a running job holds too
"""

from __future__ import annotations

import json
import re
import signal
import sys

import click

from ..cluster import emulate, launch
from ..cluster.check import format_links, measure_links
from ..core.errors import UsageError
from .common import main, reports_errors

__all__ = ["cluster"]


@main.group()
def cluster():
    """An emulated cluster: a network namespace per node, shaped links (needs root)."""


def _per_node(values, option: str, example: str) -> dict:
    out = {}
    for value in values:
        node, sep, what = value.partition("=")
        if not sep or not re.fullmatch(r"[0-9]{1,9}", node.strip()) or not what.strip():
            raise UsageError(f"{option} {value!r}: write NODE=VALUE, e.g. {example}")
        out[int(node)] = what.strip()
    return out


def _left(force: bool) -> None:
    """Say, one line each, which clusters a running job holds and were left."""
    if force:
        return
    for state in emulate.live_clusters():
        click.echo(f"refcoll: left cluster {state['prefix']}: {state['held_by']} (refcoll "
                   "cluster down --force removes it)", err=True)


# the bounds are ClusterSpec.check's, so that a number out of them is one line
@cluster.command()
@click.option("--nodes", type=int, default=2, show_default=True,
              help=f"Nodes, 1 to {emulate.MAX_NODES}.")
@click.option("--ranks-per-node", type=int, default=2, show_default=True,
              help=f"Ranks on each node, 1 to {emulate.MAX_RANKS_PER_NODE}.")
@click.option("--link", default="1gbit", show_default=True,
              help="Every node's link rate, as tc writes it (1gbit, 100mbit) or 1Gbit/s.")
@click.option("--node-link", "node_links", multiple=True, metavar="NODE=RATE",
              help="One node's own link rate (a slower node), e.g. 2=100mbit.")
@click.option("--node-ranks", "node_ranks", multiple=True, metavar="NODE=RANKS",
              help="One node's own rank count (uneven nodes), e.g. 1=3.")
@click.option("--delay", default=None,
              help=f"Added one-way delay per link (netem), e.g. 50us; at most "
                   f"{emulate.MAX_DELAY_S:g}s.")
@click.option("--racks", type=int, default=1, show_default=True,
              help="Nodes grouped in racks, whose bridges a core bridge joins.")
@click.option("--oversubscription", type=float, default=1.0, show_default=True,
              help="A rack uplink's rate is its nodes' links over this (1 to "
                   f"{emulate.MAX_OVERSUBSCRIPTION}).")
@click.option("--force", is_flag=True,
              help="Remove a cluster a running job holds (with Cluster(...)) too.")
@reports_errors
def up(nodes, ranks_per_node, link, node_links, node_ranks, delay, racks, oversubscription,
       force):
    """Build the cluster (a second up replaces the first; a running job's is left)."""
    ranks = _per_node(node_ranks, "--node-ranks", "1=3")
    for node, count in ranks.items():
        if not re.fullmatch(r"[0-9]{1,9}", count):
            raise UsageError(f"--node-ranks {node}={count}: a whole number of ranks")
    spec = emulate.ClusterSpec(nodes=nodes, ranks_per_node=ranks_per_node, link=link,
                               node_links=_per_node(node_links, "--node-link", "2=100mbit"),
                               node_ranks={n: int(c) for n, c in ranks.items()}, delay=delay,
                               racks=racks, oversubscription=oversubscription)
    _cleanup_on_signals()  # a kill unwinds through the build's own cleanup
    made = emulate.up(spec, force=force)
    _left(force)
    uneven = "".join(f", node {node} {count}" for node, count in ranks.items())
    click.echo(f"cluster {made.prefix}: {nodes} nodes x {ranks_per_node} ranks{uneven}, "
               f"links {link}"
               + (f", delay {delay}" if delay else "") +
               (f", {racks} racks, uplinks oversubscribed {oversubscription:g}x"
                if racks > 1 else ""))
    for node in made.describe()["nodes"]:
        click.echo(f"  node {node['node']}: host {node['host']}, {node['address']}, rack "
                   f"{node['rack']}, link {node['link']}, {node['ranks']} ranks")
    click.echo(f"topology: {made.topology_file} (REFCOLL_TOPO_FILE); state: {made.state_file}")


@cluster.command()
@click.option("--force", is_flag=True,
              help="Remove a cluster a running job holds (with Cluster(...)) too.")
@reports_errors
def down(force):
    """Remove the cluster: its processes, namespaces and files (a running job's is left)."""
    gone = emulate.down(force=force)
    held = [] if force else emulate.live_clusters()
    click.echo(f"removed {', '.join(gone)}" if gone else
               "no cluster removed" if held else "no cluster was up")
    _left(force)


@cluster.command()
@click.option("--json", "as_json", is_flag=True, help="The state as JSON.")
@reports_errors
def status(as_json):
    """Show the cluster that is up; a state file refcoll cannot trust is an error (exit 2)."""
    states = emulate.status()
    problems = [state["problem"] for state in states if "problem" in state]
    if as_json:
        click.echo(json.dumps(states, indent=1))
    elif not states:
        click.echo("no cluster is up")
    for state in [] if as_json else states:
        if "problem" in state:
            continue
        spec = state.get("spec", {})
        whole = "complete" if state["complete"] else "INCOMPLETE (refcoll cluster down)"
        held = f", held by process {state['owner']}" if state["live"] else ""
        click.echo(f"cluster {state['prefix']}: {spec.get('nodes', '?')} nodes x "
                   f"{spec.get('ranks_per_node', '?')} ranks, link {spec.get('link', '?')}, "
                   f"{whole}{held}")
    for problem in problems:  # after what could be read: one line each, then exit 2
        click.echo(f"refcoll: error: {problem}", err=True)
    if problems:
        sys.exit(2)


def _the_cluster() -> emulate.Cluster:
    """The cluster ``up`` made (else the first there is), from a state file refcoll trusts;
    a state file it cannot trust is named, not taken for no cluster."""
    states, bad = emulate.scanned()
    if bad:
        raise UsageError(f"{bad[0]}; refcoll runs on no cluster while it is there "
                         "(refcoll cluster status names it)")
    if not states:
        raise UsageError("no cluster is up: refcoll cluster up first")
    states = [state for state in states if "spec" in state]  # the others: only removable
    detached = [state for state in states if state.get("detached")]
    if not states:
        raise UsageError("no cluster is up that refcoll can run on: refcoll cluster up first")
    # An up killed while it removed the cluster before leaves that one incomplete: the
    # complete one, the newest, is the one up made.
    whole = {state["prefix"]: state["complete"] for state in emulate.status() if "prefix" in state}
    chosen = max(detached or states, key=lambda state: (whole.get(state["prefix"], False),
                                                        state.get("owner_start") or 0))
    return emulate.attach(chosen)


def _cleanup_on_signals() -> None:
    """Make SIGTERM and SIGHUP unwind as Ctrl-C does, so that what a command started in the
    namespaces is removed when it is killed or its terminal closes."""
    for sig, code in ((signal.SIGTERM, 143), (signal.SIGHUP, 129)):
        signal.signal(sig, lambda *_, code=code: sys.exit(code))


@cluster.command(context_settings={"allow_interspersed_args": False})
@click.option("-n", "--np", "nprocs", type=click.IntRange(min=1), default=None,
              help="Processes (default: every rank of every node).")
@click.option("--launcher", type=click.Choice(launch.LAUNCHERS), default="mpich",
              show_default=True,
              help="MPICH's mpiexec on node 1, Open MPI's mpirun on node 1 (the one beside "
                   "the command's python), or a torchrun agent per node.")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@reports_errors
def run(nprocs, launcher, command):
    """Run COMMAND on the ranks across the nodes (options after COMMAND are its own)."""
    made = _the_cluster()
    ranks = made.spec.total_ranks
    if nprocs is not None and nprocs > ranks:
        raise UsageError(f"-n {nprocs}: cluster {made.prefix} has {ranks} ranks "
                         f"({made.spec.nodes} nodes); give -n {ranks} or fewer, or bring it "
                         "up with more --ranks-per-node")
    _cleanup_on_signals()  # run's cleanup on a kill or a hang-up
    with emulate.using(made):  # up and down leave a cluster a job holds
        code = made.run(list(command), nprocs, launcher=launcher).returncode
    sent = sum(tx for tx, _ in made.last_traffic.values())
    click.echo(f"# cluster {made.prefix}: bytes sent over the nodes' links: " + ", ".join(
        f"node {i} {tx} B" for i, (tx, _) in sorted(made.last_traffic.items()))
        + f" ({sent} B in all)", err=True)
    if code < 0:  # the launcher was killed by a signal: say so, exit as a shell would
        name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
        click.echo(f"refcoll: error: the {launcher} launcher was killed by {name}", err=True)
        code = 128 - code
    sys.exit(code)


@cluster.command()
@reports_errors
def check():
    """Measure each link's rate, one way and both ways at once, and its round trip (a TCP
    socket), beside what was asked."""
    made = _the_cluster()
    _cleanup_on_signals()  # the measuring processes go with a killed check
    with emulate.using(made):
        lines = format_links(measure_links(made))
    for line in lines:
        click.echo(line)
