"""paritykit: agent skills and executable helpers for porting diffusion models with proven parity.

The public API is imported lazily (PEP 562) so that ``import paritykit`` and the CLI's ``--help`` stay fast and
never import torch until a tensor helper is used.
"""

from __future__ import annotations

import importlib
from typing import Any

from paritykit._version import __version__

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # errors and reports
    "ParityKitError": "paritykit.errors",
    # checkpoints
    "Checkpoint": "paritykit.checkpoints",
    "PipelineStop": "paritykit.checkpoints",
    "CheckpointNotReached": "paritykit.checkpoints",
    "maybe_checkpoint": "paritykit.checkpoints",
    "run_until_stop": "paritykit.checkpoints",
    "save_checkpoints": "paritykit.checkpoints",
    "load_checkpoints": "paritykit.checkpoints",
    "seeded_noise": "paritykit.checkpoints",
    # comparison and diagnoses
    "TensorComparison": "paritykit.compare",
    "compare_tensors": "paritykit.compare",
    "compare_outputs": "paritykit.compare",
    "compare_tensor_sets": "paritykit.compare",
    "assert_parity": "paritykit.compare",
    "Hint": "paritykit.diagnose",
    "default_tolerances": "paritykit.compare",
    "OutputComparison": "paritykit.compare",
    "SetComparison": "paritykit.compare",
    "compare_paths": "paritykit.compare",
    # tensor I/O
    "load_tensors": "paritykit.io",
    "load_state_dict": "paritykit.io",
    "safe_torch_load": "paritykit.io",
    # forensics
    "config_diff": "paritykit.configs",
    "weights_diff": "paritykit.weights",
    "load_config": "paritykit.configs",
    "derive_from_ldm": "paritykit.config_ldm",
    "suggest_map": "paritykit.config_suggest",
    "read_safetensors_header": "paritykit.safetensors_header",
    "infer_conversion_map": "paritykit.convert",
    "ConversionMap": "paritykit.convert",
    "emit_rules": "paritykit.convert",
    "apply_rules_to_state_dict": "paritykit.convert",
    "match_modules": "paritykit.convert",
    # culprit search
    "capture": "paritykit.trace",
    "align_modules": "paritykit.align",
    "first_divergence": "paritykit.search",
    "bisect": "paritykit.search",
    "bisect_traces": "paritykit.search",
    "BisectReport": "paritykit.search",
    "Culprit": "paritykit.evidence",
    "culprit_evidence": "paritykit.evidence",
    "config_differences": "paritykit.evidence",
    "identify_function": "paritykit.evidence",
    "Trace": "paritykit.trace",
    "Alignment": "paritykit.align",
    "fit_module": "paritykit.module_fit",
    "ModuleFit": "paritykit.module_fit",
    "zoom_bisect": "paritykit.zoom",
    "ModelWeights": "paritykit.trace",
    "step_curve": "paritykit.visual",
    "compare_images": "paritykit.visual",
    "compare_gradients": "paritykit.gradients",
    "StepCurve": "paritykit.visual",
    "ImageComparison": "paritykit.visual",
    "classify_growth": "paritykit.visual",
    "GradientComparison": "paritykit.gradients",
    # sampling loops
    "compare_schedules": "paritykit.schedule",
    "fit_scheduler": "paritykit.schedule",
    "record_loop": "paritykit.recording",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'paritykit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
