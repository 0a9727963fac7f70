"""Planted-bug model pairs for the trace / align / bisect tests.

Each family has a research-style REFERENCE (plain torch modules, its own names) and a PORT built from real
diffusers modules with diffusers names; weights go across through an explicit conversion (renames, a fused
QKV split, a shift/scale swap), so the two sides share no module name below the top level. ``bug=None`` gives
a faithful port; every other ``bug`` plants one real-world mistake.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from diffusers.models.activations import get_activation
from diffusers.models.attention_processor import Attention
from diffusers.models.embeddings import TimestepEmbedding, Timesteps, get_timestep_embedding
from diffusers.models.normalization import AdaLayerNormContinuous
from diffusers.models.resnet import ResnetBlock2D
from torch import nn

DIM, HEADS, COND, TOKENS, HIDDEN = 32, 4, 16, 6, 64


def randomize(module: nn.Module, seed: int = 0) -> nn.Module:
    """Distinct random values everywhere, so value matching has no ties (LayerNorm ones, zero biases)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return module.eval()


# --------------------------------------------------------------------------------- transformer family


class ResearchAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, n, c))


class ResearchMLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class ResearchBlock(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm_a = nn.LayerNorm(dim, eps=1e-6)
        self.attn = ResearchAttention(dim, heads)
        self.norm_m = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = ResearchMLP(dim, HIDDEN)

    def forward(self, x):
        x = x + self.attn(self.norm_a(x))
        return x + self.mlp(self.norm_m(x))


class ResearchAdaLN(nn.Module):
    """Final modulation: shift first, then scale (the research layout)."""

    def __init__(self, dim: int, cond: int):
        super().__init__()
        self.emb = nn.Linear(cond, 2 * dim)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)

    def forward(self, x, c):
        shift, scale = self.emb(F.silu(c)).chunk(2, dim=1)
        return self.norm(x) * (1 + scale)[:, None, :] + shift[:, None, :]


class ResearchDiT(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList([ResearchBlock(DIM, HEADS) for _ in range(2)])
        self.final_norm = ResearchAdaLN(DIM, COND)
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x, c):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.final_norm(x, c))


class SwappedAdaLayerNormContinuous(AdaLayerNormContinuous):
    """The planted bug: the forward reads shift and scale in the research order, but the weights were
    converted into diffusers' (scale, shift) order."""

    def forward(self, x, conditioning_embedding):
        emb = self.linear(self.silu(conditioning_embedding).to(x.dtype))
        shift, scale = torch.chunk(emb, 2, dim=1)
        return self.norm(x) * (1 + scale)[:, None, :] + shift[:, None, :]


