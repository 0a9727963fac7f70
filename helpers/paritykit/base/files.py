"""Writing files the user keeps (generated code, manifests): atomically, with ordinary permissions."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from paritykit.base.errors import ParityKitError

# the file a run folder (checkpoints, a trace, recorded calls) describes itself in
MANIFEST_NAME = "paritykit.json"


def atomic_write_text(path: str | os.PathLike, text: str, *, executable: bool = False) -> None:
    r"""Write ``text`` to ``path`` via a temporary file in the same folder and a rename.

    A crash or a full disk leaves either the old file or the new one, never half of either. The file gets the
    mode a plain ``open(..., "w")`` would give (``mkstemp`` alone makes it private, 0600).

    Args:
        path: the file to write; its folder must exist.
        text: the content, written as UTF-8 with ``\n`` line endings.
        executable: also set the executable bits the umask allows.
    """
    path = Path(path)
    umask = os.umask(0)
    os.umask(umask)
    mode = (0o777 if executable else 0o666) & ~umask
    import tempfile  # not at module level: weights diff imports this module, and starts faster without it

    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_figure(figure: Any, path: str | os.PathLike, **savefig_kwargs: Any) -> Path:
    r"""Save a matplotlib figure a user asked for (``--plot``, ``--out``), creating its folder.

    An unwritable path or a format matplotlib cannot write becomes one line naming the file (exit 2 from the
    CLI), never a traceback."""

    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(path, **savefig_kwargs)
    except (OSError, ValueError) as exc:  # ValueError: a suffix matplotlib cannot write, e.g. .ckpt
        raise ParityKitError(
            f"{path}: cannot write the plot ({getattr(exc, 'strerror', None) or exc})"
        ) from None
    return path


def refuse_overwriting_an_input(label: str, out: Any, *inputs: Any) -> None:
    r"""Refuse a report path that names one of the command's input files.

    ``images ref.png port.png --out port.png`` would otherwise replace the port's image with the report.
    ``label`` names the argument in the one-line error (``--out``, ``--plot``); non-path inputs are ignored.
    """

    if not isinstance(out, (str, os.PathLike)):
        return
    target = Path(out).resolve()
    for given in inputs:
        if isinstance(given, (str, os.PathLike)) and Path(given).resolve() == target:
            raise ParityKitError(
                f"{label} {out}: is an input of this command; write the report to another file"
            )


def same_path_warning(a: Any, b: Any) -> str | None:
    r"""The warning for comparing a path with itself (every value matches itself; nothing was compared across
    two runs), or ``None`` when ``a`` and ``b`` are different paths or not paths at all."""
    if not isinstance(a, (str, os.PathLike)) or not isinstance(b, (str, os.PathLike)):
        return None
    try:
        same = Path(a).resolve() == Path(b).resolve()
    except OSError:
        return None
    if not same:
        return None
    return f"A and B are the same path ({a}): everything matches itself, nothing was compared across two runs"


def check_sides(a: Any, b: Any) -> None:
    r"""Refuse a pair of run folders whose manifests say they are not (reference, port): both of one side, or
    swapped. Folders (or files) that record no side are not checked."""

    sides = [_side_of(p) for p in (a, b)]
    if None in sides:
        return
    if sides[0] == sides[1]:
        raise ParityKitError(f"{a} and {b} both hold a {sides[0]} run; give the reference's, then the port's")
    if sides == ["port", "reference"]:
        raise ParityKitError(
            f"swapped: {a} holds the port's run and {b} the reference's; give the reference's first"
        )


def _side_of(path: Any) -> str | None:
    import json

    if not isinstance(path, (str, os.PathLike)):
        return None
    manifest = Path(path) / MANIFEST_NAME
    try:
        side = json.loads(manifest.read_text()).get("side") if manifest.is_file() else None
    except (OSError, ValueError, AttributeError):
        return None  # an unreadable manifest is the loader's to name
    return side if side in ("reference", "port") else None


def require_file(path: Path) -> None:
    r"""One line naming ``path`` when it is missing or not a file."""
    if not path.exists():
        raise ParityKitError(f"{path}: no such file or directory")
    if not path.is_file():
        raise ParityKitError(f"{path}: not a file")
