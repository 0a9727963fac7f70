"""docs/claims.md, the register of every kind of line paritykit prints: each test it names as the one that
tries to falsify a line exists, so the register cannot cite a test that was renamed or deleted."""

from __future__ import annotations

import re

from .conftest import REPO


def cited_tests() -> list[tuple[str, str]]:
    r"""Every ``file.py::name`` the register cites; ``…::name`` is a test of the file cited just before
    it, and ``file.py`` alone cites the whole file."""
    text = (REPO / "docs" / "claims.md").read_text()
    found, current = [], None
    for file, name in re.findall(r"`(test_\w+\.py|…)(?:::(\w+))?", text):
        current = file if file != "…" else current
        found.append((current, name))
    return found


def test_every_test_the_claims_register_cites_exists():
    cited = cited_tests()
    assert len(cited) >= 30
    for file, name in cited:
        path = REPO / "tests" / file
        assert path.is_file(), f"docs/claims.md cites {file}, which does not exist"
        if name:
            assert re.search(rf"^def {name}\(", path.read_text(), re.M), (
                f"docs/claims.md cites {file}::{name}"
            )