class PortBlock(nn.Module):
    def __init__(
        self, dim: int, heads: int, *, eps: float = 1e-6, act_fn: str = "gelu_tanh", inline_bug=False
    ):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=eps)
        self.attn1 = Attention(query_dim=dim, heads=heads, dim_head=dim // heads, bias=True, out_bias=True)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.ff = TimestepEmbedding(dim, HIDDEN, act_fn="silu", out_dim=dim)
        self.ff.act = nn.GELU(approximate="tanh") if act_fn == "gelu_tanh" else get_activation("gelu")
        self.inline_bug = inline_bug

    def forward(self, hidden_states):
        normed = self.norm1(hidden_states)
        # The planted inline bug: the residual is taken from the normalised input.
        residual = normed if self.inline_bug else hidden_states
        hidden_states = residual + self.attn1(normed)
        return hidden_states + self.ff(self.norm2(hidden_states))


class PortDiT(nn.Module):
    def __init__(self, bug: str | None = None):
        super().__init__()
        self.proj_in = nn.Linear(DIM, DIM)
        self.transformer_blocks = nn.ModuleList(
            [
                PortBlock(
                    DIM,
                    HEADS,
                    eps=1e-5 if bug == "eps" else 1e-6,
                    act_fn="gelu" if bug == "gelu" else "gelu_tanh",
                    inline_bug=bug == "inline" and i == 1,
                )
                for i in range(2)
            ]
        )
        norm_cls = SwappedAdaLayerNormContinuous if bug == "adaln" else AdaLayerNormContinuous
        self.norm_out = norm_cls(DIM, COND, elementwise_affine=False, eps=1e-6)
        self.proj_out = nn.Linear(DIM, DIM)

    def forward(self, hidden_states, conditioning):
        hidden_states = self.proj_in(hidden_states)
        for block in self.transformer_blocks:
            hidden_states = block(hidden_states)
        return self.proj_out(self.norm_out(hidden_states, conditioning))


def convert_dit(sd: dict) -> dict:
    out = {}
    for key, value in sd.items():
        new = (
            key.replace("embed.", "proj_in.")
            .replace("head.", "proj_out.")
            .replace("blocks.", "transformer_blocks.")
        )
        new = new.replace(".norm_a.", ".norm1.").replace(".norm_m.", ".norm2.")
        new = new.replace(".mlp.fc1.", ".ff.linear_1.").replace(".mlp.fc2.", ".ff.linear_2.")
        new = new.replace(".attn.proj.", ".attn1.to_out.0.")
        if ".attn.qkv." in new:
            for part, name in zip(value.chunk(3, dim=0), ("to_q", "to_k", "to_v")):
                out[new.replace(".attn.qkv.", f".attn1.{name}.")] = part.clone()
            continue
        if new.startswith("final_norm.emb."):
            shift, scale = value.chunk(2, dim=0)
            out[new.replace("final_norm.emb.", "norm_out.linear.")] = torch.cat([scale, shift])
            continue
        out[new] = value
    return out


def dit_pair(bug: str | None = None, seed: int = 0):
    """(reference, port, inputs) for the transformer family; ``inputs`` is ``(args, kwargs)``."""
    reference = randomize(ResearchDiT(), seed)
    port = PortDiT(bug).eval()
    port.load_state_dict(convert_dit(reference.state_dict()))
    g = torch.Generator().manual_seed(seed + 1)
    # Small activations make a LayerNorm eps change visible, as it is in real activations of small variance.
    x = torch.randn(2, TOKENS, DIM, generator=g) * 0.05
    c = torch.randn(2, COND, generator=g)
    return reference, port, ((x, c), {})


# ---------------------------------------------------------------------------------------- time family


class ResearchSinusoid(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, t):
        return get_timestep_embedding(t, self.dim, flip_sin_to_cos=True, downscale_freq_shift=0)


class ResearchMix(nn.Module):
    """Time mixture of the control and base branches, with its own knob."""

    def __init__(self, weight: float):
        super().__init__()
        self.weight = weight

    def forward(self, ctrl, base):
        return self.weight * ctrl + (1 - self.weight) * base


class ResearchTime(nn.Module):
    """Two knobs, as in the research code: connection strength 0.95 and time mixture 1.0."""

    def __init__(self, connection_strength: float = 0.95, time_mixture: float = 1.0):
        super().__init__()
        self.freq = ResearchSinusoid(DIM)
        self.base_mlp = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.SiLU(), nn.Linear(HIDDEN, HIDDEN))
        self.ctrl_mlp = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.SiLU(), nn.Linear(HIDDEN, HIDDEN))
        self.mix = ResearchMix(time_mixture)
        self.connection_strength = connection_strength
        self.out = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, t):
        emb = self.freq(t)
        base = self.base_mlp(emb)
        ctrl = self.ctrl_mlp(emb) * self.connection_strength
        return self.out(self.mix(ctrl, base))


class BF16Timesteps(Timesteps):
    """The planted bug: the sinusoidal table is rounded to bfloat16."""

    def forward(self, timesteps):
        return super().forward(timesteps).to(torch.bfloat16).float()


class PortTimeMix(nn.Module):
    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, control, base):
        return self.scale * control + (1 - self.scale) * base


