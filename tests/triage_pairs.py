r"""Sampling pipelines for the triage tests: a research DDIM sampler with the original LDM decoder, and a
diffusers-style port of it, with one bug planted in any of the places a port can go wrong.

The reference is written from the papers and the original code, never from diffusers: the DDIM loop is
``tests.reference_loops.ddim_loop`` (Song et al. 2020, eq. 12, eta 0, linspace timesteps, the last step to
alpha-bar 1) and the decoder is taming's ``Decoder`` (the Stable Diffusion VAE code) behind the LDM's
``post_quant_conv``, latents divided by the LDM scale factor 0.18215 and the image mapped from [-1, 1] with
``clamp((x + 1) / 2)``. The port runs diffusers' ``DDIMScheduler`` in a pipeline's loop,
``AutoencoderKL.decode``
with weights converted by diffusers' own LDM converter, and its image processor's ``x / 2 + 0.5``.
Both draw their noise from torch's global generator, which ``paritykit triage`` seeds before each side.
"""

from __future__ import annotations

import copy

import torch
from diffusers import DDIMScheduler

from tests.gallery import vae as gallery_vae
from tests.reference_loops import ddim_loop
from tests.sampling import port_loop, tiny_cond_unet

STEPS = 5  # divides 1000: diffusers DDIM steps to t - 1000 // n, the next trailing timestep only then
LDM_SCALE = 0.18215
BUGS = (
    "noise-bf16",  # initial noise: the port draws its latents in bfloat16
    "noise-f64",  # initial noise: the port draws its latents in float64, then casts (same seed)
    "noise-seed",  # initial noise: the port draws from a generator of its own, seeded 1234
    # schedule: DDIMScheduler's default "leading" spacing where the reference uses trailing
    "spacing-leading",
    "cond-bf16",  # conditioning: the port hands the denoiser its prompt embedding in bfloat16
    # conditioning: the port pads the prompt embedding with two zero rows (the reference pads nothing)
    "cond-padded",
    "double-call",  # call structure: the port calls its denoiser twice per step (guidance halves, unbatched)
    "timestep-bf16",  # schedule: the port hands its denoiser each timestep rounded to bfloat16
    "norm-eps",  # denoiser: one GroupNorm of the port's UNet built with eps 1e-3
    "v-prediction",  # update: the port's scheduler reads the output as v where the model predicts epsilon
    "final-alpha",  # update: the last step goes to alpha-bar[0] in the port, to 1 in the reference
    "sdxl-scale",  # decoder input: the port divides the latents by SDXL's 0.13025
    "decoder-groups",  # decoder: a GroupNorm of the port's decoder built with 16 groups (gallery bug)
    "no-denormalize",  # post-processing: the port returns the decoder's [-1, 1] output as the image
    "ema",  # weights: the reference samples with EMA weights swapped in; the port converted the live ones
)


