r"""Render the jinja2 templates behind ``paritykit new …`` into files that run as generated.

Each template in ``templates/`` is one file, ``<kind>.py.j2``, whose first lines are a jinja comment holding
its spec in YAML: a one-line summary, the output file name, how to run the result, and every variable it
needs with that variable's rule::

    {#- spec
    summary: One self-contained pytest file comparing a reference module with its diffusers port.
    output: test_{name}_component.py
    run: python -m pytest -q {filename}
    variables:
      name: identifier
      reference: target
      convert: target?        # a trailing "?" marks an optional variable
      components: components = unet,scheduler   # "= VALUE" gives a default
    -#}

A template may also be a *set*: a folder ``templates/<kind>/`` of ``*.py.j2`` files rendered together into one
output folder (``output: modular_{snake}/``); the spec sits in its ``__init__.py.j2`` and covers every file.

Rules validate the user's values and turn them into what the template uses (a ``target`` becomes an object
with ``.module`` and ``.attr``; a ``path`` becomes a Python expression). Rendering uses ``StrictUndefined``,
so a template can only use what its spec declares; files are written atomically and never overwrite an
existing file without ``force``. Torch-free: only jinja2 and PyYAML are imported.
"""

from __future__ import annotations

import keyword
import os
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from paritykit._version import __version__
from paritykit.base.data import data_dir
from paritykit.base.errors import ParityKitError
from paritykit.base.files import atomic_write_text

TEMPLATE_SUFFIX = ".py.j2"
LINE_LENGTH = 88  # ruff's default line-length: generated code passes `ruff format` with no project config
_SPEC = re.compile(r"\A\{#-?\s*spec\s*\n(?P<body>.*?)\n\s*-?#\}", re.DOTALL)
_MARKERS = re.compile(r"\{\{|\{%|\{#")

# A path literal longer than this goes on its own line: templates assign paths to top-level names of at
# most 20 characters (``PRETRAINED_DIR = ``), and ``Path("…")`` adds 6.
_PATH_INLINE = LINE_LENGTH - 20 - 6

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_CAMEL = re.compile(r"[A-Z][A-Za-z0-9]*\Z")
_DOTTED = r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*"
_TARGET = re.compile(rf"(?P<module>{_DOTTED}):(?P<attr>[A-Za-z_][A-Za-z0-9_]*)\Z")

DENOISERS = ("unet", "transformer")
COMPONENTS = ("unet", "transformer", "scheduler", "vae", "text_encoder", "tokenizer")


# --------------------------------------------------------------------------------------------------- values
@dataclass(frozen=True)
class Target:
    r"""An importable object named ``module:attr``; templates write ``from {{ x.module }} import {{ x.attr
    }}``."""

    module: str
    attr: str

    def __str__(self) -> str:
        return f"{self.module}:{self.attr}"


@dataclass(frozen=True)
class PathValue:
    r"""A path the user gave, which need not exist yet.

    ``expr`` is the Python expression the generated file uses: an absolute path stays absolute; a relative
    one is re-anchored at the generated file (``HERE / "../models/vae"``), so the file works from any cwd.
    """

    given: str
    expr: str


@dataclass(frozen=True)
class Components:
    r"""The pipeline components chosen with ``--components``, in the conventional order."""

    names: tuple[str, ...]

    @property
    def denoiser(self) -> str:
        return next(name for name in self.names if name in DENOISERS)

    @property
    def text(self) -> bool:
        return "text_encoder" in self.names

    @property
    def vae(self) -> bool:
        return "vae" in self.names

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def __iter__(self):
        return iter(self.names)

    def __str__(self) -> str:
        return ",".join(self.names)


# ----------------------------------------------------------------------------------------------- templates
@dataclass(frozen=True)
class TemplateSpec:
    r"""What one template needs, read from the spec comment at its top.

    Args:
        kind: command name, e.g. ``component-test`` (file ``component_test.py.j2``).
        summary: the one line shown by ``paritykit new --list``.
        output: output file name pattern; ``{name}`` and ``{snake}`` (NAME in snake_case) are filled in.
        run: how to run the generated file; ``{filename}`` is filled in.
        variables: variable name -> rule (``identifier``, ``camel``, ``target``, ``class``, ``path``,
            ``components``); optional ones are listed in ``optional``, defaults in ``defaults``.
        path: the template file (for a set: its ``__init__.py.j2``, which holds the spec).
        members: every template file rendered (one, or a set's files).
        command: the ``paritykit new`` words that select this template (default: ``kind``).
    """

    kind: str
    summary: str
    output: str
    run: str
    variables: dict[str, str]
    optional: frozenset[str]
    defaults: dict[str, str]
    path: Path
    members: tuple[Path, ...]
    command: str
    executable: bool = False

    def filename(self, name: str) -> str:
        return self.output.format(name=name, snake=snake_case(_strip_pipeline(name)))

    def filenames(self, name: str) -> list[str]:
        r"""Output paths relative to ``--out``: the file, or ``folder/member`` for each file of a set."""
        target = self.filename(name)
        if len(self.members) == 1 and not target.endswith("/"):
            return [target]
        return [target + member.name[: -len(".j2")] for member in self.members]


