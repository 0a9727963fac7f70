r"""diffusers' log warnings silenced where paritykit, not the user, triggers them (a copy cast to another
dtype on purpose prints "should be kept in float32" once per copy)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


@contextlib.contextmanager
def quiet_diffusers() -> Iterator[None]:
    r"""diffusers' loggers at ERROR inside the block, restored after. Also a decorator.

    Inside a block already quiet it changes nothing: every ``setLevel`` clears the cache of every logger in
    the process (hundreds once transformers is imported), which a search building thousands of schedulers
    felt."""
    logger = logging.getLogger("diffusers")
    if logger.getEffectiveLevel() >= logging.ERROR:
        yield
        return
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