class Pair:
    r"""Both sides of one planted pair: the modules the triage SPEC hands out and the two runs."""

    def __init__(self, bugs: set[str], vae: bool = True):
        unknown = bugs - set(BUGS)
        if unknown:
            raise ValueError(f"unknown bugs {sorted(unknown)}")
        self.bugs, self.with_vae = bugs, vae
        self.ref_unet = tiny_cond_unet()
        self.port_unet = copy.deepcopy(self.ref_unet)
        if "norm-eps" in bugs:
            self.port_unet.down_blocks[1].resnets[0].norm1.eps = 1e-3
        built = gallery_vae.build("distinct", "num-groups" if "decoder-groups" in bugs else None)
        self.ref_ae, self.port_ae = built.reference.eval(), built.port.eval()
        self.cond = torch.randn(1, 3, 8, generator=torch.Generator().manual_seed(5))
        # an EMA copy of the reference's weights that differs from the live ones (one conv), swapped in only
        # while the reference samples, as an ``ema_scope`` does
        self.ema = None
        if "ema" in bugs:
            self.ema = {k: v.clone() for k, v in self.ref_unet.state_dict().items()}
            self.ema["conv_in.weight"] = self.ema["conv_in.weight"] * 0.9

    # the SPEC's functions ------------------------------------------------------------------------------
    def run_reference(self, steps: int = STEPS) -> torch.Tensor:
        noise = torch.randn(1, 4, 8, 8)
        live = None
        if self.ema is not None:
            live = {k: v.clone() for k, v in self.ref_unet.state_dict().items()}
            self.ref_unet.load_state_dict(self.ema)
        x = ddim_loop(
            lambda x, t, c: self.ref_unet(x, t, encoder_hidden_states=c).sample,
            noise,
            self.cond,
            steps,
            spacing="trailing",
        )
        if live is not None:
            self.ref_unet.load_state_dict(live)
        if not self.with_vae:
            return x
        image = self.ref_ae.decoder(self.ref_ae.post_quant_conv(1.0 / LDM_SCALE * x))
        return torch.clamp((image + 1.0) / 2.0, min=0.0, max=1.0)

    def port_scheduler(self) -> DDIMScheduler:
        return DDIMScheduler(
            beta_schedule="scaled_linear",
            beta_start=0.00085,
            beta_end=0.012,
            clip_sample=False,
            set_alpha_to_one="final-alpha" not in self.bugs,
            timestep_spacing="leading" if "spacing-leading" in self.bugs else "trailing",
            prediction_type="v_prediction" if "v-prediction" in self.bugs else "epsilon",
        )

    def run_port(self, steps: int = STEPS, scheduler: DDIMScheduler | None = None) -> torch.Tensor:
        if "noise-f64" in self.bugs:  # round 16 (x-unet): randn_tensor(..., dtype=torch.float64) then cast
            noise = torch.randn(1, 4, 8, 8, dtype=torch.float64).float()
        elif "noise-seed" in self.bugs:
            noise = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(1234))
        else:
            noise = torch.randn(
                1, 4, 8, 8, dtype=torch.bfloat16 if "noise-bf16" in self.bugs else torch.float32
            )
        scheduler = scheduler or self.port_scheduler()
        cond = self.cond.bfloat16().float() if "cond-bf16" in self.bugs else self.cond
        if "cond-padded" in self.bugs:
            cond = torch.cat([cond, cond.new_zeros(1, 2, cond.shape[-1])], dim=1)
        if "timestep-bf16" in self.bugs:
            scheduler.set_timesteps(steps)
            latents = noise.float()
            for t in scheduler.timesteps:
                rounded = t.to(torch.bfloat16).to(t.dtype)
                eps = self.port_unet(latents, rounded, encoder_hidden_states=cond).sample
                latents = scheduler.step(eps, t, latents, return_dict=False)[0]
        elif "double-call" in self.bugs:
            scheduler.set_timesteps(steps)
            latents = noise.float()
            for t in scheduler.timesteps:
                uncond = self.port_unet(latents, t, encoder_hidden_states=cond).sample
                eps = self.port_unet(latents, t, encoder_hidden_states=cond).sample
                latents = scheduler.step(uncond + 1.0 * (eps - uncond), t, latents, return_dict=False)[0]
        else:
            latents = port_loop(self.port_unet, scheduler, noise.float(), cond, n=steps)
        if not self.with_vae:
            return latents
        scale = 0.13025 if "sdxl-scale" in self.bugs else LDM_SCALE
        image = self.port_ae.decode(latents / scale).sample
        return image if "no-denormalize" in self.bugs else (image / 2 + 0.5).clamp(0, 1)


def port_steps(
    scheduler: DDIMScheduler, steps: int, predict, latents: torch.Tensor | None = None
) -> torch.Tensor:
    r"""A port's loop: ``predict(latents, t)`` gives the model output and the latents the step starts from."""
    scheduler.set_timesteps(steps)
    latents = torch.randn(1, 4, 8, 8) if latents is None else latents
    for t in scheduler.timesteps:
        out, latents = predict(latents, t)
        latents = scheduler.step(out, t, latents, return_dict=False)[0]
    return latents


# --- what `paritykit new triage-spec` names: a pipeline object and the reference's functions ----------------
_CLEAN: Pair | None = None


def clean_pair() -> Pair:
    global _CLEAN
    if _CLEAN is None:
        _CLEAN = Pair(set())
    return _CLEAN