def _parse_spec(path: Path, members: tuple[Path, ...] | None = None) -> TemplateSpec:
    import yaml

    text = path.read_text(encoding="utf-8")
    match = _SPEC.match(text)
    if match is None:
        raise ParityKitError(f"template {path} has no '{{#- spec … -#}}' header")
    try:
        raw = yaml.safe_load(match.group("body"))
    except yaml.YAMLError as exc:
        raise ParityKitError(f"template {path}: spec header is not valid YAML ({exc})") from exc
    if not isinstance(raw, dict):
        raise ParityKitError(f"template {path}: spec header must be a YAML mapping")
    variables, optional, defaults = {}, set(), {}
    for var, rule in (raw.get("variables") or {}).items():
        rule, _, default = (part.strip() for part in str(rule).partition("="))
        if default:
            defaults[var] = default
        if rule.endswith("?"):
            optional.add(var)
            rule = rule[:-1]
        if rule not in _RULES:
            raise ParityKitError(f"template {path}: variable {var!r} has unknown rule {rule!r}")
        variables[var] = rule
    missing = [key for key in ("summary", "output", "run") if not raw.get(key)]
    if missing or "name" not in variables:
        raise ParityKitError(f"template {path}: spec needs summary, output, run and a 'name' variable")
    stem = path.parent.name if members else path.name[: -len(TEMPLATE_SUFFIX)]
    kind = stem.replace("_", "-")
    return TemplateSpec(
        kind=kind,
        summary=" ".join(str(raw["summary"]).split()),
        output=str(raw["output"]),
        run=str(raw["run"]),
        variables=variables,
        optional=frozenset(optional),
        defaults=defaults,
        path=path,
        members=members or (path,),
        command=str(raw.get("command") or kind),
        executable=bool(raw.get("executable", False)),
    )


def templates(directory: Path | None = None) -> dict[str, TemplateSpec]:
    r"""Every template in the pack (``templates/*.py.j2`` and sets ``templates/<kind>/``), keyed by kind.

    Args:
        directory: another template folder (tests); default: the pack's, via ``paritykit.base.data.data_dir``.
    """
    root = Path(directory) if directory is not None else data_dir("templates")
    return _templates(root.resolve())


# What every template gets besides its spec's variables (filled in by ``render``).
PROVIDED = frozenset({"kind", "filename", "command", "run", "version", "snake", "root", "import_line"})


@lru_cache(maxsize=8)
def _templates(root: Path) -> dict[str, TemplateSpec]:
    from jinja2 import meta

    env = template_environment(root)
    specs = {}
    found = [(path, None) for path in root.glob(f"*{TEMPLATE_SUFFIX}")]
    for folder in root.iterdir():
        if folder.is_dir() and (folder / f"__init__{TEMPLATE_SUFFIX}").is_file():
            members = (folder / f"__init__{TEMPLATE_SUFFIX}",)
            members += tuple(sorted(set(folder.glob(f"*{TEMPLATE_SUFFIX}")) - set(members)))
            found.append((members[0], members))
    for path, members in sorted(found, key=lambda item: str(item[0])):
        spec = _parse_spec(path, members)
        # The spec is the one place that lists a template's variables: hold the template to it (a set's
        # partials, the ``_*.j2`` its members import, count as part of the set).
        parts = spec.members if members is None else sorted(path.parent.glob("*.j2"))
        sources = (part.read_text(encoding="utf-8") for part in parts)
        used = set().union(*(meta.find_undeclared_variables(env.parse(source)) for source in sources))
        used -= PROVIDED
        undeclared, unused = sorted(used - set(spec.variables)), sorted(set(spec.variables) - used)
        if undeclared or unused:
            raise ParityKitError(
                f"template {path}: spec and template disagree (used but not declared: {undeclared}; "
                f"declared but not used: {unused})"
            )
        specs[spec.kind] = spec
    return specs


# what `paritykit new` renders besides the one-file templates: a set computed from running the model
RENDERED_SETS = {
    "diffusers-tests": (
        "The model, pipeline and slow tests a diffusers pull request asks for, in diffusers' own layout; the"
        " slow test's expected slice is the reference's output (runs the model and the reference)."
    ),
}


