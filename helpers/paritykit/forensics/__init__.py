r"""Static forensics, no forward pass needed: weights diffed tensor by tensor (``weights``), the conversion
between two checkpoints inferred from values (``conversion``), configs diffed key by key (``configs``, with
``config_files``, ``config_ldm``, ``config_defaults``, ``config_suggest``), and safetensors headers read
without loading a tensor (``safetensors_header``)."""

from paritykit.base.lazy import lazy_exports

# public name -> the module that defines it
EXPORTS = {
    "weights_diff": "paritykit.forensics.weights",
    "config_diff": "paritykit.forensics.configs",
    "load_config": "paritykit.forensics.config_files",
    "derive_from_ldm": "paritykit.forensics.config_ldm",
    "suggest_map": "paritykit.forensics.config_suggest",
    "read_safetensors_header": "paritykit.forensics.safetensors_header",
    "infer_conversion_map": "paritykit.forensics.conversion.matching",
    "ConversionMap": "paritykit.forensics.conversion.results",
    "emit_rules": "paritykit.forensics.conversion.emit",
    "apply_rules_to_state_dict": "paritykit.forensics.conversion.emit",
    "match_modules": "paritykit.forensics.conversion.modules",
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, EXPORTS)