class PortPipeline:
    r"""The clean port as a pipeline object: ``unet``, ``vae``, ``scheduler`` and a ``__call__`` that returns
    ``.images``, as a diffusers pipeline does."""

    def __init__(self):
        self.pair = clean_pair()
        self.unet, self.vae, self.scheduler = (
            self.pair.port_unet,
            self.pair.port_ae,
            self.pair.port_scheduler(),
        )

    def set_progress_bar_config(self, **options) -> None:
        pass

    def to(self, *args, **kwargs) -> PortPipeline:
        return self

    def __call__(self, num_inference_steps: int = STEPS, output_type: str = "pt"):
        images = self.pair.run_port(num_inference_steps, self.scheduler)
        return type("Output", (), {"images": images})()


def reference(num_inference_steps: int = STEPS) -> torch.Tensor:
    return clean_pair().run_reference(num_inference_steps)


def reference_unet() -> torch.nn.Module:
    return clean_pair().ref_unet


def reference_decoder() -> torch.nn.Module:
    return clean_pair().ref_ae.decoder


SPEC_TEXT = """
from tests.triage_pairs import Pair

PAIR = Pair({bugs!r}, vae={vae!r})
run_reference = PAIR.run_reference
run_port = PAIR.run_port
port_scheduler = PAIR.port_scheduler


def reference_denoiser():
    return PAIR.ref_unet


def port_denoiser():
    return PAIR.port_unet
"""

VAE_TEXT = """

def reference_vae():
    return PAIR.ref_ae.decoder


def port_vae():
    return PAIR.port_ae.decoder
"""


def spec_for(folder, name: str, pair: str, made: str, reference: str = "", port: str = ""):
    r"""A triage SPEC file ``name`` in ``folder`` for test pair class ``pair``, built by the expression
    ``made``; ``reference`` / ``port``: the pair attributes its denoisers are (default: the UNets)."""
    text = SPEC_TEXT.replace("import Pair", f"import {pair}").replace("Pair({bugs!r}, vae={vae!r})", made)
    if reference:
        text = text.replace("PAIR.ref_unet", f"PAIR.{reference}")
    if port:
        text = text.replace("PAIR.port_unet", f"PAIR.{port}")
    path = folder / name
    path.write_text(text)
    return path


def write_spec(folder, bugs=(), vae: bool = True, name: str = "triage_spec.py"):
    r"""A triage SPEC for the pair with ``bugs`` planted, written into ``folder``; returns its path."""
    path = folder / name
    path.write_text(SPEC_TEXT.format(bugs=set(bugs), vae=vae) + (VAE_TEXT if vae else ""))
    return path


class ListDenoiser(torch.nn.Module):
    r"""A research denoiser's calling convention: ``x`` and ``context`` are lists of per-sample tensors and
    the result is a list too (as the Wan research model takes and returns them)."""

    def __init__(self, unet: torch.nn.Module):
        super().__init__()
        self.unet = unet

    def forward(self, x: list, t: torch.Tensor, context: list) -> list:
        out = self.unet(torch.stack(x), t, encoder_hidden_states=torch.stack(context)).sample
        return list(out.unbind(0))


class ListPair(Pair):
    r"""The pair whose reference calls its denoiser with lists of per-sample tensors."""

    def __init__(self, bugs: set[str]):
        super().__init__(bugs, vae=False)
        self.ref_lists = ListDenoiser(self.ref_unet)

    def run_reference(self, steps: int = STEPS) -> torch.Tensor:
        noise = torch.randn(1, 4, 8, 8)
        context = list(self.cond.unbind(0))

        def eps(x, t, _cond):
            return torch.stack(self.ref_lists(list(x.unbind(0)), t, context))

        return ddim_loop(eps, noise, self.cond, steps, spacing="trailing")


LIST_SPEC_TEXT = (
    SPEC_TEXT.replace("import Pair", "import ListPair")
    .replace("Pair({bugs!r}, vae={vae!r})", "ListPair({bugs!r})")
    .replace("PAIR.ref_unet", "PAIR.ref_lists")
)


def write_list_spec(folder, bugs=()):
    r"""A triage SPEC for :class:`ListPair` with ``bugs`` planted."""
    path = folder / "list_spec.py"
    path.write_text(LIST_SPEC_TEXT.format(bugs=set(bugs)))
    return path