class PortTime(nn.Module):
    def __init__(self, bug: str | None = None, control_scale: float = 0.95):
        super().__init__()
        self.time_proj = (BF16Timesteps if bug == "bf16" else Timesteps)(DIM, True, 0)
        self.time_embedding = TimestepEmbedding(DIM, HIDDEN)
        self.control_time_embedding = TimestepEmbedding(DIM, HIDDEN)
        # The planted bug of reference 000: one control_scale for two concepts.
        self.time_mixer = PortTimeMix(control_scale**3 if bug == "remix" else 1.0)
        self.control_scale = control_scale
        self.time_out = nn.Linear(HIDDEN, HIDDEN)
        self.bug = bug

    def forward(self, timestep):
        # "units": the port embeds t / 1000 where the research embeds t
        emb = self.time_proj(timestep / 1000 if self.bug == "units" else timestep)
        base = self.time_embedding(emb)
        control = self.control_time_embedding(emb) * self.control_scale
        return self.time_out(self.time_mixer(control, base))


def convert_time(sd: dict) -> dict:
    names = {
        "base_mlp.0": "time_embedding.linear_1",
        "base_mlp.2": "time_embedding.linear_2",
        "ctrl_mlp.0": "control_time_embedding.linear_1",
        "ctrl_mlp.2": "control_time_embedding.linear_2",
        "out": "time_out",
    }
    out = {}
    for key, value in sd.items():
        module, param = key.rsplit(".", 1)
        out[f"{names[module]}.{param}"] = value
    return out


def time_pair(bug: str | None = None, seed: int = 0):
    reference = randomize(ResearchTime(), seed)
    port = PortTime(bug).eval()
    port.load_state_dict(convert_time(reference.state_dict()))
    t = torch.tensor([999.0, 421.0])
    return reference, port, ((t,), {})


# -------------------------------------------------------------------------------------- resnet family


class ResearchResBlock(nn.Module):
    def __init__(self, channels: int, groups: int = 8, skip_scale: float = 2.0):
        super().__init__()
        self.in_norm = nn.GroupNorm(groups, channels, eps=1e-6)
        self.act = nn.SiLU()
        self.in_conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.out_norm = nn.GroupNorm(groups, channels, eps=1e-6)
        self.out_conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.skip_scale = skip_scale  # from the model config

    def forward(self, x):
        h = self.in_conv(self.act(self.in_norm(x)))
        h = self.out_conv(self.act(self.out_norm(h)))
        return (x + h) / self.skip_scale


class ResearchConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(4, 16, 3, padding=1)
        self.res = ResearchResBlock(16)
        self.to_out = nn.Conv2d(16, 4, 3, padding=1)

    def forward(self, x):
        return self.to_out(self.res(self.stem(x)))


class PortConvNet(nn.Module):
    def __init__(self, bug: str | None = None):
        super().__init__()
        self.conv_in = nn.Conv2d(4, 16, 3, padding=1)
        # The planted bug: output_scale_factor left at its default (1.0) instead of the config's 2.0.
        scale = 1.0 if bug == "scale" else 2.0
        self.resnet = ResnetBlock2D(
            in_channels=16, temb_channels=None, groups=8, eps=1e-6, output_scale_factor=scale
        )
        self.conv_out = nn.Conv2d(16, 4, 3, padding=1)

    def forward(self, sample):
        return self.conv_out(self.resnet(self.conv_in(sample), None))


def convert_conv(sd: dict) -> dict:
    names = {
        "stem": "conv_in",
        "to_out": "conv_out",
        "res.in_norm": "resnet.norm1",
        "res.in_conv": "resnet.conv1",
        "res.out_norm": "resnet.norm2",
        "res.out_conv": "resnet.conv2",
    }
    out = {}
    for key, value in sd.items():
        module, param = key.rsplit(".", 1)
        out[f"{names[module]}.{param}"] = value
    return out


