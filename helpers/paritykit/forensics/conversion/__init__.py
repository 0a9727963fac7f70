r"""Conversion inference (``paritykit weights map``): which source tensor, through which layout op, becomes
each target tensor, collapsed into rules and emitted as code.

The flow, one module per stage: ``loading`` (both sides as state dicts, memory-mapped) → ``fingerprints``
(value hashes that survive layout ops; exact confirmation of the op) → ``matching`` (the matcher: every target
paired with its source, ties settled by structure and ``names``) → ``rules`` (exact mappings collapsed into
regex rules) → ``checks`` (warnings on mappings that still look wrong) → ``results`` (the ``ConversionMap``
report) → ``emit`` (rules applied to a state dict, or written as a module whose ops come from ``runtime``).
``bounded`` compacts offloaded weights so only ambiguous tensors are read; ``modules`` pairs modules from it.
"""

from paritykit.base.lazy import lazy_exports

# public name -> the module that defines it
EXPORTS = {
    "infer_conversion_map": "paritykit.forensics.conversion.matching",
    "ConversionMap": "paritykit.forensics.conversion.results",
    "ConversionRule": "paritykit.forensics.conversion.results",
    "MappingEntry": "paritykit.forensics.conversion.results",
    "describe_op": "paritykit.forensics.conversion.results",
    "collapse_rules": "paritykit.forensics.conversion.rules",
    "conversion_warnings": "paritykit.forensics.conversion.checks",
    "emit_rules": "paritykit.forensics.conversion.emit",
    "apply_rules_to_state_dict": "paritykit.forensics.conversion.emit",
    "render_rules_module": "paritykit.forensics.conversion.emit",
    "match_modules": "paritykit.forensics.conversion.modules",
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, EXPORTS)