class UnitDenoiser(torch.nn.Module):
    r"""A research denoiser that takes its timestep in [0, 1] (t / 1000) and scales it for the network."""

    def __init__(self, unet: torch.nn.Module):
        super().__init__()
        self.unet = unet

    def forward(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        return self.unet(x, t * 1000, encoder_hidden_states=context).sample


class UnitPair(Pair):
    r"""The pair whose reference passes timesteps in [0, 1] where the port passes them in [0, 1000]."""

    def __init__(self, bugs: set[str]):
        super().__init__(bugs, vae=False)
        self.ref_units = UnitDenoiser(self.ref_unet)

    def run_reference(self, steps: int = STEPS) -> torch.Tensor:
        noise = torch.randn(1, 4, 8, 8)
        return ddim_loop(
            lambda x, t, c: self.ref_units(x, torch.as_tensor(t, dtype=torch.float32) / 1000, c),
            noise,
            self.cond,
            steps,
            spacing="trailing",
        )


UNIT_SPEC_TEXT = LIST_SPEC_TEXT.replace("ListPair", "UnitPair").replace("PAIR.ref_lists", "PAIR.ref_units")


def write_unit_spec(folder, bugs=()):
    r"""A triage SPEC for :class:`UnitPair` with ``bugs`` planted."""
    path = folder / "unit_spec.py"
    path.write_text(UNIT_SPEC_TEXT.format(bugs=set(bugs)))
    return path


def pack(x: torch.Tensor) -> torch.Tensor:
    r"""(B, C, H, W) latents as (B, H/2·W/2, C·4) tokens: 2×2 patches, channels first in each token."""
    b, c, h, w = x.shape
    return x.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, h * w // 4, c * 4)


def unpack(x: torch.Tensor, h: int = 8, w: int = 8) -> torch.Tensor:
    b, _, d = x.shape
    c = d // 4
    return x.reshape(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)


class PackedDenoiser(torch.nn.Module):
    r"""A transformer-style port's denoiser: it takes and returns packed tokens (the UNet inside unpacks)."""

    def __init__(self, unet: torch.nn.Module):
        super().__init__()
        self.unet = unet

    def forward(
        self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor
    ):
        return pack(
            self.unet(unpack(hidden_states), timestep, encoder_hidden_states=encoder_hidden_states).sample
        )


class PackedPair(Pair):
    r"""The pair whose port keeps its latents packed into tokens from the first draw to the last step."""

    def __init__(self, bugs: set[str]):
        super().__init__(bugs, vae=False)
        self.packed = PackedDenoiser(self.port_unet)

    def run_port(self, steps: int = STEPS, scheduler: DDIMScheduler | None = None) -> torch.Tensor:
        def packed(x, t):
            return self.packed(x, t, self.cond), x

        latents = pack(torch.randn(1, 4, 8, 8))
        return unpack(port_steps(scheduler or self.port_scheduler(), steps, packed, latents))


PACKED_SPEC_TEXT = (
    SPEC_TEXT.replace("import Pair", "import PackedPair")
    .replace("Pair({bugs!r}, vae={vae!r})", "PackedPair({bugs!r})")
    .replace("return PAIR.port_unet", "return PAIR.packed")
)


def write_packed_spec(folder, bugs=()):
    r"""A triage SPEC for :class:`PackedPair` with ``bugs`` planted."""
    path = folder / "packed_spec.py"
    path.write_text(PACKED_SPEC_TEXT.format(bugs=set(bugs)))
    return path


class Guided(Pair):
    r"""Classifier-free guidance on both sides, each side's passes its own: subclasses give
    ``reference_passes(x, t, c)`` and ``port_passes(latents, t)``, each returning ``(uncond, cond)``."""

    SCALE = 3.0

    def __init__(self, bugs: set[str] | None = None):
        super().__init__(set(bugs or ()), vae=False)
        self.uncond = torch.randn(1, 3, 8, generator=torch.Generator().manual_seed(6))

    def run_reference(self, steps: int = STEPS) -> torch.Tensor:
        def guided(x, t, c):
            uncond, cond = self.reference_passes(x, t, c)
            return uncond + self.SCALE * (cond - uncond)

        return ddim_loop(guided, torch.randn(1, 4, 8, 8), self.cond, steps, spacing="trailing")

    def run_port(self, steps: int = STEPS, scheduler: DDIMScheduler | None = None) -> torch.Tensor:
        def guided(x, t):
            uncond, cond = self.port_passes(x, t)
            return uncond + self.SCALE * (cond - uncond), x

        return port_steps(scheduler or self.port_scheduler(), steps, guided)


class GuidancePair(Guided):
    r"""Guidance in one batched call: the reference stacks (uncond, cond), as the original LDM sampler does.
    ``order``: ``"same"`` (the port stacks it alike), ``"swapped"`` (the port stacks (cond, uncond) and reads
    its output's halves the same way round: the same result), ``"swapped-kept"`` (the port stacks (cond,
    uncond) but reads the halves as the reference does: guidance reversed)."""

    SCALE = 4.0

    def __init__(self, order: str):
        super().__init__()
        self.order = order

    def reference_passes(self, x, t, c):
        both = self.ref_unet(torch.cat([x, x]), t, encoder_hidden_states=torch.cat([self.uncond, c])).sample
        return both.chunk(2)

    def port_passes(self, latents, t):
        swapped = self.order != "same"
        embeds = torch.cat([self.cond, self.uncond] if swapped else [self.uncond, self.cond])
        both = self.port_unet(torch.cat([latents, latents]), t, encoder_hidden_states=embeds).sample
        first, second = both.chunk(2)
        return (second, first) if self.order == "swapped" else (first, second)


def write_guidance_spec(folder, order: str):
    r"""A triage SPEC for :class:`GuidancePair` with the port's batch ``order``."""
    path = folder / f"guidance_{order}.py"
    path.write_text(
        SPEC_TEXT.replace("import Pair", "import GuidancePair").replace(
            "Pair({bugs!r}, vae={vae!r})", f"GuidancePair({order!r})"
        )
    )
    return path


class Embedder(torch.nn.Module):
    r"""A conditioning embedder with a drop flag (F5-TTS's text embedding drops the text for the unconditional
    pass): ``drop=True`` embeds zeros."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, context: torch.Tensor, drop: bool = False) -> torch.Tensor:
        return self.proj(torch.zeros_like(context) if drop else context)


class PackedGuidance(torch.nn.Module):
    r"""The research side: one call per step computes both guidance passes as one batch, (cond, uncond),
    its embedder called twice inside, once with ``drop=True``."""

    def __init__(self, unet: torch.nn.Module, embed: Embedder):
        super().__init__()
        self.unet, self.embed = unet, embed

    def forward(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        both = torch.cat([self.embed(context), self.embed(context, drop=True)])
        return self.unet(torch.cat([x, x]), t, encoder_hidden_states=both).sample


class OnePass(torch.nn.Module):
    r"""The port side: one guidance pass per call, the drop flag an argument."""

    def __init__(self, unet: torch.nn.Module, embed: Embedder):
        super().__init__()
        self.unet, self.embed = unet, embed

    def forward(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor, drop: bool = False):
        return self.unet(x, t, encoder_hidden_states=self.embed(context, drop=drop)).sample


class GuidancePassesPair(Guided):
    r"""The reference packs its guidance passes into one batched call per step; the port calls its denoiser
    once per pass. ``bugs`` may hold ``"norm-eps"`` (one GroupNorm of the port's UNet with eps 1e-3)."""

    def __init__(self, bugs: set[str]):
        super().__init__()
        if "norm-eps" in bugs:
            self.port_unet.down_blocks[1].resnets[0].norm1.eps = 1e-3
        embed = Embedder()
        with torch.no_grad():
            for p in embed.parameters():
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(9)) * 0.5)
        self.ref_packed = PackedGuidance(self.ref_unet, embed)
        self.port_pass = OnePass(self.port_unet, copy.deepcopy(embed))

    def reference_passes(self, x, t, c):
        cond, uncond = self.ref_packed(x, t, c).chunk(2)
        return uncond, cond

    def port_passes(self, latents, t):
        cond = self.port_pass(latents, t, self.cond)  # the conditional pass first, as the reference stacks
        return self.port_pass(latents, t, self.cond, drop=True), cond


