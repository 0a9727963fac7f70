r"""Evidence at a culprit: why two aligned modules differ, each cause checked and, where possible, verified.

The search (:mod:`paritykit.bisection.entry`) finds *where* a port parts from its reference; this package
says *why*, from the two module objects and the inputs and outputs captured at that call. One small function
per kind of evidence, each taking a :class:`~paritykit.bisection.evidence.culprit.Culprit` and returning
:class:`~paritykit.compare.diagnose.Hint` s that state their evidence:

- ``settings``: :func:`module_config` (``module-config``): public scalar / tuple / string attributes,
  ``extra_repr()`` fields and buffers of the two modules (and of the aligned pairs inside them) that differ;
- ``activations``: :func:`activation` (``activation``): which known elementwise function each side computes on
  the captured input (exact GELU, tanh-GELU, quick-GELU, SiLU, ReLU, …);
- ``constants``: :func:`norm_eps` (``norm-eps``) and :func:`attention_scale` (``attention-scale``): the
  constant that makes the reference reproduce the port's output;
- ``weight_slices``: :func:`weights` (``weights``): port parameters that hold a different reference slice than
  their name implies (``to_q`` = chunk 1 of a fused qkv), found by conversion inference;
- ``casts``: :func:`reduced_precision` (``bf16-cast`` / ``fp16-cast``): the reference re-run on inputs rounded
  to that dtype, or under autocast in it, reproduces the port's output.

Every candidate fix is tried on a deep copy of the port module (``Culprit.check``): ``verified=True`` with the
before/after error when the copy then matches the reference. ``collect``: :func:`culprit_evidence` runs them
all (the registry ``EVIDENCE``); when none finds anything it says so plainly (``no-signature``), listing what
was ruled out. A new detector is one function in one of these modules, registered in ``collect.EVIDENCE``."""

from paritykit.base.lazy import lazy_exports

# public name -> the module that defines it
EXPORTS = {
    "Culprit": "paritykit.bisection.evidence.culprit",
    "SettingDifference": "paritykit.bisection.evidence.settings",
    "settings_diff": "paritykit.bisection.evidence.settings",
    "config_differences": "paritykit.bisection.evidence.settings",
    "module_config": "paritykit.bisection.evidence.settings",
    "identify_function": "paritykit.bisection.evidence.activations",
    "activation": "paritykit.bisection.evidence.activations",
    "inner_activation": "paritykit.bisection.evidence.activations",
    "norm_eps": "paritykit.bisection.evidence.constants",
    "attention_scale": "paritykit.bisection.evidence.constants",
    "weights": "paritykit.bisection.evidence.weight_slices",
    "reduced_precision": "paritykit.bisection.evidence.casts",
    "EVIDENCE": "paritykit.bisection.evidence.collect",
    "culprit_evidence": "paritykit.bisection.evidence.collect",
    "no_signature": "paritykit.bisection.evidence.collect",
    "rank": "paritykit.bisection.evidence.collect",
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, EXPORTS)