def conv_pair(bug: str | None = None, seed: int = 0):
    reference = randomize(ResearchConvNet(), seed)
    port = PortConvNet(bug).eval()
    port.load_state_dict(convert_conv(reference.state_dict()))
    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(seed + 1))
    return reference, port, ((x,), {})


# ------------------------------------------------------------------------------------------ vit family
# A research vision transformer (timm-style: fused qkv, positions added inline) against transformers' ViTModel
# (split q/k/v, positions added inside ViTEmbeddings); weights go across as the upstream conversion does.

VIT = {"dim": 32, "heads": 4, "layers": 2, "patch": 4, "image": 8, "hidden": 64}


class ResearchViTAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        attn = (q @ k.transpose(-2, -1)) * (c // self.heads) ** -0.5
        out = attn.softmax(dim=-1) @ v
        return self.proj(out.transpose(1, 2).reshape(b, n, c))


class ResearchViTBlock(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int, act: str):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = ResearchViTAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(approximate=act), nn.Linear(hidden, dim))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ResearchViT(nn.Module):
    def __init__(self, act: str = "none"):
        super().__init__()
        d, p = VIT["dim"], VIT["patch"]
        self.patch_embed = nn.Conv2d(3, d, p, stride=p)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d))
        self.pos_embed = nn.Parameter(torch.randn(1, (VIT["image"] // p) ** 2 + 1, d) * 0.02)
        self.blocks = nn.ModuleList(
            [ResearchViTBlock(d, VIT["heads"], VIT["hidden"], act) for _ in range(VIT["layers"])]
        )
        self.norm = nn.LayerNorm(d, eps=1e-6)

    def forward(self, pixels):
        x = self.patch_embed(pixels).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def vit_port(bug: str | None = None):
    from transformers import ViTConfig, ViTModel

    config = ViTConfig(
        hidden_size=VIT["dim"],
        num_hidden_layers=VIT["layers"],
        num_attention_heads=VIT["heads"],
        intermediate_size=VIT["hidden"],
        image_size=VIT["image"],
        patch_size=VIT["patch"],
        num_channels=3,
        layer_norm_eps=1e-12 if bug == "eps" else 1e-6,
        hidden_act="gelu_pytorch_tanh" if bug in ("gelu", "two") else "gelu",
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return ViTModel(config, add_pooling_layer=False).eval()


def convert_vit(sd: dict, swap_qk: bool = False) -> dict:
    """The research names into transformers' ViT names (as the upstream timm conversion script maps them)."""
    out = {
        "embeddings.cls_token": sd["cls_token"],
        "embeddings.position_embeddings": sd["pos_embed"],
        "embeddings.patch_embeddings.projection.weight": sd["patch_embed.weight"],
        "embeddings.patch_embeddings.projection.bias": sd["patch_embed.bias"],
        "layernorm.weight": sd["norm.weight"],
        "layernorm.bias": sd["norm.bias"],
    }
    for i in range(VIT["layers"]):
        src, dst = f"blocks.{i}.", f"layers.{i}."
        names = {
            "norm1": "layernorm_before",
            "norm2": "layernorm_after",
            "attn.proj": "attention.o_proj",
            "mlp.0": "mlp.fc1",
            "mlp.2": "mlp.fc2",
        }
        for a, b in names.items():
            for kind in ("weight", "bias"):
                out[f"{dst}{b}.{kind}"] = sd[f"{src}{a}.{kind}"]
        order = ("k_proj", "q_proj", "v_proj") if swap_qk else ("q_proj", "k_proj", "v_proj")
        for kind in ("weight", "bias"):
            for part, name in zip(sd[f"{src}attn.qkv.{kind}"].chunk(3, dim=0), order):
                out[f"{dst}attention.{name}.{kind}"] = part.clone()
    return out


def vit_pair(bug: str | None = None, seed: int = 0, trained: bool = True):
    r"""(reference, port, inputs). ``trained=False`` keeps the fresh initialisation (norm weights all ones,
    biases zero) that makes value matching ambiguous. Bugs: ``eps``, ``gelu``, ``qk`` (q/k swapped in the
    conversion), ``two`` (``gelu`` plus a changed final-norm eps in the same port)."""
    torch.manual_seed(seed)
    reference = ResearchViT()
    reference = randomize(reference, seed) if trained else reference.eval()
    port = vit_port(bug)
    port.load_state_dict(convert_vit(reference.state_dict(), swap_qk=bug == "qk"))
    if bug == "two":
        port.layernorm.eps = 1e-2
    x = torch.randn(2, 3, VIT["image"], VIT["image"], generator=torch.Generator().manual_seed(seed + 1))
    return reference, port, ((x,), {})


# ---------------------------------------------------------------------------------- inline time family
# Research code computes the sinusoidal timestep embedding inline (cos half first); the port delegates it to
# diffusers' Timesteps, whose flip_sin_to_cos decides that order.


class ResearchInlineTime(nn.Module):
    def __init__(self, dim: int = DIM, hidden: int = HIDDEN, max_period: float = 10000.0):
        super().__init__()
        self.dim = dim
        self.max_period = max_period
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden))

    def forward(self, t):
        half = self.dim // 2
        freqs = torch.exp(-math.log(self.max_period) * torch.arange(half, dtype=torch.float32) / half)
        angles = t.float()[:, None] * freqs[None, :]
        return self.mlp(torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1))


class PortTimeEmbed(nn.Module):
    def __init__(self, flip_sin_to_cos: bool = True):
        super().__init__()
        self.time_proj = Timesteps(DIM, flip_sin_to_cos=flip_sin_to_cos, downscale_freq_shift=0)
        self.time_embedding = TimestepEmbedding(DIM, HIDDEN)

    def forward(self, timestep):
        return self.time_embedding(self.time_proj(timestep))


def inline_time_pair(bug: str | None = None, seed: int = 0, trained: bool = True):
    r"""``bug="flip"``: the port's Timesteps is built with ``flip_sin_to_cos=False`` (sin half first);
    ``bug="period"``: the reference uses a maximum period of 1000, which no Timesteps argument sets."""
    torch.manual_seed(seed)
    reference = ResearchInlineTime(max_period=1000.0 if bug == "period" else 10000.0)
    reference = randomize(reference, seed) if trained else reference.eval()
    port = PortTimeEmbed(flip_sin_to_cos=bug != "flip").eval()
    names = {"mlp.0": "time_embedding.linear_1", "mlp.2": "time_embedding.linear_2"}
    port.load_state_dict(
        {f"{names[k.rsplit('.', 1)[0]]}.{k.rsplit('.', 1)[1]}": v for k, v in reference.state_dict().items()}
    )
    return reference, port, ((torch.tensor([999.0, 421.0, 3.0]),), {})


# -------------------------------------------------------------------------------------------- mha family
# torch.nn.MultiheadAttention (one fused in_proj_weight) against diffusers' Attention (to_q / to_k / to_v).


class ResearchMHABlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.attn = nn.MultiheadAttention(DIM, HEADS, batch_first=True)
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x):
        h = self.norm(x)
        a, _ = self.attn(h, h, h, need_weights=False)
        return self.out(x + a)


