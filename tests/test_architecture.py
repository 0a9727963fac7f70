"""The rooms of paritykit (docs/architecture.md) hold: the layering and no-cycle contracts pass under
import-linter, no module imports another module's private names, no module outgrows a few hundred lines, and
no public name of a room is shadowed by one of its submodules."""

import ast
import importlib
import pkgutil
import subprocess
import sys
import types
from pathlib import Path

import paritykit
import pytest
from paritykit._moved import MOVED

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "helpers" / "paritykit"
# "no module over about 800 lines": the bound a split is due at
MAX_MODULE_LINES = 800


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def room_of(module: str) -> str:
    """The room a module lives in: ``paritykit.bisection.evidence.casts`` -> ``paritykit.bisection``."""
    return ".".join(module.split(".")[:2])


def private_imports(root: Path) -> list[str]:
    r"""Every ``from <another module> import _name`` (at any depth of the file) under package folder ``root``:
    a helper two modules share is public in the module that owns it. A private *module* (``_moved``) may be
    imported by name."""
    found = []
    for path in sorted(root.rglob("*.py")):
        importer = module_name(path, root)
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                continue
            if not node.module.startswith(root.name + ".") and node.module != root.name:
                continue
            source = root.parent.joinpath(*node.module.split("."))
            for alias in node.names:
                if not alias.name.startswith("_") or alias.name.startswith("__"):
                    continue
                if (source / f"{alias.name}.py").is_file() or (source / alias.name).is_dir():
                    continue
                found.append(f"{importer}:{node.lineno} imports {alias.name} from {node.module}")
    return found


def test_import_contracts_hold():
    """Layers cli -> features -> engines -> core -> base and no cycle between siblings (pyproject.toml)."""
    lint_imports = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint_imports)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "2 kept, 0 broken" in result.stdout


def test_no_module_imports_another_modules_private_names():
    assert private_imports(PACKAGE) == []


def test_the_private_import_check_fires_across_modules_and_rooms(tmp_path):
    pkg = tmp_path / "pkg"
    for room in ("one", "two"):
        (pkg / room).mkdir(parents=True)
        (pkg / room / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "_hidden.py").write_text("")
    (pkg / "one" / "a.py").write_text("def _helper():\n    pass\n")
    # a private module imported by name, and public names: allowed
    (pkg / "one" / "b.py").write_text("from pkg import _hidden\nfrom pkg.one.a import public\n")
    assert private_imports(pkg) == []
    # another module of the same room, and another room even inside a function: reported with file and line
    (pkg / "one" / "c.py").write_text("from pkg.one.a import _helper\n")
    (pkg / "two" / "d.py").write_text("def f():\n    from pkg.one.a import _helper, public\n")
    assert private_imports(pkg) == [
        "pkg.one.c:1 imports _helper from pkg.one.a",
        "pkg.two.d:2 imports _helper from pkg.one.a",
    ]


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_outgrows_its_room(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{path.relative_to(REPO)} has {lines} lines: split it along its seams"


def test_no_public_name_of_a_room_is_shadowed_by_a_submodule():
    """Importing ``paritykit.bisection.entry`` sets the attribute ``search`` on ``paritykit.bisection``: a
    public name spelled like a submodule would then be that module (the old ``paritykit.bisect`` bug)."""
    names = [
        m.name
        for m in pkgutil.walk_packages(paritykit.__path__, "paritykit.")
        if m.name != "paritykit.__main__"
    ]
    for name in names:
        importlib.import_module(name)
    packages = ["paritykit", *(n for n in names if hasattr(importlib.import_module(n), "__path__"))]
    for package in packages:
        module = importlib.import_module(package)
        for public in getattr(module, "__all__", []):
            value = getattr(module, public)
            assert not isinstance(value, types.ModuleType), (
                f"{package}.{public} is a module, not the public name"
            )


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_module_paths_still_import_with_a_warning(old):
    """Code generated by earlier templates imports the flat layout's paths; they give the module that holds
    those names now (the same object), and say where it moved."""
    new = importlib.import_module(MOVED[old])
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=MOVED[old].replace(".", r"\.")):
        module = importlib.import_module(old)
    assert module is new
    assert module.__spec__.name == MOVED[old]


def test_names_earlier_templates_imported_resolve_through_the_old_paths():
    sys.modules.pop("paritykit.checkpoints", None)
    sys.modules.pop("paritykit.configs", None)
    with pytest.warns(DeprecationWarning):
        from paritykit.checkpoints import Checkpoint, maybe_checkpoint, save_checkpoints
        from paritykit.configs import config_diff
    assert Checkpoint is paritykit.Checkpoint and config_diff is paritykit.config_diff
    assert maybe_checkpoint is paritykit.maybe_checkpoint and save_checkpoints is paritykit.save_checkpoints


def test_a_path_that_never_existed_is_still_an_import_error():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("paritykit.no_such_module")
