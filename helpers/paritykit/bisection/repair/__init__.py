r"""The repair search: at a culprit, try the small edits that could turn the port's computation into the
reference's (a grammar over parameters, inputs, outputs and settings, cheapest first), replay each on the
captured inputs, and keep only those that make the numbers agree. ``edits`` defines the edit classes, their
cost table and the constants fitted numbers snap to; ``grammar`` generates the candidates of the parameter,
input, output and use tiers, ``settings`` those of the settings tier; ``site`` says where the search runs;
``engine`` runs it within a budget counted in edits; ``culprit_sites`` builds the sites at a culprit and joins
the verified edits to the catalogue's hints."""

from paritykit.base.lazy import lazy_exports

# public name -> the module that defines it
EXPORTS = {
    "Edit": "paritykit.bisection.repair.edits",
    "RepairHint": "paritykit.bisection.repair.edits",
    "Site": "paritykit.bisection.repair.site",
    "Budget": "paritykit.bisection.repair.engine",
    "RepairOutcome": "paritykit.bisection.repair.engine",
    "repair_site": "paritykit.bisection.repair.engine",
    "RepairOptions": "paritykit.bisection.repair.culprit_sites",
    "culprit_site": "paritykit.bisection.repair.culprit_sites",
    "repair_hints": "paritykit.bisection.repair.culprit_sites",
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, EXPORTS)
