"""``refcoll spec`` and ``refcoll vectors``: the spec pages' generated blocks, golden vectors."""

from __future__ import annotations

import os
import sys

import click

from ..core.errors import RefcollError, UsageError
from ..verify import spec_pages
from ..verify import vectors as golden
from .common import check_output_directory, main, reports_errors

__all__ = ["spec", "vectors"]


@main.command()
@click.option("--write", is_flag=True, help="Rewrite the stale blocks in place.")
@click.option("--check", is_flag=True, help="Exit 1 if any page differs from the code.")
@click.argument("paths", nargs=-1)
@reports_errors
def spec(write, check, paths):
    """Regenerate or check the spec pages' generated blocks, or print one block.

    PATHS are spec pages or folders of them (default: spec). Without --write or
    --check, print one block: refcoll spec step_table algorithm=ring p=4 n=4
    (kinds: step_table, reduction_tree; other key=value pairs as in the pages'
    markers).
    """
    if write and check:
        raise UsageError("give --write or --check, not both")
    try:
        if not (write or check):
            click.echo(spec_pages.render_block(paths))
            return
        stale = spec_pages.stale_pages(paths or ["spec"], write=write)
    except (RefcollError, TypeError, ValueError) as exc:  # a bad block is bad usage
        raise UsageError(str(exc)) from None
    for page in stale:
        click.echo(f"{page}: {'rewritten' if write else 'differs from the code'}")
    if check and stale:
        click.echo("run: refcoll spec --write " + " ".join(paths or ["spec"]), err=True)
        sys.exit(1)


@main.command()
@click.option("--verify", "check", is_flag=True,
              help="Re-simulate every vector and check every sha256 instead of writing them.")
@click.argument("directory", type=click.Path())
@reports_errors
def vectors(check, directory):
    """Write refcoll's golden test vectors into DIRECTORY, or check them (e.g. spec/vectors).

    DIRECTORY must be new, empty, or one this command wrote (it holds refcoll's
    manifest.json): only the vectors that manifest named are ever replaced or removed.
    """
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise UsageError(f"{directory}: is not a folder; give the vectors' folder")
    if check:
        manifest = golden.read_manifest(directory)
        problems = golden.verify(directory)
        for line in problems:
            click.echo(line)
        click.echo(f"{len(manifest['vectors'])} vectors, {len(problems)} mismatches")
        sys.exit(1 if problems else 0)
    check_output_directory("DIRECTORY", directory)
    manifest = golden.generate(directory)
    click.echo(f"wrote {manifest['count']} vectors and manifest.json to {directory}")