def write_passes_spec(folder, bugs=()):
    r"""A triage SPEC for :class:`GuidancePassesPair` with ``bugs`` planted."""
    path = folder / "passes_spec.py"
    text = (
        SPEC_TEXT.replace("import Pair", "import GuidancePassesPair")
        .replace("Pair({bugs!r}, vae={vae!r})", "GuidancePassesPair({bugs!r})")
        .replace("PAIR.ref_unet", "PAIR.ref_packed")
        .replace("PAIR.port_unet", "PAIR.port_pass")
    )
    path.write_text(text.format(bugs=set(bugs)))
    return path


class SplitPassesPair(Guided):
    r"""The reference calls its denoiser once per guidance pass (cond, then uncond), each on the latents as
    they are; the port runs both passes as one batch of the latents repeated, (uncond, cond) stacked."""

    def reference_passes(self, x, t, c):
        cond = self.ref_unet(x, t, encoder_hidden_states=c).sample
        return self.ref_unet(x, t, encoder_hidden_states=self.uncond).sample, cond

    def port_passes(self, latents, t):
        embeds = torch.cat([self.uncond, self.cond])
        return self.port_unet(torch.cat([latents, latents]), t, encoder_hidden_states=embeds).sample.chunk(2)


def write_split_spec(folder, bugs: tuple[str, ...] = ()):
    r"""A triage SPEC for :class:`SplitPassesPair` (with ``bugs`` of :class:`Pair` in its port)."""
    path = folder / "split_spec.py"
    text = SPEC_TEXT.replace("import Pair", "import SplitPassesPair").replace(
        "Pair({bugs!r}, vae={vae!r})", f"SplitPassesPair({set(bugs)!r})"
    )
    path.write_text(text)
    return path


