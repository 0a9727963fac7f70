"""Port pairs whose bug is a relation between values, not a setting or a weight: a research-style reference
written from the papers' and research repositories' conventions, and a port with one planted bug of a class
no catalogue detector names (benchmarks/relations.py scores them; tests/test_value_relations.py runs some).

Each builder returns ``(reference, port, inputs, culprit, causes)``: the port module where the bug is (``""``
for the top level, None for a correct port) and the true causes in words (any one of them, said in a stated
cause's line, is the true cause: a relation, or an equivalent verified edit of the repair search).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

DIM, HEADS, PATCH, CHANNELS = 16, 2, 2, 3


def _seeded(module: nn.Module, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return module.eval()


def _copy(reference: nn.Module, port: nn.Module) -> nn.Module:
    port.load_state_dict(reference.state_dict())
    return port.eval()


# ------------------------------------------------------------------------------------------ final layer
class FinalLayer(nn.Module):
    """DiT's final layer: norm, linear to p·p·C per token, unpatchify. The research code
    (facebookresearch/DiT, ``unpatchify``) reads each token's features as (p, p, C): ``nhwpqc -> nchpwq``."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.linear = nn.Linear(DIM, PATCH * PATCH * CHANNELS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        side = int(math.isqrt(n))
        x = self.linear(self.norm(x))
        x = x.reshape(b, side, side, PATCH, PATCH, CHANNELS).permute(0, 5, 1, 3, 2, 4)
        return x.reshape(b, CHANNELS, side * PATCH, side * PATCH)


class PortFinalLayer(FinalLayer):
    """The planted bug: each token's features read as (C, p, p)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        side = int(math.isqrt(n))
        x = self.linear(self.norm(x))
        x = x.reshape(b, side, side, CHANNELS, PATCH, PATCH).permute(0, 3, 1, 4, 2, 5)
        return x.reshape(b, CHANNELS, side * PATCH, side * PATCH)


class TinyDiT(nn.Module):
    def __init__(self, final: type = FinalLayer):
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.final_layer = final()

    def forward(self, tokens):
        return self.final_layer(self.embed(tokens))


def unpatchify_channels_last():
    reference = _seeded(TinyDiT(), 0)
    port = _copy(reference, TinyDiT(PortFinalLayer))
    return reference, port, ((torch.randn(1, 16, DIM),), {}), "final_layer", ["(2, 2, 3) against (3, 2, 2)"]


# ------------------------------------------------------------------------------------------ joint attention
class JointBlock(nn.Module):
    """MMDiT-style joint attention over text and image tokens concatenated (SD3: context first)."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(DIM, HEADS, batch_first=True)

    def forward(self, image, text):
        joint = torch.cat([text, image], dim=1)
        return joint + self.attn(joint, joint, joint, need_weights=False)[0]


class PortJointBlock(JointBlock):
    """The planted bug: image tokens first."""

    def forward(self, image, text):
        joint = torch.cat([image, text], dim=1)
        return joint + self.attn(joint, joint, joint, need_weights=False)[0]


class JointModel(nn.Module):
    def __init__(self, block: type = JointBlock):
        super().__init__()
        self.block = block()
        self.out = nn.Linear(DIM, DIM)

    def forward(self, image, text):
        joint = self.block(image, text)
        # both sides read the image tokens as the last ones: right for text-first, wrong for image-first
        return self.out(joint[:, -image.shape[1] :])


def concat_order():
    reference = _seeded(JointModel(), 1)
    port = _copy(reference, JointModel(PortJointBlock))
    inputs = ((torch.randn(1, 12, DIM), torch.randn(1, 4, DIM)), {})
    return (
        reference,
        port,
        inputs,
        "block",
        [
            "axis 1 (16) reordered: entries 0–11 ← 4–15, 12–15 ← 0–3",
            "put the 4 equal chunks in the order (3, 0, 1, 2) of its output along dim 1",
        ],
    )


# ------------------------------------------------------------------------------------------ rotary table
class RotaryTable(nn.Module):
    """A rotary (cos, sin) table per position. The reference repeats the frequencies as two halves
    (``rotate_half`` convention, GPT-NeoX / Llama); the planted port repeats each one twice in a row
    (interleaved pairs, GPT-J) while its attention still rotates halves."""

    def __init__(self, head_dim: int = 8, theta: float = 10000.0):
        super().__init__()
        self.head_dim, self.theta = head_dim, theta

    def angles(self, positions):
        inv = self.theta ** (-torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim)
        return positions.float()[:, None] * inv[None]

    def forward(self, positions):
        angles = self.angles(positions)
        angles = torch.cat([angles, angles], dim=-1)
        return torch.stack([angles.cos(), angles.sin()])


class PortRotaryTable(RotaryTable):
    """The planted bug: the frequencies repeated as interleaved pairs."""

    def forward(self, positions):
        angles = self.angles(positions).repeat_interleave(2, dim=-1)
        return torch.stack([angles.cos(), angles.sin()])


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class RotaryAttention(nn.Module):
    def __init__(self, table: type = RotaryTable):
        super().__init__()
        self.rope = table()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x, positions):
        b, n, _ = x.shape
        cos, sin = self.rope(positions)
        q, k, v = self.qkv(x).view(b, n, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        q, k = (t * cos + _rotate_half(t) * sin for t in (q, k))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, n, DIM))


def rotary_interleaved():
    reference = _seeded(RotaryAttention(), 2)
    port = _copy(reference, RotaryAttention(PortRotaryTable))
    inputs = ((torch.randn(1, 6, DIM), torch.arange(6)), {})
    return reference, port, inputs, "rope", ["(2, 4) in the reference and (4, 2) in the port"]