def template_list(directory: Path | None = None) -> str:
    r"""One line per template, and per set ``paritykit new`` renders (:data:`RENDERED_SETS`): the command
    that selects it and its summary (``paritykit new --list``)."""
    rows = [(spec.command, spec.summary) for spec in templates(directory).values()]
    rows += list(RENDERED_SETS.items()) if directory is None else []
    width = max((len(command) for command, _ in rows), default=0)
    return "\n".join(f"{command.ljust(width)}  {summary}" for command, summary in rows)


# ------------------------------------------------------------------------------------------------- rules
def _flag(var: str) -> str:
    return "NAME" if var == "name" else "--" + var.replace("_", "-")


def _identifier(var: str, value: str, out_dir: Path) -> str:
    if not _IDENTIFIER.match(value) or keyword.iskeyword(value):
        raise ParityKitError(
            f"{_flag(var)} {value!r} must be a Python identifier (ASCII letters, digits and underscores, "
            "not starting with a digit, not a keyword), e.g. 'vae' or 'text_encoder'"
        )
    return value


def _camel(var: str, value: str, out_dir: Path) -> str:
    if not _CAMEL.match(value):
        raise ParityKitError(
            f"{_flag(var)} {value!r} must be a CamelCase class name (starts with an uppercase letter, then "
            "letters and digits only), e.g. 'MyModel' or 'MyModelPipeline'"
        )
    return value


def _target(var: str, value: str, out_dir: Path) -> Target:
    match = _TARGET.match(value)
    parts = [*match.group("module").split("."), match.group("attr")] if match else []
    if match is None or any(keyword.iskeyword(part) for part in parts):
        raise ParityKitError(
            f"{_flag(var)} {value!r} must be MODULE:NAME, an importable dotted module, a colon and a name, "
            "e.g. 'my_reference.model:build_model'"
        )
    return Target(match.group("module"), match.group("attr"))


def _class(var: str, value: str, out_dir: Path) -> Target:
    r"""A bare class name is imported from diffusers; ``MODULE:CLASS`` from anywhere."""
    if ":" in value:
        return _target(var, value, out_dir)
    if not _IDENTIFIER.match(value) or keyword.iskeyword(value):
        raise ParityKitError(
            f"{_flag(var)} {value!r} must be a diffusers class name (e.g. 'UNet2DModel') or MODULE:CLASS "
            "(e.g. 'my_port.model:MyTransformer')"
        )
    return Target("diffusers", value)


def _path(var: str, value: str, out_dir: Path) -> PathValue:
    if not value.strip():
        raise ParityKitError(f"{_flag(var)} must not be empty")
    given = Path(value).expanduser()
    if given.is_absolute():
        literal, call = python_str(str(given)), "Path"
    else:
        relative = os.path.relpath(Path.cwd() / given, out_dir.resolve())
        literal, call = python_str(Path(relative).as_posix()), "HERE.joinpath"
    if len(literal) <= _PATH_INLINE:
        return PathValue(value, f"Path({literal})" if call == "Path" else f"HERE / {literal}")
    # Too long for one line after `NAME = `: the magic trailing comma keeps ruff format from joining it back.
    return PathValue(value, f"{call}(\n    {literal},\n)")


def _components(var: str, value: str, out_dir: Path) -> Components:
    names = [part.strip() for part in value.split(",") if part.strip()]
    unknown = [name for name in names if name not in COMPONENTS]
    if unknown:
        raise ParityKitError(
            f"--components: unknown component {unknown[0]!r}; choose from {', '.join(COMPONENTS)}"
        )
    if len(set(names)) != len(names):
        raise ParityKitError(f"--components {value!r} names a component twice")
    if sum(name in DENOISERS for name in names) != 1:
        raise ParityKitError("--components must name exactly one denoiser: 'unet' or 'transformer'")
    if "scheduler" not in names:
        raise ParityKitError("--components must include 'scheduler' (the denoising loop needs one)")
    if ("text_encoder" in names) != ("tokenizer" in names):
        raise ParityKitError("--components: 'text_encoder' and 'tokenizer' go together; name both or neither")
    return Components(tuple(name for name in COMPONENTS if name in names))


def _number(var: str, value: str, out_dir: Path) -> str:
    r"""A non-negative finite float, written as the Python literal ``repr`` gives (``1e-05``, ``0.001``)."""
    try:
        number = float(value)
    except ValueError:
        number = float("nan")
    if not (number >= 0 and number != float("inf")):
        raise ParityKitError(f"{_flag(var)} {value!r} must be a non-negative number, e.g. 1e-4")
    return repr(number)


