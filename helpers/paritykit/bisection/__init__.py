r"""The culprit search behind ``paritykit bisect``: capture → align → search → explain → report.

``entry`` holds the entry points (``bisect``, ``bisect_traces``, ``capture_and_bisect``, ``--all``); ``spec``
runs SPEC.py files. ``align`` pairs the two models' modules; ``searcher`` tests aligned calls (replay, else an
error jump) and is the one thing the strategies call; ``strategy`` is the search's interface, with
``FullSearch`` (everything captured) and ``zoom.ZoomSearch`` (one level at a time) behind it and
:func:`~paritykit.bisection.strategy.run_strategy` turning either into a report; ``findings`` explains a
located call (``evidence``, ``mix_fits``, ``module_fit``, ``ops``, then ``repair``); ``results`` holds the
report objects; ``leaves`` pairs tensor leaves of calls. See docs/architecture.md.
"""

from paritykit.base.lazy import lazy_exports

# public name -> the module that defines it
EXPORTS = {
    "bisect": "paritykit.bisection.entry",
    "bisect_traces": "paritykit.bisection.entry",
    "first_divergence": "paritykit.bisection.findings",
    "BisectReport": "paritykit.bisection.results",
    "ModuleFinding": "paritykit.bisection.results",
    "ModuleTest": "paritykit.bisection.results",
    "Alignment": "paritykit.bisection.align",
    "align_modules": "paritykit.bisection.align",
    "Searcher": "paritykit.bisection.searcher",
    "SearchStrategy": "paritykit.bisection.strategy",
    "FullSearch": "paritykit.bisection.strategy",
    "Located": "paritykit.bisection.strategy",
    "run_strategy": "paritykit.bisection.strategy",
    "ZoomSearch": "paritykit.bisection.zoom",
    "zoom_bisect": "paritykit.bisection.zoom",
    "fit_module": "paritykit.bisection.module_fit",
    "ModuleFit": "paritykit.bisection.module_fit",
    "bisect_spec": "paritykit.bisection.spec",
    "trace_spec": "paritykit.bisection.spec",
    "relate": "paritykit.bisection.value_relations",
    "Relation": "paritykit.bisection.value_relations",
    "read_rotary": "paritykit.bisection.rotary",
    "rotary_from_rotation": "paritykit.bisection.rotary",
    "rotary_difference": "paritykit.bisection.rotary",
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, EXPORTS)
