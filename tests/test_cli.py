import json

from paritykit.cli import COMMANDS


def test_help_lists_every_command(cli):
    result = cli("--help")
    assert result.returncode == 0, result.stderr
    for name in COMMANDS:
        assert name in result.stdout


def test_version(cli):
    from paritykit import __version__

    result = cli("--version")
    assert result.returncode == 0
    assert __version__ in result.stdout


def test_unknown_command_is_one_line_exit_2(cli):
    result = cli("no-such-command")
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "no-such-command" in lines[0]
    assert "Traceback" not in result.stderr


def test_unknown_command_with_json_is_a_json_error(cli):
    result = cli("no-such-command", "--json")
    assert result.returncode == 2
    payload = json.loads(result.stdout)
    assert payload["schema_version"] == 1
    assert "no-such-command" in payload["error"]


def test_help_imports_neither_torch_nor_diffusers(cli):
    code = (
        "import sys\n"
        "from paritykit.cli import cli\n"
        "try:\n"
        "    cli.main(['--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = [m for m in ('torch', 'diffusers', 'numpy') if m in sys.modules]\n"
        "print('HEAVY=' + ','.join(heavy))\n"
    )
    import subprocess
    import sys

    from tests.conftest import REPO

    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"PYTHONPATH": str(REPO / "helpers"), "PATH": "/usr/bin:/bin"},
    )
    assert "HEAVY=\n" in result.stdout + "\n", result.stdout + result.stderr
    assert result.stdout.strip().endswith("HEAVY=")


def test_every_public_name_resolves_and_every_command_module_loads():
    import importlib

    import paritykit

    for name in paritykit.__all__:
        assert getattr(paritykit, name) is not None, name
    for name, (target, _help) in COMMANDS.items():
        module, attr = target.split(":")
        assert callable(getattr(importlib.import_module(module), attr)), name
