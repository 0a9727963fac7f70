r"""Module alignment from a conversion map: which module of one model holds the tensors of which module of the
other."""

from __future__ import annotations

from typing import Any

from paritykit.forensics.conversion.matching import infer_conversion_map
from paritykit.forensics.conversion.names import module_of_tensor
from paritykit.forensics.conversion.results import ConversionMap


def match_modules(
    source: Any,
    target: Any,
    *,
    conversion_map: ConversionMap | None = None,
    include_ambiguous: bool = True,
) -> dict[str, list[str]]:
    r"""Align the modules of two differently named models through the values of their parameters.

    A target module corresponds to a source module when the target's parameters are built from that
    module's parameters (by any op :func:`infer_conversion_map` finds). The module of a parameter is its
    name without the last dotted component (``blocks.0.attn.qkv.weight`` -> ``blocks.0.attn.qkv``; a
    top-level parameter belongs to ``""``).

    The two sides must hold the same VALUES (the port loaded with the reference's converted weights, or two
    checkpoints of one training run); freshly initialised models with independent seeds share nothing.

    Fused <-> split layouts give 1:N alignments: a fused ``attn.qkv`` in SOURCE aligns with ``attn.to_q``,
    ``attn.to_k`` and ``attn.to_v`` in TARGET (each of those lists ``[attn.qkv]``); a target module built by
    concatenating several source modules lists all of them.

    Args:
        source: the reference's parameters: ``dict[str, Tensor]`` (``named_parameters()``/``state_dict()``
            form), a module (its ``state_dict()`` is used) or a checkpoint path.
        target: the port's parameters, same forms.
        conversion_map: reuse an already inferred map of the same two inputs instead of inferring again.
        include_ambiguous: also use parameters whose values several sources share (constant or
            freshly initialised tensors such as LayerNorm weights of ones); their source is the candidate
            whose name fits best. With ``False`` only value-unique evidence counts, which can leave such
            modules (norms) out.
    Returns:
        ``{target_module: [source_module, …]}`` in target parameter order; each list is ordered by how many
        parameters support it (most first). Target modules without explained parameters are absent.
    """
    cmap = conversion_map if conversion_map is not None else infer_conversion_map(source, target)
    ambiguous = {a.target for a in cmap.ambiguous}
    votes: dict[str, dict[str, int]] = {}
    for entry in cmap.mapping:
        if entry.target in ambiguous and not include_ambiguous:
            continue
        counts = votes.setdefault(module_of_tensor(entry.target), {})
        for s in entry.sources:
            mod = module_of_tensor(s)
            counts[mod] = counts.get(mod, 0) + 1
    return {t: sorted(c, key=lambda m: -c[m]) for t, c in votes.items()}
