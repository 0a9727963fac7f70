r"""An original LDM-style YAML (``model.params.unet_config``, ``first_stage_config``) read as diffusers
configs.

The translation is diffusers' own: ``create_unet_diffusers_config_from_ldm`` and
``create_vae_diffusers_config_from_ldm`` from ``diffusers.loaders.single_file_utils``, the functions
``from_single_file`` uses. paritykit adds only bookkeeping around them: which YAML keys they read (a key they
never read has no diffusers counterpart and is reported as reference only, never compared) and a one-line
error naming the key a helper needed and the YAML lacks.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from paritykit.base.errors import ParityKitError

UNET_HELPER = "create_unet_diffusers_config_from_ldm"
VAE_HELPER = "create_vae_diffusers_config_from_ldm"
HELPERS = {"unet": UNET_HELPER, "vae": VAE_HELPER}
# The YAML section each part needs, as diffusers' helpers look for it (SGM configs say network_config).
_SECTIONS = {"unet": ("unet_config", "network_config"), "vae": ("first_stage_config",)}
_PART_CLASSES = {"UNet2DConditionModel": "unet", "AutoencoderKL": "vae"}


def _model_params(config: Mapping[str, Any]) -> Mapping[str, Any] | None:
    model = config.get("model")
    params = model.get("params") if isinstance(model, Mapping) else None
    return params if isinstance(params, Mapping) else None


def _has_section(config: Mapping[str, Any], part: str) -> bool:
    params = _model_params(config) or {}
    return any(isinstance(params.get(name), Mapping) for name in _SECTIONS[part])


def is_ldm_config(config: Mapping[str, Any]) -> bool:
    r"""True for an original LDM / SGM YAML: ``model.params`` holds a ``unet_config`` (or ``network_config``)
    or a ``first_stage_config``."""
    return _has_section(config, "unet") or _has_section(config, "vae")


@dataclass
class LdmDerivation:
    r"""What diffusers' helpers made of an LDM YAML.

    Attributes:
        config: the derived diffusers config; for a pipeline target ``{"unet": {…}, "vae": {…}}``.
        parts: ``{prefix: helper name}``; prefix ``""`` when the target is one model.
        read: dotted YAML paths the helpers (and the image size lookup) read.
        reference_only: YAML leaf keys nothing read: no diffusers counterpart, not compared.
        notes: what could not be derived, in words.
        underived: the port's keys the YAML should decide but does not (``sample_size`` without an image
            size).
        source: the YAML as loaded.
    """

    config: dict[str, Any]
    parts: dict[str, str]
    read: set[str] = field(default_factory=set)
    reference_only: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    underived: list[str] = field(default_factory=list)
    source: dict[str, Any] = field(default_factory=dict)

    def reference_only_summary(self, keys: list[str] | None = None) -> list[str]:
        r"""``keys`` (default: all reference-only keys) with every wholly unread subtree folded into
        ``prefix.*``."""
        keys = self.reference_only if keys is None else keys
        summary: list[str] = []
        for key in keys:
            parts = key.split(".")
            top = key
            for depth in range(1, len(parts)):
                prefix = ".".join(parts[:depth])
                if prefix not in self.read:
                    top = prefix + ".*"
                    break
            if top not in summary:
                summary.append(top)
        return summary


class _Recorder(dict):
    """A dict that notes the dotted path of every key read from it (and the first one missing)."""

    def __init__(self, data: Mapping[str, Any], path: str, log: dict[str, Any]):
        super().__init__(
            (k, _Recorder(v, f"{path}{k}.", log) if isinstance(v, Mapping) else v) for k, v in data.items()
        )
        self._path = path
        self._log = log

    def __getitem__(self, key: Any) -> Any:
        path = f"{self._path}{key}"
        if not dict.__contains__(self, key):
            self._log.setdefault("missing", path)
            raise KeyError(key)
        self._log["read"].add(path)
        return dict.__getitem__(self, key)

    def get(self, key: Any, default: Any = None) -> Any:
        return self[key] if dict.__contains__(self, key) else default


def ldm_targets(
    target: Mapping[str, Any], class_name: str | None = None, *, target_label: str = "the port"
) -> dict[str, str]:
    r"""Which derived config each part of the port's config is compared with: ``{prefix: "unet" | "vae"}``.

    A pipeline's components are matched by class (``UNet2DConditionModel``, ``AutoencoderKL``); a single model
    by ``class_name`` or its ``_class_name``, and without a class by its keys (``latent_channels`` without
    ``cross_attention_dim`` is an autoencoder). Raises :class:`ParityKitError` when nothing fits: a wrong
    pairing would report every key as a difference.
    """
    components = {
        name: value.get("_class") or value.get("_class_name")
        for name, value in target.items()
        if isinstance(value, Mapping) and "_class" in value
    }
    if components:
        parts = {name: _PART_CLASSES[cls] for name, cls in components.items() if cls in _PART_CLASSES}
        if not parts:
            raise ParityKitError(
                f"{target_label}: pipeline has no UNet2DConditionModel or AutoencoderKL component to compare"
                " with the LDM YAML (use --no-ldm to compare raw keys)"
            )
        return parts
    name = class_name or target.get("_class_name") or ""
    if name in _PART_CLASSES:
        return {"": _PART_CLASSES[name]}
    if name:
        raise ParityKitError(
            f"{target_label}: diffusers' single-file helpers (--ldm) derive UNet2DConditionModel and"
            f" AutoencoderKL configs, not {name} (use --no-ldm to compare raw keys)"
        )
    if "latent_channels" in target and "cross_attention_dim" not in target:
        return {"": "vae"}
    return {"": "unet"}


def derive_from_ldm(
    yaml_config: Mapping[str, Any],
    target: Mapping[str, Any],
    *,
    label: str,
    class_name: str | None = None,
    target_label: str = "the port",
) -> LdmDerivation:
    r"""Derive the diffusers config(s) the port's config should equal, with diffusers' single-file helpers.

    Args:
        yaml_config: the loaded LDM YAML.
        target: the port's loaded config (one model, or a pipeline with ``unet`` / ``vae`` components).
        label: the YAML's name for error messages.
        target_label: the port config's name for error messages.
        class_name: the port's class when its config has no ``_class_name``.

    Returns:
        An :class:`LdmDerivation`. Raises :class:`ParityKitError` naming the YAML and the missing key when the
        YAML lacks what a helper needs.
    """
    if not is_ldm_config(yaml_config):
        raise ParityKitError(
            f"{label}: --ldm needs an LDM-style YAML (model.params.unet_config or"
            " model.params.first_stage_config)"
        )
    targets = ldm_targets(target, class_name, target_label=target_label)
    for part in set(targets.values()):
        if not _has_section(yaml_config, part):
            raise ParityKitError(
                f"{label}: the port is a {part} but the YAML has no model.params.{_SECTIONS[part][0]} to"
                " derive it from"
            )
    log: dict[str, Any] = {"read": set()}
    recorder = _Recorder(yaml_config, "", log)
    derived: dict[str, dict[str, Any]] = {}
    notes: list[str] = []
    for part in sorted(set(targets.values())):
        derived[part] = _derive_part(part, recorder, log, label, notes)
    config = (
        derived[targets[""]] if "" in targets else {prefix: derived[part] for prefix, part in targets.items()}
    )
    result = LdmDerivation(
        config=config,
        parts={prefix: HELPERS[part] for prefix, part in targets.items()},
        read=log["read"],
        notes=notes,
        source=dict(yaml_config),
    )
    for prefix, part in targets.items():
        if any(note.startswith(f"{part}.sample_size") for note in notes):
            result.underived.append(f"{prefix}.sample_size" if prefix else "sample_size")
    from paritykit.forensics.config_files import flatten

    result.reference_only = [key for key in flatten(yaml_config) if key not in result.read]
    return result


def _derive_part(
    part: str, recorder: _Recorder, log: dict[str, Any], label: str, notes: list[str]
) -> dict[str, Any]:
    from diffusers.loaders import single_file_utils

    helper = getattr(single_file_utils, HELPERS[part])
    log.pop("missing", None)
    try:
        image_size = _pixel_size(recorder)
        with warnings.catch_warnings():
            # passing image_size is deprecated for from_single_file users; here it is the YAML's own value
            warnings.simplefilter("ignore", FutureWarning)
            config = dict(helper(recorder, {}, image_size=image_size))
    except KeyError:
        missing = log.get("missing", "a key")
        raise ParityKitError(
            f"{label}: diffusers' {HELPERS[part]} needs {missing}, which the YAML lacks"
        ) from None
    except (TypeError, ValueError, AttributeError, IndexError, ZeroDivisionError, AssertionError) as exc:
        detail = str(exc) or f"{type(exc).__name__} inside the helper"
        raise ParityKitError(
            f"{label}: diffusers' {HELPERS[part]} cannot read this YAML ({detail})"
        ) from None
    if image_size is None:
        # without the YAML's image size the helper falls back to a guess from checkpoint keys: not a claim
        config.pop("sample_size", None)
        notes.append(f"{part}.sample_size not derived: the YAML has no model.params.image_size")
    return _plain(config)


def _pixel_size(recorder: _Recorder) -> int | None:
    r"""The pixel image size diffusers' helpers expect, from the latent ``model.params.image_size``.

    The helpers divide ``image_size`` by the autoencoder's downsampling, 2 ** (len(ch_mult) - 1), to get the
    UNet's ``sample_size``; the YAML states the latent size, so multiply it back.
    """
    params = recorder["model"]["params"]
    latent = params.get("image_size")
    if not isinstance(latent, int) or isinstance(latent, bool):
        return None
    ch_mult = params["first_stage_config"]["params"]["ddconfig"]["ch_mult"]
    return latent * 2 ** (len(ch_mult) - 1)


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in dict.items(value)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
