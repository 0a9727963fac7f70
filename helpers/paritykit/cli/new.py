"""`paritykit new …`: render templates into tests, pipeline stubs and scripts (torch-free)."""

from __future__ import annotations

import click

from paritykit.pack.scaffold import generate, template_list, templates

out_option = click.option(
    "--out",
    "out_dir",
    default=".",
    show_default=True,
    metavar="DIR",
    help="Folder for the generated file (created if missing); files are named after NAME and the template.",
)
force_option = click.option("--force", is_flag=True, help="Overwrite an existing file.")
atol_option = click.option(
    "--atol",
    metavar="X",
    help="Absolute tolerance written into the test [default: none: paritykit's per-dtype defaults].",
)
rtol_option = click.option(
    "--rtol",
    metavar="X",
    help="Relative tolerance written into the test [default: none: paritykit's per-dtype defaults].",
)


pipeline_option = click.option(
    "--pipeline",
    required=True,
    metavar="MODULE:CLASS",
    help="The port's pipeline class (built with from_pretrained(--pretrained)), or a function returning one.",
)
reference_option = click.option(
    "--reference",
    required=True,
    metavar="MODULE:CALLABLE",
    help="Returns the reference model (an nn.Module) when called with no arguments.",
)
pretrained_option = click.option(
    "--pretrained", metavar="DIR", help="The saved port pipeline for from_pretrained (need not exist yet)."
)


def _generate(kind: str, name: str, out_dir: str, force: bool, **options) -> None:
    click.echo(generate(kind, name, out_dir=out_dir, force=force, **options).render())


@click.group(invoke_without_command=True)
@click.option("--list", "show_list", is_flag=True, help="List every template with one line and exit.")
@click.pass_context
def new(ctx: click.Context, show_list: bool) -> None:
    """Render a template into code that runs as generated (never overwrites without --force).

    Order of work: config-diff first, then a component-test per component, a pipeline-stub with
    named checkpoints (pipeline-stub --modular: the modular file set), and stage-test (encode, decode,
    denoise). When a whole pipeline does not match, triage-spec: `paritykit triage` names the place; when a
    module does not, bisect-spec: `paritykit bisect` names the submodule. Once parity is shown,
    diffusers-tests renders the tests of the pull request (it runs the model and the reference).
    """
    if show_list:
        click.echo(template_list())
        ctx.exit(0)
    if ctx.invoked_subcommand is None:
        click.echo(ctx.get_help())


@new.command("component-test")
@click.argument("name")
@reference_option
@click.option(
    "--diffusers",
    required=True,
    metavar="CLASS",
    help="The port's class: a diffusers class name (UNet2DModel) or MODULE:CLASS.",
)
@click.option(
    "--convert",
    metavar="MODULE:FUNC",
    help="convert(state_dict) -> state_dict (or a model), e.g. a module from `weights map --emit-rules`.",
)
@click.option(
    "--pretrained", metavar="DIR", help="The converted model saved with save_pretrained (need not exist yet)."
)
@click.option(
    "--inputs",
    metavar="MODULE:FUNC",
    help="Returns (args, kwargs) fed to both sides; default: seeded inputs shaped for the class.",
)
@atol_option
@rtol_option
@out_option
@force_option
def component_test(name: str, out_dir: str, force: bool, **options) -> None:
    """One self-contained pytest file: reference vs port, fresh conversion and saved model.

    NAME (a Python identifier) names the file: test_NAME_component.py.
    """
    _generate("component-test", name, out_dir, force, **options)


@new.command("pipeline-stub")
@click.argument("name")
@click.option(
    "--components",
    metavar="LIST",
    help=(
        "Comma list: unet or transformer, scheduler, and optionally vae, text_encoder+tokenizer "
        f"[default: {templates()['pipeline-stub'].defaults['components']}]."
    ),
)
@click.option(
    "--modular", is_flag=True, help="Render the modular-pipeline file set into modular_<name>/ instead."
)
@out_option
@force_option
def pipeline_stub(name: str, out_dir: str, force: bool, components: str | None, modular: bool) -> None:
    """A DiffusionPipeline subclass with maybe_checkpoint at text_encoding, preloop, after_step_{i},
    post_loop.

    NAME is a CamelCase model name: the class is NAMEPipeline (NAME as is if it ends in Pipeline), the file
    pipeline_<name in snake_case>.py."""
    kind = "pipeline-stub-modular" if modular else "pipeline-stub"
    _generate(kind, name, out_dir, force, components=components)


@new.command("stage-test")
@click.argument("name")
@pipeline_option
@click.option(
    "--reference",
    required=True,
    metavar="MODULE:CALLABLE",
    help="Runs the reference: reference(_checkpoints=…, seed=…, num_inference_steps=…) -> images.",
)
@pretrained_option
@atol_option
@rtol_option
@out_option
@force_option
def stage_test(name: str, out_dir: str, force: bool, **options) -> None:
    """Encode / decode / denoise tests of a pipeline against its reference via checkpoints.

    NAME (a Python identifier) names the file: test_NAME_stages.py.
    """
    _generate("stage-test", name, out_dir, force, **options)


