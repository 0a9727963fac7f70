"""paritykit: agent skills and executable helpers for porting diffusion models with proven parity.

The public API is imported lazily (PEP 562) so that ``import paritykit`` and the CLI's ``--help`` stay fast
and never import torch until a tensor helper is used. The code lives in rooms named after what they hold
(``base``, ``tracing``, ``compare``, ``forensics``, ``bisection``, ``schedule``, ``pack``, ``cli``, ``demo``);
how they fit together is docs/architecture.md.
"""

from __future__ import annotations

from paritykit import _moved
from paritykit._version import __version__
from paritykit.base.lazy import exports_of, lazy_exports

# the flat layout's module paths (paritykit.checkpoints, …) stay importable for code written against them
_moved.install()

# public name -> module that defines it, as each room lists it in its own EXPORTS
_EXPORTS: dict[str, str] = {
    "ParityKitError": "paritykit.base.errors",
    "load_tensors": "paritykit.base.io",
    "load_state_dict": "paritykit.base.io",
    "safe_torch_load": "paritykit.base.io",
    **exports_of(
        "paritykit.tracing",
        "Checkpoint",
        "PipelineStop",
        "CheckpointNotReached",
        "maybe_checkpoint",
        "run_until_stop",
        "save_checkpoints",
        "load_checkpoints",
        "seeded_noise",
        "capture",
        "Trace",
        "ModelWeights",
        "record_loop",
        "model_inputs",
        "tiny_config",
    ),
    **exports_of(
        "paritykit.compare",
        "TensorComparison",
        "compare_tensors",
        "compare_outputs",
        "compare_tensor_sets",
        "assert_parity",
        "Hint",
        "default_tolerances",
        "OutputComparison",
        "SetComparison",
        "compare_paths",
        "step_curve",
        "compare_images",
        "compare_gradients",
        "StepCurve",
        "ImageComparison",
        "classify_growth",
        "GradientComparison",
    ),
    **exports_of(
        "paritykit.forensics",
        "config_diff",
        "weights_diff",
        "load_config",
        "derive_from_ldm",
        "suggest_map",
        "read_safetensors_header",
        "infer_conversion_map",
        "ConversionMap",
        "emit_rules",
        "apply_rules_to_state_dict",
        "match_modules",
    ),
    **exports_of(
        "paritykit.bisection",
        "align_modules",
        "first_divergence",
        "bisect",
        "bisect_traces",
        "BisectReport",
        "Alignment",
        "fit_module",
        "ModuleFit",
        "zoom_bisect",
        "relate",
        "read_rotary",
        "rotary_from_rotation",
        "rotary_difference",
    ),
    **exports_of(
        "paritykit.bisection.evidence",
        "Culprit",
        "culprit_evidence",
        "config_differences",
        "identify_function",
    ),
    **exports_of("paritykit.schedule", "compare_schedules", "fit_scheduler"),
    **exports_of("paritykit.triage", "triage_spec", "TriageReport"),
}

__getattr__, _, _names = lazy_exports(__name__, _EXPORTS)
__all__ = ["__version__", *_names]


def __dir__() -> list[str]:
    return sorted(__all__)
