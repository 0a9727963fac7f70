r"""Tensor comparison and its diagnoses: one pair, named sets and checkpoint folders, nested model outputs,
per-step error curves, images, and gradients.

Modules: ``tolerances`` (per-dtype defaults), ``tensors`` (one pair), ``diagnose`` (what a difference looks
like: a cast, a transpose, a scale, …), ``sets`` (many tensors, ``assert_parity``), ``steps`` (error over a
denoising loop), ``images`` (side by side with a heatmap), ``gradients`` (backward passes)."""

from paritykit.base.lazy import lazy_exports

# public name -> the module that defines it
EXPORTS = {
    "TensorComparison": "paritykit.compare.tensors",
    "compare_tensors": "paritykit.compare.tensors",
    "relative_error": "paritykit.compare.tensors",
    "default_tolerances": "paritykit.compare.tolerances",
    "Hint": "paritykit.compare.diagnose",
    "SetComparison": "paritykit.compare.sets",
    "OutputComparison": "paritykit.compare.sets",
    "compare_tensor_sets": "paritykit.compare.sets",
    "compare_outputs": "paritykit.compare.sets",
    "compare_paths": "paritykit.compare.sets",
    "assert_parity": "paritykit.compare.sets",
    "StepCurve": "paritykit.compare.steps",
    "step_curve": "paritykit.compare.steps",
    "classify_growth": "paritykit.compare.steps",
    "ImageComparison": "paritykit.compare.images",
    "compare_images": "paritykit.compare.images",
    "GradientComparison": "paritykit.compare.gradients",
    "compare_gradients": "paritykit.compare.gradients",
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, EXPORTS)