_RULES = {
    "identifier": _identifier,
    "number": _number,
    "camel": _camel,
    "target": _target,
    "class": _class,
    "path": _path,
    "components": _components,
}


# ------------------------------------------------------------------------------------------------ filters
def python_str(value: str) -> str:
    r"""``value`` as a Python string literal, quoted the way ``ruff format`` leaves it.

    Double quotes, unless the value holds more double than single quotes (then fewer escapes win).
    """
    quote = "'" if value.count('"') > value.count("'") else '"'
    escaped = value.replace("\\", "\\\\").replace(quote, "\\" + quote)
    escaped = "".join(
        ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in escaped
    )
    return f"{quote}{escaped}{quote}"


def docstring_text(value: Any) -> str:
    r"""Text safe inside a generated ``\"\"\"`` docstring: no escapes, no closing quotes."""
    return str(value).replace("\\", "\\\\").replace('"""', '\\"\\"\\"')


def snake_case(value: str) -> str:
    r"""``MyModel`` -> ``my_model``, ``HunyuanDiT`` -> ``hunyuan_dit``: a break before each capitalised
    word."""
    return re.sub(r"(?<=[A-Za-z0-9])(?=[A-Z][a-z])", "_", value).lower()


def _strip_pipeline(name: str) -> str:
    return name[: -len("Pipeline")] if name.endswith("Pipeline") and name != "Pipeline" else name


def import_line(target: Target, alias: str | None = None, indent: int = 0) -> str:
    r"""``from module import attr [as alias]``, wrapped the way ``ruff format`` would when it is too long."""
    pad = " " * indent
    name = target.attr if alias in (None, target.attr) else f"{target.attr} as {alias}"
    line = f"{pad}from {target.module} import {name}"
    if len(line) <= LINE_LENGTH:
        return line
    return f"{pad}from {target.module} import (\n{pad}    {name},\n{pad})"


# ------------------------------------------------------------------------------------------------- render
@dataclass
class RenderedFile:
    r"""One generated file before it is written."""

    filename: str
    text: str
    executable: bool = False


@dataclass
class Generated:
    r"""What ``generate`` wrote: the paths, in order, and whether an existing file was replaced."""

    paths: list[Path] = field(default_factory=list)
    overwritten: list[Path] = field(default_factory=list)

    def render(self) -> str:
        return "\n".join(str(path) for path in self.paths)


def template_environment(root: Path):
    r"""The jinja2 environment templates under ``root`` render in: strict about undefined names, no
    autoescape, and the filters and globals the templates use."""
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(root)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.filters["pystr"] = python_str
    env.filters["doc"] = docstring_text
    env.filters["snake"] = snake_case
    env.globals["import_line"] = import_line
    return env


def command_line(kind: str, name: str, options: Mapping[str, Any]) -> str:
    r"""The ``paritykit new …`` command that reproduces a rendering (quoted for a POSIX shell).

    ``kind`` is the spec's command, e.g. ``"pipeline-stub --modular"``: its first word comes before NAME.
    """
    command, *flags = kind.split()
    words = ["paritykit", "new", command, name, *flags]
    for var, value in options.items():
        if value is None or value is False:
            continue
        words.append(_flag(var))
        if value is not True:
            words.append(str(value))
    return " ".join(shlex.quote(word) for word in words)


