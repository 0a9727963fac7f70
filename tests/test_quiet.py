"""diffusers' warnings silenced where paritykit triggers them: restored after, nested blocks cost nothing."""

from __future__ import annotations

import logging

from paritykit.base.quiet import quiet_diffusers


def test_the_level_is_restored_and_a_nested_block_leaves_it_to_the_outer_one():
    logger = logging.getLogger("diffusers")
    before = logger.level
    logger.setLevel(logging.WARNING)
    try:
        with quiet_diffusers():
            assert logger.getEffectiveLevel() == logging.ERROR
            with quiet_diffusers():
                assert logger.level == logging.ERROR
            assert logger.level == logging.ERROR  # the inner block did not restore WARNING under the outer
        assert logger.level == logging.WARNING

        @quiet_diffusers()
        def level_inside() -> int:
            return logger.getEffectiveLevel()

        assert level_inside() == logging.ERROR and logger.level == logging.WARNING
        logger.setLevel(logging.CRITICAL)  # a user who silenced more keeps it
        with quiet_diffusers():
            assert logger.level == logging.CRITICAL
        assert logger.level == logging.CRITICAL
    finally:
        logger.setLevel(before)
