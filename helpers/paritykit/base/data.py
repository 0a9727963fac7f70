"""Find the files shipped beside the code (skills, templates), never relative to the working directory."""

from __future__ import annotations

from pathlib import Path

from paritykit.base.errors import ParityKitError

# this file is paritykit/base/data.py: the package folder is one level up
_PACKAGE = Path(__file__).resolve().parent.parent
_KINDS = ("skills", "templates")


def data_dir(kind: str) -> Path:
    r"""Folder holding the pack's ``skills`` or ``templates``.

    A wheel carries them inside the package (``paritykit/_data/<kind>``); an editable install or a plain
    checkout finds them at the repository root, two levels above ``helpers/paritykit``.
    """
    if kind not in _KINDS:
        raise ValueError(f"unknown data kind {kind!r}; expected one of {_KINDS}")
    for candidate in (_PACKAGE / "_data" / kind, _PACKAGE.parent.parent / kind):
        if candidate.is_dir():
            return candidate
    raise ParityKitError(
        f"paritykit's {kind} folder is missing from this installation ({_PACKAGE}); reinstall it"
    )
