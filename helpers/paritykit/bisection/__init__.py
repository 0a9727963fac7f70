r"""The culprit search behind ``paritykit bisect``: capture → align → search → explain → report.

``align`` pairs the two models' modules; ``searcher`` tests aligned calls (replay, else error jump);
``strategy`` is the search's one interface, with ``FullSearch`` (everything captured) and ``zoom.ZoomSearch``
(one level at a time) behind it and :func:`~paritykit.bisection.strategy.run_strategy` turning either into a
report; ``findings`` explains a located call (``evidence``, ``remix``, ``module_fit``, ``ops``); ``results``
holds the report objects; ``search`` is the entry point (``bisect``, ``bisect_traces``, ``--all``); ``spec``
runs SPEC.py files; ``leaves`` pairs tensor leaves of calls. See docs/architecture.md.
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
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, EXPORTS)
