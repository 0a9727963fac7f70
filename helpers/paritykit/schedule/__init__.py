r"""Sampling schedules (``paritykit schedule``): ``load`` reads a schedule from anything a port records,
``families`` names the closed form it follows, ``compare`` diagnoses two schedules, ``schedulers`` builds
diffusers schedulers by name, ``fit`` searches a scheduler's config for the reference, ``step_check`` checks
one ``step()`` against the reference loop's update."""

from paritykit.base.lazy import lazy_exports

# public name -> the module that defines it
EXPORTS = {
    "Schedule": "paritykit.schedule.load",
    "load_schedule": "paritykit.schedule.load",
    "family_of": "paritykit.schedule.families",
    "ScheduleComparison": "paritykit.schedule.compare",
    "compare_schedules": "paritykit.schedule.compare",
    "FitResult": "paritykit.schedule.fit_result",
    "fit_scheduler": "paritykit.schedule.fit",
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, EXPORTS)