class PortAttnBlock(nn.Module):
    def __init__(self, scale_qk: bool = True):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.attn = Attention(
            query_dim=DIM, heads=HEADS, dim_head=DIM // HEADS, bias=True, out_bias=True, scale_qk=scale_qk
        )
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, hidden_states):
        return self.proj(hidden_states + self.attn(self.norm(hidden_states)))


def mha_pair(bug: str | None = None, seed: int = 0, trained: bool = True):
    r"""``bug="scale"``: the port's Attention is built with ``scale_qk=False`` (no 1/sqrt(d) in the
    softmax)."""
    torch.manual_seed(seed)
    reference = ResearchMHABlock()
    reference = randomize(reference, seed) if trained else reference.eval()
    port = PortAttnBlock(scale_qk=bug != "scale").eval()
    sd = reference.state_dict()
    out = {"norm.weight": sd["norm.weight"], "norm.bias": sd["norm.bias"]}
    out.update({"proj.weight": sd["out.weight"], "proj.bias": sd["out.bias"]})
    for kind in ("weight", "bias"):
        for part, name in zip(sd[f"attn.in_proj_{kind}"].chunk(3), ("to_q", "to_k", "to_v")):
            out[f"attn.{name}.{kind}"] = part.clone()
        out[f"attn.to_out.0.{kind}"] = sd[f"attn.out_proj.{kind}"]
    port.load_state_dict(out)
    x = torch.randn(2, TOKENS, DIM, generator=torch.Generator().manual_seed(seed + 1))
    return reference, port, ((x,), {})


