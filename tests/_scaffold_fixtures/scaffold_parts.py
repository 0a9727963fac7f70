"""Tiny real models the scaffolder tests point generated files at (imported inside generated code).

- "Research" models: tiny ``UNet2DModel`` / ``UNet2DConditionModel`` / ``AutoencoderKL`` networks under
  LDM-style names (``diffusion_model.*``, ``first_stage_model.*``) returning a bare tensor; ``convert``
  maps their weights to diffusers names.
- Tiny pipeline components (``UNet2DConditionModel``, ``DDIMScheduler``, ``AutoencoderKL``, a CLIP text
  encoder and a tokenizer over a made-up vocabulary) and a hand-written reference loop with checkpoints.

``SCAFFOLD_PIPELINE_DIR`` (environment) names the saved port pipeline whose weights the reference loads.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from diffusers import AutoencoderKL, DDIMScheduler, UNet2DConditionModel, UNet2DModel
from paritykit.tracing.checkpoints import maybe_checkpoint

UNET_CONFIG = {
    "sample_size": 8,
    "in_channels": 3,
    "out_channels": 3,
    "layers_per_block": 1,
    "block_out_channels": (8, 16),
    "down_block_types": ("DownBlock2D", "DownBlock2D"),
    "up_block_types": ("UpBlock2D", "UpBlock2D"),
    "norm_num_groups": 4,
}
COND_UNET_CONFIG = {
    "sample_size": 8,
    "in_channels": 4,
    "out_channels": 4,
    "layers_per_block": 1,
    "block_out_channels": (8, 16),
    "down_block_types": ("CrossAttnDownBlock2D", "DownBlock2D"),
    "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D"),
    "cross_attention_dim": 16,
    "attention_head_dim": 2,
    "norm_num_groups": 4,
}
VAE_CONFIG = {
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ("DownEncoderBlock2D", "DownEncoderBlock2D"),
    "up_block_types": ("UpDecoderBlock2D", "UpDecoderBlock2D"),
    "block_out_channels": (8, 16),
    "latent_channels": 4,
    "layers_per_block": 1,
    "norm_num_groups": 4,
    "sample_size": 16,
}


# ------------------------------------------------------------------------------------- component test
class ResearchModel(torch.nn.Module):
    """The reference side: a network under an LDM-style prefix, returning a bare tensor."""

    def __init__(self, prefix: str, inner: torch.nn.Module):
        super().__init__()
        self.prefix = prefix
        self.add_module(prefix, inner)

    def forward(self, *args):
        return getattr(self, self.prefix)(*args)[0]


def build_reference() -> ResearchModel:
    torch.manual_seed(0)
    return ResearchModel("diffusion_model", UNet2DModel(**UNET_CONFIG))


def build_reference_eps6() -> ResearchModel:
    """The same weights as ``build_reference``, but its GroupNorms use eps 1e-6 where the port's use 1e-5."""
    torch.manual_seed(0)
    return ResearchModel("diffusion_model", UNet2DModel(**UNET_CONFIG, norm_eps=1e-6))


def build_reference_cond_unet() -> ResearchModel:
    torch.manual_seed(0)
    return ResearchModel("diffusion_model", UNet2DConditionModel(**COND_UNET_CONFIG))


def build_reference_vae() -> ResearchModel:
    torch.manual_seed(0)
    return ResearchModel("first_stage_model", AutoencoderKL(**VAE_CONFIG))


def convert(state_dict: dict) -> dict:
    """Drop the LDM-style prefix (``diffusion_model.`` / ``first_stage_model.``)."""
    return {key.split(".", 1)[1]: value for key, value in state_dict.items()}


def convert_to_model(state_dict: dict) -> UNet2DModel:
    """A conversion that returns the port model itself, so no saved config.json is needed."""
    model = UNet2DModel(**UNET_CONFIG)
    model.load_state_dict(convert(state_dict))
    return model


def convert_with_bug(state_dict: dict) -> dict:
    """A conversion that perturbs one weight: the fresh-mode test must catch it."""
    converted = convert(state_dict)
    converted["conv_in.bias"] = converted["conv_in.bias"] + 0.05
    return converted


def save_port(directory: str | os.PathLike, build=build_reference, perturb: bool = False) -> None:
    """Save the converted port; ``perturb`` plants a stale weight the saved-mode test must catch."""
    reference = build()
    inner = getattr(reference, reference.prefix)
    model = type(inner).from_config(inner.config)
    model.load_state_dict(convert(reference.state_dict()))
    if perturb:
        with torch.no_grad():
            model.conv_out.weight[0, 0, 0, 0] += 0.5
    model.save_pretrained(directory)