def render(
    kind: str,
    name: str,
    *,
    out_dir: str | os.PathLike = ".",
    template_dir: Path | None = None,
    **options: Any,
) -> list[RenderedFile]:
    r"""Render one template into text, validating every value against the template's spec.

    Args:
        kind: the template's kind, its file or folder name with dashes (``"component-test"``,
            ``"pipeline-stub-modular"``); ``paritykit new --list`` shows the command for each.
        name: the NAME argument (identifier or CamelCase, as the template's spec says).
        out_dir: where the file will be written; relative paths in ``options`` are re-anchored there.
        template_dir: another template folder (tests); default: the pack's.
        **options: the template's other variables (``reference="pkg.mod:build"``, …); ``None`` = not given.

    Returns:
        The ``RenderedFile``s (path relative to ``out_dir``, text): one, or one per file of a set.
        Raises ``ParityKitError`` naming the argument that breaks a rule.
    """
    specs = templates(template_dir)
    spec = specs.get(kind)
    if spec is None:
        raise ParityKitError(f"unknown template {kind!r}; `paritykit new --list` shows: {', '.join(specs)}")
    unknown = sorted(set(options) - set(spec.variables))
    if unknown:
        raise ParityKitError(f"template {kind!r} takes no option {_flag(unknown[0])}")
    out_dir = Path(out_dir)
    values: dict[str, Any] = {"name": name, **options}
    context: dict[str, Any] = {}
    for var, rule in spec.variables.items():
        value = values.get(var)
        if value is None and var in spec.defaults:
            value = values[var] = spec.defaults[var]
        if value is None or value == "":
            if var not in spec.optional:
                raise ParityKitError(f"template {kind!r} needs {_flag(var)}")
            context[var] = None
            continue
        context[var] = _RULES[rule](var, str(value), out_dir)

    filename = spec.filename(name)
    shown = {var: values.get(var) for var in spec.variables if var != "name"}
    context.update(
        kind=kind,
        filename=filename,
        command=command_line(spec.command, name, shown),
        run=spec.run.format(filename=_from_cwd(out_dir, filename), package=filename.rstrip("/")),
        version=__version__,
        snake=snake_case(_strip_pipeline(name)),
        # the folder `paritykit new` runs in, from the generated file's folder: a file that imports the
        # user's modules puts it on sys.path, so it runs from any folder
        root=Path(os.path.relpath(Path.cwd(), out_dir.resolve())).as_posix(),
    )
    env = template_environment(spec.path.parent)
    user_values = [str(value) for value in values.values() if value is not None]
    rendered = []
    for member, target in zip(spec.members, spec.filenames(name)):
        text = env.get_template(member.name).render(context).lstrip("\n")
        _check_rendered(member, text, user_values)
        rendered.append(RenderedFile(filename=target, text=text, executable=spec.executable))
    return rendered


def _from_cwd(out_dir: Path, filename: str) -> str:
    r"""``filename`` (inside ``out_dir``) as a path from the folder ``paritykit new`` runs in.

    A generated test is run from there, not from ``--out``: the user's modules (``repo.model``) import from
    that folder (``python -m`` puts it on ``sys.path``), so the header's command must name the file from it.
    """
    path = out_dir / filename
    if not path.is_absolute():
        path = Path(os.path.normpath(path))
    return path.as_posix()


def _check_rendered(template: Path, text: str, user_values: list[str]) -> None:
    # A marker that survives rendering is a template bug, unless the user's own value carried it.
    if _MARKERS.search(text) and not any(_MARKERS.search(value) for value in user_values):
        raise RuntimeError(f"template {template} left an unrendered marker in its output")
    compile(text, str(template), "exec")  # a template bug, not the user's: let it raise


# -------------------------------------------------------------------------------------------------- write
def write_files(files: list[RenderedFile], out_dir: str | os.PathLike, *, force: bool = False) -> Generated:
    r"""Write rendered files into ``out_dir`` atomically (temp file + rename).

    Every target is checked before anything is written, so a refusal leaves the folder as it was.

    Args:
        files: what ``render`` returned.
        out_dir: the folder (created if missing); files are flat inside it, a set's in one sub-folder.
        force: replace existing files; without it an existing file is a ``ParityKitError`` (exit 2).
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ParityKitError(f"--out {out} is a file, not a folder")
    targets = [out / item.filename for item in files]
    existing = [path for path in targets if path.exists() or path.is_symlink()]
    for path in existing:
        if path.is_dir():
            raise ParityKitError(f"{path} is a folder; choose another NAME or --out")
    if existing and not force:
        raise ParityKitError(f"{existing[0]} already exists; pass --force to overwrite it")
    try:
        for folder in dict.fromkeys(path.parent for path in targets):
            folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ParityKitError(f"--out {out}: cannot create the folder ({exc.strerror})") from exc
    result = Generated(overwritten=existing)
    for item, path in zip(files, targets):
        try:
            atomic_write_text(path, item.text, executable=item.executable)
        except OSError as exc:
            raise ParityKitError(f"cannot write {path} ({exc.strerror or exc})") from exc
        result.paths.append(path)
    return result


def generate(
    kind: str,
    name: str,
    *,
    out_dir: str | os.PathLike = ".",
    force: bool = False,
    template_dir: Path | None = None,
    **options: Any,
) -> Generated:
    r"""Render template ``kind`` for ``name`` and write it into ``out_dir`` (what ``paritykit new`` runs).

    Args:
        kind, name, options: as for ``render``.
        out_dir: target folder; files are named after NAME and the template (``test_vae_component.py``).
        force: overwrite existing files.

    Returns:
        ``Generated`` with the written paths.
    """
    rendered = render(kind, name, out_dir=out_dir, template_dir=template_dir, **options)
    return write_files(rendered, out_dir, force=force)