class SquaredTime(torch.nn.Module):
    r"""A port's denoiser that takes its noise level as ``(t / 1000)²`` and turns it back into ``t`` inside:
    the same computation, called with other values."""

    def __init__(self, unet: torch.nn.Module):
        super().__init__()
        self.unet = unet

    def forward(self, x: torch.Tensor, level: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        return self.unet(x, level.sqrt() * 1000, encoder_hidden_states=context).sample


class SquaredTimePair(Pair):
    r"""The port passes the noise level as ``(t / 1000)²``, no unit map of the timestep (a scale, a flip)."""

    def __init__(self):
        super().__init__(set(), vae=False)
        self.squared = SquaredTime(self.port_unet)

    def run_port(self, steps: int = STEPS, scheduler: DDIMScheduler | None = None) -> torch.Tensor:
        def squared(x, t):
            return self.squared(x, (t.float() / 1000) ** 2, self.cond), x

        return port_steps(scheduler or self.port_scheduler(), steps, squared)


def write_squared_spec(folder):
    r"""A triage SPEC for :class:`SquaredTimePair`."""
    return spec_for(folder, "squared_spec.py", "SquaredTimePair", "SquaredTimePair()", port="squared")


# the clamp both sides put on the latents before the denoiser (an x0-style clip of the sampler's state)
CLAMP = 1.5


class ClampedStatePair(Pair):
    r"""The reference clamps its sampler state in place before each denoiser call (rectified-flow-pytorch's
    ``maybe_clip`` with ``clamp_``), so the update starts from the clamped state; the port
    (``clamp_copy=True``) clamps only the copy it feeds its denoiser and steps from the unclamped latents.
    Each call's inputs and output agree; the latents after it do not."""

    def __init__(self, clamp_copy: bool):
        super().__init__(set(), vae=False)
        self.clamp_copy = clamp_copy

    def run_reference(self, steps: int = STEPS) -> torch.Tensor:
        def denoiser(x, t, c):
            x.clamp_(-CLAMP, CLAMP)  # in place: the loop's own state
            return self.ref_unet(x, t, encoder_hidden_states=c).sample

        return ddim_loop(denoiser, torch.randn(1, 4, 8, 8), self.cond, steps, spacing="trailing")

    def run_port(self, steps: int = STEPS, scheduler: DDIMScheduler | None = None) -> torch.Tensor:
        def clamped(x, t):
            fed = x.clamp(-CLAMP, CLAMP)
            return self.port_unet(
                fed, t, encoder_hidden_states=self.cond
            ).sample, x if self.clamp_copy else fed

        return port_steps(scheduler or self.port_scheduler(), steps, clamped)


def write_clamped_spec(folder, clamp_copy: bool):
    r"""A triage SPEC for :class:`ClampedStatePair`."""
    made = f"ClampedStatePair(clamp_copy={clamp_copy!r})"
    return spec_for(folder, "clamped_spec.py", "ClampedStatePair", made)


class ShiftedTimePair(Pair):
    r"""The port's scheduler is right, and its loop feeds the denoiser ``t + 1`` (a conversion slip between
    the scheduler and the model); ``bugs`` may plant the Pair's own slips instead."""

    def __init__(self, shifted: bool, bugs: tuple[str, ...] = ()):
        super().__init__(set(bugs), vae=False)
        self.shifted = shifted

    def run_port(self, steps: int = STEPS, scheduler: DDIMScheduler | None = None) -> torch.Tensor:
        def shifted(x, t):
            return self.port_unet(x, t + 1 if self.shifted else t, encoder_hidden_states=self.cond).sample, x

        return port_steps(scheduler or self.port_scheduler(), steps, shifted)


def write_shifted_spec(folder, shifted: bool, bugs: tuple[str, ...] = ()):
    r"""A triage SPEC for :class:`ShiftedTimePair`."""
    made = f"ShiftedTimePair({shifted!r}, {tuple(bugs)!r})"
    return spec_for(folder, "shifted_spec.py", "ShiftedTimePair", made)


class EmbeddedContext(torch.nn.Module):
    r"""The port side of :class:`DropFlagPair`: the context embedded as given, no drop flag."""

    def __init__(self, unet: torch.nn.Module, embed: Embedder):
        super().__init__()
        self.unet, self.embed = unet, embed

    def forward(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        return self.unet(x, t, encoder_hidden_states=self.embed(context)).sample


class DropFlagPair(Guided):
    r"""The reference calls its denoiser twice per step with the same context, the unconditional call with
    ``drop=True`` (video-diffusion-pytorch's ``null_cond_prob=1.0``: the context replaced inside); the port
    stacks (zeros, context) into one batched call. ``scaled`` plants a port whose conditional rows differ."""

    def __init__(self, scaled: bool = False):
        super().__init__()
        embed = Embedder()
        with torch.no_grad():
            for p in embed.parameters():
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(9)) * 0.5)
        self.ref_pass = OnePass(self.ref_unet, embed)
        self.port_embedded = EmbeddedContext(self.port_unet, copy.deepcopy(embed))
        self.scaled = scaled

    def reference_passes(self, x, t, c):
        return self.ref_pass(x, t, c, drop=True), self.ref_pass(x, t, c)

    def port_passes(self, latents, t):
        context = torch.cat([torch.zeros_like(self.cond), self.cond * (1.5 if self.scaled else 1.0)])
        return self.port_embedded(torch.cat([latents, latents]), t, context).chunk(2)


