r"""``paritykit triage``: from two sampling pipelines to the cause, in one command.

``run`` runs both sides from one seed with every denoiser (and decoder) call recorded and walks the places a
port can part from its reference (``places``: the checks; ``calls``: one call's arguments by role and the
reference's values put into the port's call); ``report`` holds the result. It sits above the engines: a
module's difference is handed to ``bisection``, a schedule's to ``schedule``.
"""

from paritykit.base.lazy import lazy_exports

# public name -> the module that defines it
EXPORTS = {
    "triage_spec": "paritykit.triage.run",
    "TriageReport": "paritykit.triage.report",
    "Finding": "paritykit.triage.report",
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, EXPORTS)