# ------------------------------------------------- a research reference: Wan 2.1's DiT as DiffSynth ships it
WAN_SHAPE = dict(ffn_dim=64, freq_dim=256, num_layers=2, patch_size=(1, 2, 2))


def build_reference_wan():
    """Wan 2.1's research DiT driven as DiffSynth's pipeline drives it: ``forward(x, timestep, context)``,
    the same things diffusers' ``WanTransformer3DModel`` requires, in the same order, under other names."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.research import ResearchDenoise, wan_dit

    torch.manual_seed(0)
    research = wan_dit().WanModel(
        dim=48, in_dim=4, out_dim=4, text_dim=16, eps=1e-6, num_heads=2, has_image_input=False, **WAN_SHAPE
    )
    return ResearchDenoise(research)


def convert_wan(state_dict: dict) -> dict:
    """diffusers' own converter over the research weights (the wrapper's ``dit.`` prefix dropped)."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    return convert_wan_transformer_to_diffusers({k.removeprefix("dit."): v for k, v in state_dict.items()})


def save_wan_port(directory: str | os.PathLike) -> None:
    from diffusers import WanTransformer3DModel

    port = WanTransformer3DModel(
        num_attention_heads=2, attention_head_dim=24, in_channels=4, out_channels=4, text_dim=16, **WAN_SHAPE
    )
    port.load_state_dict(convert_wan(build_reference_wan().state_dict()))
    port.save_pretrained(directory)


def unet_inputs():
    generator = torch.Generator().manual_seed(1)
    return (torch.randn(2, 3, 8, 8, generator=generator), torch.tensor([500, 20])), {}


# ---------------------------------------------------------------------------------------- pipeline parts
VOCAB = ["<|startoftext|>", "<|endoftext|>", "!"] + list("abcdefghijklmnopqrstuvwxyz")
VOCAB += [letter + "</w>" for letter in "abcdefghijklmnopqrstuvwxyz"]


def tiny_tokenizer(directory: str | os.PathLike):
    from transformers import CLIPTokenizer

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "vocab.json").write_text(json.dumps({token: i for i, token in enumerate(VOCAB)}))
    (directory / "merges.txt").write_text("#version: 0.2\n")
    return CLIPTokenizer(str(directory / "vocab.json"), str(directory / "merges.txt"), model_max_length=8)


def tiny_text_encoder():
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(0)
    config = CLIPTextConfig(
        vocab_size=len(VOCAB),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=8,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    return CLIPTextModel(config).eval()


def tiny_components(work_dir: str | os.PathLike, text: bool = True, conditional: bool = True) -> dict:
    """Tiny real components for the generated pipeline stub (deterministic weights)."""
    torch.manual_seed(0)
    if conditional:
        unet = UNet2DConditionModel(**COND_UNET_CONFIG)
    else:
        unet = UNet2DModel(**{**UNET_CONFIG, "in_channels": 4, "out_channels": 4})
    vae = AutoencoderKL(**VAE_CONFIG)
    # eval(), as from_pretrained leaves them, so a saved and reloaded pipeline computes the same thing
    components = {"unet": unet.eval(), "scheduler": DDIMScheduler(), "vae": vae.eval()}
    if text:
        components["text_encoder"] = tiny_text_encoder()
        components["tokenizer"] = tiny_tokenizer(Path(work_dir) / "tokenizer_files")
    return components


def build_modular_port():
    """The generated modular stub (modular_tiny/) over the saved components: a zero-argument factory."""
    from modular_tiny import TinyBlocks, TinyModularPipeline
    from transformers import CLIPTextModel, CLIPTokenizer

    root = Path(os.environ["SCAFFOLD_PIPELINE_DIR"])
    pipe = TinyModularPipeline(blocks=TinyBlocks())
    pipe.update_components(
        unet=UNet2DConditionModel.from_pretrained(root / "unet"),
        scheduler=DDIMScheduler.from_pretrained(root / "scheduler"),
        vae=AutoencoderKL.from_pretrained(root / "vae"),
        text_encoder=CLIPTextModel.from_pretrained(root / "text_encoder"),
        tokenizer=CLIPTokenizer.from_pretrained(root / "tokenizer"),
    )
    return pipe


# ------------------------------------------------------------------------------------ reference pipeline
def run_reference(_checkpoints=None, seed: int = 0, num_inference_steps: int = 50, prompt: str = ""):
    """A hand-written reference loop over the saved components, instrumented like the stub.

    Returns decoded images (B, C, H, W) in [0, 1], the layout of the port's output_type="pt".
    """
    return _reference(_checkpoints, seed, num_inference_steps, prompt, decode_scale_bug=False)


def run_reference_with_decode_bug(_checkpoints=None, seed: int = 0, num_inference_steps: int = 50, prompt=""):
    """The same reference but decoding without the latent scaling factor: only the decode stage differs."""
    return _reference(_checkpoints, seed, num_inference_steps, prompt, decode_scale_bug=True)


def _reference(_checkpoints, seed, num_inference_steps, prompt, decode_scale_bug):
    from transformers import CLIPTextModel, CLIPTokenizer

    root = Path(os.environ["SCAFFOLD_PIPELINE_DIR"])
    tokenizer = CLIPTokenizer.from_pretrained(root / "tokenizer")
    text_encoder = CLIPTextModel.from_pretrained(root / "text_encoder").eval()
    unet = UNet2DConditionModel.from_pretrained(root / "unet").eval()
    vae = AutoencoderKL.from_pretrained(root / "vae").eval()
    scheduler = DDIMScheduler.from_pretrained(root / "scheduler")

    with torch.no_grad():
        ids = tokenizer([prompt], padding="max_length", max_length=8, truncation=True, return_tensors="pt")
        prompt_embeds = text_encoder(ids.input_ids)[0]
        maybe_checkpoint(_checkpoints, "text_encoding", prompt_embeds=prompt_embeds)

        noise = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(seed))
        latents = noise * scheduler.init_noise_sigma
        scheduler.set_timesteps(num_inference_steps)
        timesteps = scheduler.timesteps
        maybe_checkpoint(
            _checkpoints, "preloop", latents=latents, timesteps=timesteps, prompt_embeds=prompt_embeds
        )

        for i, t in enumerate(timesteps):
            eps = unet(latents, t, encoder_hidden_states=prompt_embeds).sample
            latents = scheduler.step(eps, t, latents).prev_sample
            latents = maybe_checkpoint(_checkpoints, f"after_step_{i}", latents=latents)["latents"]

        latents = maybe_checkpoint(_checkpoints, "post_loop", latents=latents)["latents"]
        scale = 1.0 if decode_scale_bug else vae.config.scaling_factor
        images = vae.decode(latents / scale).sample
    return (images / 2 + 0.5).clamp(0, 1)


