"""The ``paritykit`` command: a thin shell over the library.

Sub-commands are registered by name and imported only when invoked, so ``paritykit --help`` and the
torch-free commands (``skills``, ``new``) never import torch or diffusers.
"""

from __future__ import annotations

import importlib
import sys

import click

from paritykit._version import __version__
from paritykit.base.errors import ParityKitError, UserCodeError

# name -> (module:attribute, one-line help shown by `paritykit --help` without importing the module)
COMMANDS: dict[str, tuple[str, str]] = {
    "compare": (
        "paritykit.cli.compare:compare",
        "Compare tensors, tensor files, folders or saved checkpoints.",
    ),
    "config-diff": ("paritykit.cli.configs:config_diff", "Diff two model/pipeline configs key by key."),
    "weights": (
        "paritykit.cli.weights:weights",
        "Diff two checkpoints, or infer the conversion between them.",
    ),
    "triage": (
        "paritykit.cli.triage:triage",
        "From a reference pipeline and its port to the cause, in one run.",
    ),
    "bisect": (
        "paritykit.cli.bisect:bisect",
        "Name the first module where a port diverges from its reference.",
    ),
    "trace": ("paritykit.cli.bisect:trace", "Capture one side's module inputs/outputs to a folder."),
    "steps": ("paritykit.cli.visual:steps", "Per-step error curve of two denoising runs."),
    "schedule": (
        "paritykit.cli.schedule:schedule",
        "Compare sampling schedules, or fit a scheduler config to a reference loop.",
    ),
    "images": ("paritykit.cli.visual:images", "Side-by-side images with a diff heatmap and PSNR."),
    "new": ("paritykit.cli.new:new", "Render tests, pipeline stubs and scripts from templates."),
    "skills": ("paritykit.cli.skills:skills", "List, show, validate and install the agent skill pack."),
    "demo": ("paritykit.cli.demo:demo", "Run the worked example: find a real parity bug end to end."),
}


# click >= 8.2 raises this for a group called without a sub-command; click 8.1 prints the help and exits 0
_NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())


class LazyGroup(click.Group):
    """A click group that imports a sub-command's module only when that sub-command runs."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        target, _ = COMMANDS[name]
        module_name, attr = target.split(":")
        return getattr(importlib.import_module(module_name), attr)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, COMMANDS[name][1]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def main(self, args=None, prog_name=None, **extra):  # noqa: D401 - click signature
        """Run with paritykit's error conventions: one line and exit 2 for user mistakes."""
        quiet_progress_bars()
        argv = list(sys.argv[1:] if args is None else args)
        as_json = "--json" in argv
        extra.pop("standalone_mode", None)
        try:
            rv = super().main(args=argv, prog_name=prog_name or "paritykit", standalone_mode=False, **extra)
        except click.exceptions.Exit as exc:
            sys.exit(exc.exit_code)
        except click.exceptions.Abort:
            _fail("aborted", as_json, 1)
        except _NO_ARGS_IS_HELP as exc:
            # a group run without its sub-command (`paritykit`, `paritykit weights`): show its help, as click
            # 8.1 and `paritykit new` do, instead of squeezing the whole help text into one error line
            click.echo(exc.ctx.get_help())
            sys.exit(0)
        except click.ClickException as exc:
            _fail(exc.format_message(), as_json, exc.exit_code)
        except UserCodeError as exc:
            _fail(str(exc), as_json, exc.exit_code, detail=exc.detail)
        except ParityKitError as exc:
            _fail(str(exc), as_json, exc.exit_code)
        except KeyboardInterrupt:
            _fail("interrupted", as_json, 130)
        sys.exit(rv if isinstance(rv, int) else 0)


def _fail(message: str, as_json: bool, code: int, detail: str = "") -> None:
    message = " ".join(message.split()) if not detail else message.strip()
    if as_json:
        from paritykit.base.report import to_json

        payload = {"error": message}
        if detail:
            payload["traceback"] = detail
        click.echo(to_json(payload))
    else:
        click.echo(f"paritykit: error: {message}", err=True)
        if detail:
            click.echo(detail.rstrip(), err=True)
    sys.exit(code)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="paritykit", message="%(prog)s %(version)s")
def cli() -> None:
    """paritykit: prove that a diffusers port matches its research reference.

    \b
    Exit codes for every command:
      0  same / done
      1  differ / diverge / something unexplained
      2  bad input or usage (one line naming the file or argument)
    Add --json to a report command for strict JSON (schema_version 1) on stdout.
    """


def quiet_progress_bars() -> None:
    r"""Where stderr is no terminal (an agent reading ``2>&1``, a log file), the progress bars of the code
    paritykit runs (a research sampler's or a diffusers pipeline's tqdm bars, redrawn at every step) stay
    off: ``TQDM_DISABLE=1``, unless the caller set ``TQDM_DISABLE`` already. Nothing else of that code
    changes."""
    import os

    if not sys.stderr.isatty():
        os.environ.setdefault("TQDM_DISABLE", "1")


def main() -> None:
    """Console-script entry point."""
    cli.main()