# ------------------------------------------------------------------------------------------ residuals
class Residual(nn.Module):
    """A pre-norm residual branch; ``bug`` plants: the residual dropped, added twice, the sum scaled by 1/√2
    once more (the reference scales once, as EDM/NCSN++ skip connections do)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x):
        return (x + self.mlp(self.norm(x))) / math.sqrt(2)


class ResidualDropped(Residual):
    def forward(self, x):
        return self.mlp(self.norm(x)) / math.sqrt(2)


class ResidualTwice(Residual):
    def forward(self, x):
        return (x + self.mlp(self.norm(x)) + x) / math.sqrt(2)


class ResidualRescaled(Residual):
    def forward(self, x):
        return (x + self.mlp(self.norm(x))) / math.sqrt(2) / math.sqrt(2)


class ResidualNet(nn.Module):
    def __init__(self, block: type = Residual):
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.block = block()
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x):
        return self.out(self.block(self.inp(x)))


def _residual(block: type, words: list[str]):
    def build():
        reference = _seeded(ResidualNet(), 3)
        port = _copy(reference, ResidualNet(block))
        return reference, port, ((torch.randn(2, 5, DIM),), {}), "block", words

    return build


# ------------------------------------------------------------------------------------------ gated branch
class GatedBlock(nn.Module):
    """adaLN-Zero's gated branch (DiT): x + gate · attn(x). The port adds the gated branch twice."""

    def __init__(self):
        super().__init__()
        self.attn = nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, DIM))

    def forward(self, x, gate):
        return x + gate * self.attn(x)


class GatedTwice(GatedBlock):
    def forward(self, x, gate):
        branch = gate * self.attn(x)
        return x + branch + branch


class GatedNet(nn.Module):
    def __init__(self, block: type = GatedBlock):
        super().__init__()
        self.mod = nn.Linear(DIM, DIM)
        self.block = block()
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x, c):
        return self.out(self.block(x, self.mod(c)[:, None]))


def gate_twice():
    reference = _seeded(GatedNet(), 4)
    port = _copy(reference, GatedNet(GatedTwice))
    inputs = ((torch.randn(2, 5, DIM), torch.randn(2, DIM)), {})
    return (
        reference,
        port,
        inputs,
        "block",
        [
            "port = reference + gate·attn",
            "with its input gate multiplied by 1/2 it matches the reference",
            "reference output = 0.5 x port output + 0.5 x input x",
        ],
    )


# ------------------------------------------------------------------------------------------ frames
class TemporalMix(nn.Module):
    """A temporal 1-D conv over frames of a (B, C, F, H, W) clip; the port returns its frames reversed (its
    rearrange read the frame axis backwards)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(4, 4, (3, 1, 1), padding=(1, 0, 0))

    def forward(self, x):
        return self.conv(x)


class ReversedFrames(TemporalMix):
    def forward(self, x):
        return self.conv(x).flip(2)


class VideoNet(nn.Module):
    def __init__(self, temporal: type = TemporalMix):
        super().__init__()
        self.temporal = temporal()
        self.out = nn.Conv3d(4, 4, 1)

    def forward(self, x):
        return self.out(self.temporal(x))


def frames_reversed():
    reference = _seeded(VideoNet(), 5)
    port = _copy(reference, VideoNet(ReversedFrames))
    return (
        reference,
        port,
        ((torch.randn(1, 4, 5, 3, 3),), {}),
        "temporal",
        ["axis 2 (5) reordered: reversed"],
    )


# ------------------------------------------------------------------------------------------ output clamp
class Decode(nn.Module):
    """A VAE's last step: conv to RGB, then the research code clamps the video to [-1, 1] (DiffSynth's Wan
    decode); the port returns it unclamped."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 3, 3, padding=1)

    def forward(self, z):
        return self.conv(z).clamp(-1, 1)


class UnclampedDecode(Decode):
    def forward(self, z):
        return self.conv(z)


class Decoder(nn.Module):
    def __init__(self, decode: type = Decode):
        super().__init__()
        self.up = nn.Conv2d(4, 4, 3, padding=1)
        self.decode = decode()

    def forward(self, z):
        return self.decode(self.up(z))


def output_clamp():
    torch.manual_seed(6)
    reference = Decoder().eval()
    port = _copy(reference, Decoder(UnclampedDecode))
    return reference, port, ((3 * torch.randn(1, 4, 6, 6),), {}), "decode", ["clamp(port, -1, 1)"]


# ------------------------------------------------------------------------------------------ the catalogue
CASES = {
    "unpatchify-channels-last": unpatchify_channels_last,
    "joint-concat-order": concat_order,
    "rotary-interleaved": rotary_interleaved,
    "residual-dropped": _residual(ResidualDropped, ["port = reference − 1/√2·x"]),
    "residual-twice": _residual(
        ResidualTwice,
        ["port = reference + 1/√2·x", "with its input x multiplied by 1/2 it matches the reference"],
    ),
    "residual-rescaled": _residual(
        ResidualRescaled, ["port = 1/√2 × reference", "its output is the reference's multiplied by 1/√2"]
    ),
    "gate-twice": gate_twice,
    "frames-reversed": frames_reversed,
    "output-clamp": output_clamp,
}


def clean(name: str):
    r"""The same pair with no bug: the reference's own classes, loaded with its weights (culprit None)."""

    def build():
        reference, _, inputs, _, _ = CASES[name]()
        return reference, _copy(reference, type(reference)()), inputs, None, []

    return build


CLEAN = {
    f"{name} (correct port)": clean(name)
    for name in ("joint-concat-order", "residual-rescaled", "gate-twice")
}