# --- a research block with a complex rotary table (a buffer), against a port rotating with cos/sin ---
def _angles(positions: int, dim: int, theta: float) -> torch.Tensor:
    freqs = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    return torch.outer(torch.arange(positions, dtype=torch.float64), freqs)


class ComplexRopeBlock(torch.nn.Module):
    r"""Research style: q from a projection, normed, rotated by a complex table held as a buffer."""

    def __init__(self, dim: int = 16, positions: int = 8):
        super().__init__()
        torch.manual_seed(3)
        self.proj = torch.nn.Linear(dim, dim)
        self.norm = torch.nn.LayerNorm(dim)
        angles = _angles(positions, dim, 1e4).float()
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.norm(self.proj(x))
        pairs = torch.view_as_complex(q.float().reshape(*q.shape[:-1], -1, 2))
        return torch.view_as_real(pairs * self.freqs_cis).flatten(-2).type_as(x)


class CosSinRopeBlock(torch.nn.Module):
    r"""The port: the same projection and norm, rotated with real cos/sin tables; ``norm_first=False`` is the
    slip of rotating before the norm."""

    def __init__(self, dim: int = 16, positions: int = 8, norm_first: bool = True):
        super().__init__()
        self.proj = torch.nn.Linear(dim, dim)
        self.norm = torch.nn.LayerNorm(dim)
        angles = _angles(positions, dim, 1e4).float()
        self.register_buffer("cos", angles.cos().repeat_interleave(2, -1), persistent=False)
        self.register_buffer("sin", angles.sin().repeat_interleave(2, -1), persistent=False)
        self.norm_first = norm_first

    def rotate(self, q: torch.Tensor) -> torch.Tensor:
        rotated = torch.stack([-q[..., 1::2], q[..., 0::2]], dim=-1).flatten(-2)
        return q * self.cos + rotated * self.sin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.proj(x)
        return self.rotate(self.norm(q)) if self.norm_first else self.norm(self.rotate(q))


def build_reference_rope() -> ComplexRopeBlock:
    return ComplexRopeBlock()


def convert_rope(state_dict: dict) -> CosSinRopeBlock:
    port = CosSinRopeBlock()
    port.load_state_dict({k: v for k, v in state_dict.items() if k != "freqs_cis"})
    return port


def convert_rope_slip(state_dict: dict) -> CosSinRopeBlock:
    port = CosSinRopeBlock(norm_first=False)
    port.load_state_dict({k: v for k, v in state_dict.items() if k != "freqs_cis"})
    return port


def rope_inputs():
    return (torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0)),), {}
