r"""What a run leaves behind to compare: module calls captured by forward hooks (``trace``), pipeline
checkpoints saved, stopped at and reloaded (``checkpoints``), the calls of a sampling loop's denoiser
(``recording``), and inputs shaped for a diffusers model class (``shaped_inputs``)."""

from paritykit.base.lazy import lazy_exports

# public name -> the module that defines it
EXPORTS = {
    "Trace": "paritykit.tracing.trace",
    "ModelWeights": "paritykit.tracing.split_traces",
    "capture": "paritykit.tracing.trace",
    "Checkpoint": "paritykit.tracing.checkpoints",
    "PipelineStop": "paritykit.tracing.checkpoints",
    "CheckpointNotReached": "paritykit.tracing.checkpoints",
    "maybe_checkpoint": "paritykit.tracing.checkpoints",
    "run_until_stop": "paritykit.tracing.checkpoints",
    "save_checkpoints": "paritykit.tracing.checkpoints",
    "load_checkpoints": "paritykit.tracing.checkpoints",
    "seeded_noise": "paritykit.tracing.checkpoints",
    "record_loop": "paritykit.tracing.recording",
    "model_inputs": "paritykit.tracing.shaped_inputs",
    "tiny_config": "paritykit.tracing.shaped_inputs",
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, EXPORTS)
