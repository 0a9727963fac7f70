r"""Lazy re-exports for a package's ``__init__`` (PEP 562), so importing a room costs nothing until a name is
used.

Every room re-exports its public names from the modules that define them; importing the room's package must
not import those modules (and torch with them) before a name is asked for, or ``paritykit --help`` would pay
for all."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    r"""The ``__getattr__``, ``__dir__`` and ``__all__`` of a package that re-exports names lazily.

    Args:
        package: the package's ``__name__``.
        exports: public name -> module that defines it (absolute, e.g. ``"paritykit.compare.tensors"``).

    Returns:
        ``(__getattr__, __dir__, __all__)``, to be assigned in the package's ``__init__``. A name is imported
        on first access and cached in the package's namespace.
    """
    names = sorted(exports)

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(importlib.import_module(package), name, value)
        return value

    def __dir__() -> list[str]:
        return names

    return __getattr__, __dir__, names


def exports_of(package: str, *names: str) -> dict[str, str]:
    r"""``{name: defining module}`` for ``names`` from room ``package``'s ``EXPORTS`` (imports only the room's
    ``__init__``, which imports nothing heavy), so a name's home is written down once, in its room."""
    exports = importlib.import_module(package).EXPORTS
    return {name: exports[name] for name in names}
