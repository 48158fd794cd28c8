"""``refcoll tune``: the algorithm bench measured fastest at each size, as a file auto reads."""

from __future__ import annotations

import json

import click

from ..calls.tuned import TUNING_ENV, from_bench, parse, read_report
from ..core.writing import write_text
from .common import check_not_inputs, check_output_paths, main, reports_errors

__all__ = ["tune"]


@main.command()
@click.argument("reports", nargs=-1, required=True, metavar="BENCH_JSON...")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False),
              help="The tuning file to write.")
@reports_errors
def tune(reports, output):
    """Write a tuning file from refcoll bench --json runs: at each size, the fastest algorithm.

    Bench the algorithms auto should choose among, by name, on the job's ranks
    and nodes (refcoll bench --algorithm ring,hierarchical,'hierarchical(pipeline=8)'
    --json bench.json); then refcoll tune bench.json -o tuning.json, and run
    with REFCOLL_TUNING_FILE=tuning.json: auto runs each size's fastest, where
    the job's collective, ranks and nodes match a table and the size lies within
    a factor of 2 of those measured; elsewhere it prices as before. Several
    reports give several tables (collectives, layouts). Exit 2, writing nothing, on a
    file that is not a regular file of JSON or not a bench report (a row that is not
    an object, lacks its algorithm or size, or holds a number out of range).
    """
    check_not_inputs({"--output": output}, {"BENCH_JSON": list(reports)})
    check_output_paths(output=output)
    document = from_bench([(path, read_report(path)) for path in reports])
    text = json.dumps(document, indent=1) + "\n"
    parse(text, output)  # what auto will read back: every rule runs its collective
    write_text(output, text)  # a temporary renamed over it: a link there is replaced
    for table in document["tables"]:
        click.echo(f"{table['collective']} on {table['ranks']} ranks ({table['nodes']} nodes x "
                   f"{table['per_node']}), from {table['from']}:")
        for rule in table["rules"]:
            click.echo(f"  {rule['bytes']:>12} B  {rule['algorithm']}  ({rule['time_us']:.1f} us)")
    click.echo(f"wrote {output}: run with {TUNING_ENV}={output}")