# ------------------------------------------------------------------------------------ joint-attention family
# Two token streams (image, text) attended jointly, q/k RMS-normed per head. The research side normalises in
# the [B, H, L, D] layout after splitting heads, as the original two-stream transformers' code does; the port
# is diffusers' FluxAttention, which normalises in [B, L, H, D] before it transposes. Every q/k norm's output
# thus differs from its counterpart's by a dim permutation, by design.

JOINT_HEADS, JOINT_IMG, JOINT_TXT = 2, 6, 4
JOINT_HEAD_DIM = DIM // JOINT_HEADS


class ResearchRMSNorm(nn.Module):
    """Root-mean-square norm over the last dim, in float32, with a learned ``scale``."""

    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        normed = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
        return normed * self.scale


class ResearchQKNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.query_norm = ResearchRMSNorm(dim)
        self.key_norm = ResearchRMSNorm(dim)

    def forward(self, q, k):
        return self.query_norm(q), self.key_norm(k)


class ResearchJointAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.img_qkv, self.txt_qkv = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, 3 * DIM)
        self.img_norm, self.txt_norm = ResearchQKNorm(JOINT_HEAD_DIM), ResearchQKNorm(JOINT_HEAD_DIM)
        self.img_proj, self.txt_proj = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)

    @staticmethod
    def _heads(qkv, norm):
        b, n, _ = qkv.shape
        q, k, v = (t.view(b, n, JOINT_HEADS, JOINT_HEAD_DIM).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
        q, k = norm(q, k)
        return q, k, v

    def forward(self, img, txt):
        iq, ik, iv = self._heads(self.img_qkv(img), self.img_norm)
        tq, tk, tv = self._heads(self.txt_qkv(txt), self.txt_norm)
        q, k, v = (torch.cat(pair, dim=2) for pair in ((tq, iq), (tk, ik), (tv, iv)))
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        txt_out, img_out = out[:, : txt.shape[1]], out[:, txt.shape[1] :]
        return self.img_proj(img_out), self.txt_proj(txt_out)


class ResearchJointModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = ResearchJointAttention()

    def forward(self, img, txt):
        return self.attn(img, txt)


class PortJointModel(nn.Module):
    def __init__(self, eps: float = 1e-6):
        super().__init__()
        from diffusers.models.transformers.transformer_flux import FluxAttention

        self.attn = FluxAttention(
            query_dim=DIM,
            heads=JOINT_HEADS,
            dim_head=JOINT_HEAD_DIM,
            bias=True,
            added_kv_proj_dim=DIM,
            context_pre_only=False,
            eps=eps,
        )

    def forward(self, hidden_states, encoder_hidden_states):
        return self.attn(hidden_states, encoder_hidden_states)


def convert_joint(sd: dict) -> dict:
    out = {}
    for stream, (q, k, v), norms, proj in (
        ("img", ("to_q", "to_k", "to_v"), ("norm_q", "norm_k"), "to_out.0"),
        ("txt", ("add_q_proj", "add_k_proj", "add_v_proj"), ("norm_added_q", "norm_added_k"), "to_add_out"),
    ):
        for kind in ("weight", "bias"):
            for part, name in zip(sd[f"attn.{stream}_qkv.{kind}"].chunk(3), (q, k, v)):
                out[f"attn.{name}.{kind}"] = part.clone()
            out[f"attn.{proj}.{kind}"] = sd[f"attn.{stream}_proj.{kind}"]
        for which, name in zip(("query_norm", "key_norm"), norms):
            out[f"attn.{name}.weight"] = sd[f"attn.{stream}_norm.{which}.scale"]
    return out


def joint_pair(bug: str | None = None, seed: int = 0):
    r"""``bug="eps"``: the port's q/k norms are built with eps 1e-2 (the reference's is 1e-6)."""
    torch.manual_seed(seed)
    reference = randomize(ResearchJointModel(), seed)
    port = PortJointModel(eps=1e-2 if bug == "eps" else 1e-6).eval()
    port.load_state_dict(convert_joint(reference.state_dict()))
    g = torch.Generator().manual_seed(seed + 1)
    img, txt = torch.randn(2, JOINT_IMG, DIM, generator=g), torch.randn(2, JOINT_TXT, DIM, generator=g)
    return reference, port, ((img, txt), {})


# ------------------------------------------------------------------------------------- two-stream family
# Parameterless norms of one class on two token streams of equal length, each followed by its own MLP. The
# research block runs the text stream first, the port (named as diffusers' two-stream blocks name it) the
# image stream first: only what each norm reads tells the streams apart.


class ResearchTwoStream(nn.Module):
    def __init__(self):
        super().__init__()
        self.txt_norm, self.img_norm = (nn.LayerNorm(DIM, elementwise_affine=False, eps=1e-6) for _ in "ab")
        self.txt_mlp, self.img_mlp = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)

    def forward(self, img, txt):
        txt = txt + self.txt_mlp(self.txt_norm(txt))
        img = img + self.img_mlp(self.img_norm(img))
        return img, txt


