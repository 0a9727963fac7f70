r"""``paritykit triage``: from two sampling pipelines to the cause, in one command.

``spec`` is the entry (``triage_spec``): ``sides`` loads the SPEC and runs both sides from one seed with every
denoiser (and decoder) call recorded; ``walk`` compares them place by place, first difference first, reading
``pairs`` (two recorded calls compared input by input), ``roles`` (one call's arguments by role, the
reference's values put into the port's call) and ``fits`` (each side's own linear relations); ``reproduce``
writes the recordings and each finding's reproduce files; ``report`` holds the result. It sits above the
engines: a module's difference is handed to ``bisection``, a schedule's to ``schedule``.
"""

from paritykit.base.lazy import lazy_exports

# public name -> the module that defines it
EXPORTS = {
    "triage_spec": "paritykit.triage.spec",
    "TriageReport": "paritykit.triage.report",
    "Finding": "paritykit.triage.report",
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, EXPORTS)
