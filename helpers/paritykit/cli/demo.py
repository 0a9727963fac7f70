"""`paritykit demo`: the worked example."""

from __future__ import annotations

import sys

import click


@click.command()
@click.option(
    "--out",
    "out_dir",
    default="demo-output",
    show_default=True,
    type=click.Path(file_okay=False),
    help="Folder for the PNGs, JSON reports and files the demo writes (replaced on each run).",
)
def demo(out_dir: str) -> None:
    """Port a tiny research model, find a real-world parity bug (one knob meaning two things), verify the fix.

    Exit 0 when every step ran as designed: the bug is found and the fixed port matches.
    """
    from paritykit.demo.run import run_demo

    sys.exit(run_demo(out_dir).exit_code)
