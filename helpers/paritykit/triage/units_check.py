r"""Whether two schedules that agree only read in other units (``1 - t``, ``× 1000``, EDM's ``ln(σ)/4``) are
one schedule: the port's denoiser is fed the reference's call-0 inputs with the timestep read so and as
given, and the one that comes closer to the reference's recorded output says which the port's network takes
(round 32: a port feeding its network the scheduler's σ where the research feeds flow time t = 1 - σ was
"ruled out: the 16 timesteps agree (… the port 1 - t: compared and replayed so)")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from paritykit.base.report import format_number

# one reading "comes closer" when its error is at most this share of the other's
CLOSER = 0.5


@dataclass(frozen=True)
class UnitsMeasured:
    r"""The port's denoiser output against the reference's at call 0, relative L2: fed the timestep read in
    the other units (``mapped``) and as the reference gives it (``given``)."""

    mapped: float
    given: float
    call: int = 0

    @property
    def supported(self) -> bool:
        return self.mapped <= CLOSER * self.given

    @property
    def contradicted(self) -> bool:
        return self.given <= CLOSER * self.mapped

    def words(self) -> str:
        return (
            f"the port's denoiser fed the reference's call-{self.call} inputs with the timestep read so is at"
            f" relative error {format_number(self.mapped)} of the reference's output, fed it as the reference"
            " gives it"
            f" {format_number(self.given)}"
        )


def units_measured(
    ref_denoiser: Any,
    port_denoiser: Any,
    ref_call: Any,
    ref_roles: Any,
    port_call: Any,
    port_roles: Any,
    t_units: Any,
    layout: Any = None,
    sign: float = 1.0,
    call: int = 0,
) -> UnitsMeasured | None:
    r""":class:`UnitsMeasured` for call ``call`` (the calls given), against the reference's output times
    ``sign`` (-1 where the port keeps the opposite sign convention at every call); ``None`` when a side has no
    module or no timestep to swap, or a run cannot be made or compared (then nothing is settled)."""
    import torch

    from paritykit.base.inputs import copy_inputs, to_device
    from paritykit.bisection.leaves import module_device
    from paritykit.compare.tensors import relative_error
    from paritykit.tracing.recording import output_tensor
    from paritykit.triage.roles import kept_own, with_reference_values

    if not isinstance(port_denoiser, torch.nn.Module) or not (ref_roles.timestep and port_roles.timestep):
        return None
    target = output_tensor(ref_call.output)
    if not isinstance(target, torch.Tensor):
        return None
    target = target * sign
    own = kept_own(
        ref_call, ref_roles, port_call, port_roles, layout=layout.to_port if layout is not None else None
    )
    if own:  # an input left the port's own: no replay on the reference's inputs, nothing settled
        return None
    errors = []
    for units in (t_units, None):
        args, kwargs = with_reference_values(
            ref_call,
            ref_roles,
            port_call,
            port_roles,
            t_units=units,
            layout=layout.to_port if layout is not None else None,
        )
        try:
            with torch.no_grad():
                args, kwargs = copy_inputs(to_device((args, kwargs), module_device(port_denoiser)))
                out = output_tensor(port_denoiser(*args, **kwargs))
        except Exception:  # a module that cannot take the other reading: nothing settled
            return None
        if layout is not None and isinstance(out, torch.Tensor):
            out = layout.to_reference(out)
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(target.shape):
            return None
        errors.append(relative_error(out.detach().cpu().double(), target.detach().cpu().double()))
    return UnitsMeasured(*errors, call=call)