@new.command("config-diff")
@click.argument("name")
@click.option(
    "--reference", required=True, metavar="PATH", help="Reference config (JSON, YAML, safetensors, folder)."
)
@click.option(
    "--diffusers", required=True, metavar="PATH", help="The port's config.json or model/pipeline folder."
)
@out_option
@force_option
def config_diff(name: str, out_dir: str, force: bool, **options) -> None:
    """A script that diffs the two configs first and exits 1 on any difference.

    NAME (a Python identifier) names the file: config_diff_NAME.py.
    """
    _generate("config-diff", name, out_dir, force, **options)


@new.command("bisect-spec")
@click.argument("name")
@reference_option
@click.option(
    "--port",
    required=True,
    metavar="MODULE:CALLABLE",
    help="Returns the port module (an nn.Module) when called with no arguments.",
)
@click.option(
    "--inputs",
    required=True,
    metavar="MODULE:CALLABLE",
    help="Returns the inputs both run on: (args, kwargs), a kwargs dict, a list of arguments or one tensor.",
)
@click.option(
    "--port-inputs",
    "port_inputs",
    metavar="MODULE:CALLABLE",
    help="port_inputs(args, kwargs) maps the inputs to the port's signature.",
)
@click.option(
    "--select-output",
    "select_output",
    metavar="MODULE:CALLABLE",
    help="select_output(side, output) picks the compared tensor of each side's output.",
)
@out_option
@force_option
def bisect_spec(name: str, out_dir: str, force: bool, **options) -> None:
    """A SPEC for `paritykit bisect` from your callables: no SPEC to write by hand.

    NAME (a Python identifier) names the file: bisect_NAME.py.
    """
    _generate("bisect-spec", name, out_dir, force, **options)


@new.command("triage-spec")
@click.argument("name")
@pipeline_option
@pretrained_option
@click.option(
    "--reference",
    required=True,
    metavar="MODULE:CALLABLE",
    help="Runs the reference end to end: reference(num_inference_steps=…) -> result tensor.",
)
@click.option(
    "--reference-denoiser",
    "reference_denoiser",
    required=True,
    metavar="MODULE:CALLABLE",
    help="Returns the module the reference calls once per step (the same object it uses).",
)
@click.option(
    "--reference-vae",
    "reference_vae",
    metavar="MODULE:CALLABLE",
    help="Returns the reference's decoder module (checked against the port's vae.decoder).",
)
@out_option
@force_option
def triage_spec(name: str, out_dir: str, force: bool, **options) -> None:
    """A SPEC for `paritykit triage`: both sides run end to end, their denoiser (and decoder) recorded.

    NAME (a Python identifier) names the file: triage_NAME.py.
    """
    _generate("triage-spec", name, out_dir, force, **options)


@new.command("diffusers-tests")
@click.argument("name")
@click.option(
    "--model-class",
    "model_class",
    required=True,
    metavar="CLASS",
    help="The port's model class: a diffusers class name (WanTransformer3DModel) or MODULE:CLASS.",
)
@click.option(
    "--reference",
    metavar="MODULE:CALLABLE",
    help=(
        "Returns the reference model with its weights; called with the port's required inputs in the port's"
        " forward order. With --pretrained it gives the slow test's expected slice."
    ),
)
@click.option(
    "--pretrained",
    metavar="DIR",
    help="The saved port (a save_pretrained folder): the slow test's model, and the config the tests shrink.",
)
@click.option(
    "--hub-id",
    "hub_id",
    metavar="REPO",
    help="What the slow test loads in the pull request instead of --pretrained (a Hub repository id).",
)
@click.option(
    "--convert",
    metavar="MODULE:FUNC",
    help="convert(reference state_dict) -> port state_dict: checks that --pretrained holds the conversion.",
)
@click.option(
    "--inputs",
    metavar="MODULE:FUNC",
    help=(
        "inputs(config) -> dict of the model's inputs, when they cannot be shaped from its signature; float"
        " tensors are rendered as seeded noise of their shape."
    ),
)
@click.option(
    "--pipeline",
    metavar="CLASS",
    help="The port's pipeline class (name or MODULE:CLASS): also render its fast test with tiny components.",
)
@click.option(
    "--out",
    "out_dir",
    metavar="DIR",
    help=(
        "The folder the tests/... files go into, e.g. your diffusers fork [default: a new folder"
        " diffusers-tests-NAME]; nothing is written into a fork unless it is named here."
    ),
)
@force_option
def diffusers_tests(name: str, **options) -> None:
    """The tests a diffusers pull request asks for: model tests on diffusers' tester mixins, a slow test
    whose expected slice comes from the reference (never from the port), and a pipeline test.

    NAME (snake_case) names the files: tests/models/<family>/test_models_<kind>_NAME.py and
    tests/pipelines/NAME/test_NAME.py. Unlike the other templates this one runs torch: it builds the model,
    runs the reference and measures both sides' float floor for the slow test's tolerance.
    """
    from paritykit.pack.diffusers_tests import generate_diffusers_tests

    click.echo(generate_diffusers_tests(name, **options).render())