def write_drop_flag_spec(folder, scaled: bool = False):
    r"""A triage SPEC for :class:`DropFlagPair`."""
    made = f"DropFlagPair({scaled!r})"
    return spec_for(folder, "drop_flag_spec.py", "DropFlagPair", made, "ref_pass", "port_embedded")


class OptionalContext(torch.nn.Module):
    r"""A port denoiser whose unconditional pass is called with ``context=None`` (zeros embedded)."""

    def __init__(self, unet: torch.nn.Module, embed: Embedder, like: torch.Tensor):
        super().__init__()
        self.unet, self.embed, self.like = unet, embed, like

    def forward(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        embedded = self.embed(self.like, drop=True) if context is None else self.embed(context)
        return self.unet(x, t, encoder_hidden_states=embedded).sample


class NoneContextPair(DropFlagPair):
    r"""Both sides call their denoiser once per guidance pass; the reference passes its context to the
    unconditional pass with ``drop=True``, the port passes ``context=None`` there (E2 TTS's ``text=None``)."""

    def __init__(self):
        super().__init__()
        self.port_optional = OptionalContext(self.port_unet, self.port_embedded.embed, self.cond)

    def port_passes(self, latents, t):
        return self.port_optional(latents, t), self.port_optional(latents, t, self.cond)


def write_none_context_spec(folder):
    r"""A triage SPEC for :class:`NoneContextPair`."""
    made = "NoneContextPair()"
    return spec_for(folder, "none_context_spec.py", "NoneContextPair", made, "ref_pass", "port_optional")
