"""paritykit: agent skills and executable helpers for porting diffusion models with proven parity.

The public API is imported lazily (PEP 562) so that ``import paritykit`` and the CLI's ``--help`` stay fast and
never import torch until a tensor helper is used. The code lives in rooms named after what they hold (``base``,
``tracing``, ``compare``, ``forensics``, ``bisection``, ``schedule``, ``pack``, ``cli``, ``demo``); how they fit
together is docs/architecture.md.
"""

from __future__ import annotations

from paritykit import _moved
from paritykit._version import __version__
from paritykit.base.lazy import lazy_exports

# the flat layout's module paths (paritykit.checkpoints, …) stay importable for code written against them
_moved.install()

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # errors and reports
    "ParityKitError": "paritykit.base.errors",
    # checkpoints
    "Checkpoint": "paritykit.tracing.checkpoints",
    "PipelineStop": "paritykit.tracing.checkpoints",
    "CheckpointNotReached": "paritykit.tracing.checkpoints",
    "maybe_checkpoint": "paritykit.tracing.checkpoints",
    "run_until_stop": "paritykit.tracing.checkpoints",
    "save_checkpoints": "paritykit.tracing.checkpoints",
    "load_checkpoints": "paritykit.tracing.checkpoints",
    "seeded_noise": "paritykit.tracing.checkpoints",
    # comparison and diagnoses
    "TensorComparison": "paritykit.compare.tensors",
    "compare_tensors": "paritykit.compare.tensors",
    "compare_outputs": "paritykit.compare.sets",
    "compare_tensor_sets": "paritykit.compare.sets",
    "assert_parity": "paritykit.compare.sets",
    "Hint": "paritykit.compare.diagnose",
    "default_tolerances": "paritykit.compare.tolerances",
    "OutputComparison": "paritykit.compare.sets",
    "SetComparison": "paritykit.compare.sets",
    "compare_paths": "paritykit.compare.sets",
    # tensor I/O
    "load_tensors": "paritykit.base.io",
    "load_state_dict": "paritykit.base.io",
    "safe_torch_load": "paritykit.base.io",
    # forensics
    "config_diff": "paritykit.forensics.configs",
    "weights_diff": "paritykit.forensics.weights",
    "load_config": "paritykit.forensics.config_files",
    "derive_from_ldm": "paritykit.forensics.config_ldm",
    "suggest_map": "paritykit.forensics.config_suggest",
    "read_safetensors_header": "paritykit.forensics.safetensors_header",
    "infer_conversion_map": "paritykit.forensics.conversion.matching",
    "ConversionMap": "paritykit.forensics.conversion.results",
    "emit_rules": "paritykit.forensics.conversion.emit",
    "apply_rules_to_state_dict": "paritykit.forensics.conversion.emit",
    "match_modules": "paritykit.forensics.conversion.modules",
    # culprit search
    "capture": "paritykit.tracing.trace",
    "align_modules": "paritykit.bisection.align",
    "first_divergence": "paritykit.bisection.findings",
    "bisect": "paritykit.bisection.search",
    "bisect_traces": "paritykit.bisection.search",
    "BisectReport": "paritykit.bisection.results",
    "Culprit": "paritykit.bisection.evidence",
    "culprit_evidence": "paritykit.bisection.evidence",
    "config_differences": "paritykit.bisection.evidence",
    "identify_function": "paritykit.bisection.evidence",
    "Trace": "paritykit.tracing.trace",
    "Alignment": "paritykit.bisection.align",
    "fit_module": "paritykit.bisection.module_fit",
    "ModuleFit": "paritykit.bisection.module_fit",
    "zoom_bisect": "paritykit.bisection.zoom",
    "ModelWeights": "paritykit.tracing.trace",
    "step_curve": "paritykit.compare.steps",
    "compare_images": "paritykit.compare.images",
    "compare_gradients": "paritykit.compare.gradients",
    "StepCurve": "paritykit.compare.steps",
    "ImageComparison": "paritykit.compare.images",
    "classify_growth": "paritykit.compare.steps",
    "GradientComparison": "paritykit.compare.gradients",
    # sampling loops
    "compare_schedules": "paritykit.schedule.compare",
    "fit_scheduler": "paritykit.schedule.fit",
    "record_loop": "paritykit.tracing.recording",
}

__getattr__, _, _names = lazy_exports(__name__, _EXPORTS)
__all__ = ["__version__", *_names]


def __dir__() -> list[str]:
    return sorted(__all__)