class PortTwoStream(nn.Module):
    def __init__(self, context_eps: float = 1e-6, context_scale: float = 1.0):
        super().__init__()
        self.context_scale = context_scale
        self.norm2 = nn.LayerNorm(DIM, elementwise_affine=False, eps=1e-6)
        self.norm2_context = nn.LayerNorm(DIM, elementwise_affine=False, eps=context_eps)
        self.ff, self.ff_context = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)

    def forward(self, hidden_states, encoder_hidden_states):
        hidden_states = hidden_states + self.ff(self.norm2(hidden_states))
        normed = self.norm2_context(encoder_hidden_states) * self.context_scale
        encoder_hidden_states = encoder_hidden_states + self.ff_context(normed)
        return hidden_states, encoder_hidden_states


def two_stream_pair(bug: str | None = None, seed: int = 0):
    r"""``bug="context-eps"``: the port's text-stream norm is built with eps 0.5 (the reference's is 1e-6);
    ``bug="context-inline"``: the port scales the text stream's normed tokens by 1.5 in its own forward."""
    torch.manual_seed(seed)
    reference = randomize(ResearchTwoStream(), seed)
    port = PortTwoStream(
        context_eps=0.5 if bug == "context-eps" else 1e-6,
        context_scale=1.5 if bug == "context-inline" else 1.0,
    ).eval()
    sd = reference.state_dict()
    port.load_state_dict(
        {
            f"{new}.{kind}": sd[f"{old}.{kind}"]
            for old, new in (("img_mlp", "ff"), ("txt_mlp", "ff_context"))
            for kind in ("weight", "bias")
        }
    )
    g = torch.Generator().manual_seed(seed + 1)
    img, txt = torch.randn(2, TOKENS, DIM, generator=g), torch.randn(2, TOKENS, DIM, generator=g)
    return reference, port, ((img, txt), {})
