"""Port pairs whose bug is a relation between values, not a setting or a weight: a research-style reference
written from the papers' and research repositories' conventions, and a port with one planted bug of a class
no catalogue detector names (benchmarks/relations.py scores them; tests/test_value_relations.py runs some).

Each builder returns ``(reference, port, inputs, culprit, words)``: the port module where the bug is (``""``
for the top level, None for a correct port) and the words the first stated cause must hold.
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
    """DiT's final layer: norm, linear to p·p·C per token, unpatchify. The research code (facebookresearch/DiT,
    ``unpatchify``) reads each token's features as (p, p, C): ``nhwpqc -> nchpwq``."""

    def __init__(self, channels_first: bool = False):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.linear = nn.Linear(DIM, PATCH * PATCH * CHANNELS)
        self.channels_first = channels_first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        side = int(math.isqrt(n))
        x = self.linear(self.norm(x))
        if self.channels_first:  # the planted bug: features read as (C, p, p)
            x = x.reshape(b, side, side, CHANNELS, PATCH, PATCH).permute(0, 3, 1, 4, 2, 5)
        else:
            x = x.reshape(b, side, side, PATCH, PATCH, CHANNELS).permute(0, 5, 1, 3, 2, 4)
        return x.reshape(b, CHANNELS, side * PATCH, side * PATCH)


class TinyDiT(nn.Module):
    def __init__(self, channels_first: bool = False):
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.final_layer = FinalLayer(channels_first)

    def forward(self, tokens):
        return self.final_layer(self.embed(tokens))


def unpatchify_channels_last():
    reference = _seeded(TinyDiT(), 0)
    port = _copy(reference, TinyDiT(channels_first=True))
    return reference, port, ((torch.randn(1, 16, DIM),), {}), "final_layer", ["read as", "final_layer"]


# ------------------------------------------------------------------------------------------ joint attention
class JointBlock(nn.Module):
    """MMDiT-style joint attention over text and image tokens concatenated (SD3: context first)."""

    def __init__(self, image_first: bool = False):
        super().__init__()
        self.attn = nn.MultiheadAttention(DIM, HEADS, batch_first=True)
        self.image_first = image_first

    def forward(self, image, text):
        joint = torch.cat([image, text] if self.image_first else [text, image], dim=1)
        return joint + self.attn(joint, joint, joint, need_weights=False)[0]


class JointModel(nn.Module):
    def __init__(self, image_first: bool = False):
        super().__init__()
        self.block = JointBlock(image_first)
        self.out = nn.Linear(DIM, DIM)

    def forward(self, image, text):
        joint = self.block(image, text)
        # both sides read the image tokens as the last ones: right for text-first, wrong for image-first
        return self.out(joint[:, -image.shape[1] :])


def concat_order():
    reference = _seeded(JointModel(), 1)
    port = _copy(reference, JointModel(image_first=True))
    inputs = ((torch.randn(1, 12, DIM), torch.randn(1, 4, DIM)), {})
    return reference, port, inputs, "block", ["axis 1", "reordered"]


# ------------------------------------------------------------------------------------------ rotary table
class RotaryTable(nn.Module):
    """A rotary (cos, sin) table per position. The reference repeats the frequencies as two halves
    (``rotate_half`` convention, GPT-NeoX / Llama); the planted port repeats each one twice in a row
    (interleaved pairs, GPT-J) while its attention still rotates halves."""

    def __init__(self, head_dim: int = 8, theta: float = 10000.0, interleaved: bool = False):
        super().__init__()
        self.head_dim, self.theta, self.interleaved = head_dim, theta, interleaved

    def forward(self, positions):
        inv = self.theta ** (-torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim)
        angles = positions.float()[:, None] * inv[None]
        if self.interleaved:
            angles = angles.repeat_interleave(2, dim=-1)
        else:
            angles = torch.cat([angles, angles], dim=-1)
        return torch.stack([angles.cos(), angles.sin()])


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class RotaryAttention(nn.Module):
    def __init__(self, interleaved: bool = False):
        super().__init__()
        self.rope = RotaryTable(interleaved=interleaved)
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
    port = _copy(reference, RotaryAttention(interleaved=True))
    inputs = ((torch.randn(1, 6, DIM), torch.arange(6)), {})
    return reference, port, inputs, "rope", ["read as", "interleaved"]


# ------------------------------------------------------------------------------------------ residuals
class Residual(nn.Module):
    """A pre-norm residual branch; ``bug`` plants: the residual dropped, added twice, the sum scaled by 1/√2
    once more (the reference scales once, as EDM/NCSN++ skip connections do)."""

    def __init__(self, bug: str | None = None, scaled: bool = False):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
        self.bug, self.scaled = bug, scaled

    def forward(self, x):
        h = self.mlp(self.norm(x))
        if self.bug == "dropped":
            out = h
        elif self.bug == "twice":
            out = x + h + x
        else:
            out = x + h
        if self.scaled:
            out = out * (1 / math.sqrt(2))
            if self.bug == "rescaled":
                out = out * (1 / math.sqrt(2))
        return out


class ResidualNet(nn.Module):
    def __init__(self, bug: str | None = None, scaled: bool = False):
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.block = Residual(bug, scaled)
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x):
        return self.out(self.block(self.inp(x)))


def _residual(bug: str, scaled: bool, words: list[str]):
    def build():
        reference = _seeded(ResidualNet(scaled=scaled), 3)
        port = _copy(reference, ResidualNet(bug, scaled))
        return reference, port, ((torch.randn(2, 5, DIM),), {}), "block", words

    return build


# ------------------------------------------------------------------------------------------ gated branch
class GatedBlock(nn.Module):
    """adaLN-Zero's gated branch (DiT): x + gate · attn(x). The port adds the gated branch twice."""

    def __init__(self, twice: bool = False):
        super().__init__()
        self.attn = nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, DIM))
        self.twice = twice

    def forward(self, x, gate):
        branch = gate * self.attn(x)
        return x + branch + (branch if self.twice else 0)


class GatedNet(nn.Module):
    def __init__(self, twice: bool = False):
        super().__init__()
        self.mod = nn.Linear(DIM, DIM)
        self.block = GatedBlock(twice)
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x, c):
        return self.out(self.block(x, self.mod(c)[:, None]))


def gate_twice():
    reference = _seeded(GatedNet(), 4)
    port = _copy(reference, GatedNet(twice=True))
    inputs = ((torch.randn(2, 5, DIM), torch.randn(2, DIM)), {})
    return reference, port, inputs, "block", ["gate·attn"]


# ------------------------------------------------------------------------------------------ frames
class TemporalMix(nn.Module):
    """A temporal 1-D conv over frames of a (B, C, F, H, W) clip; the port returns its frames reversed (its
    rearrange read the frame axis backwards)."""

    def __init__(self, reversed_frames: bool = False):
        super().__init__()
        self.conv = nn.Conv3d(4, 4, (3, 1, 1), padding=(1, 0, 0))
        self.reversed_frames = reversed_frames

    def forward(self, x):
        y = self.conv(x)
        return y.flip(2) if self.reversed_frames else y


class VideoNet(nn.Module):
    def __init__(self, reversed_frames: bool = False):
        super().__init__()
        self.temporal = TemporalMix(reversed_frames)
        self.out = nn.Conv3d(4, 4, 1)

    def forward(self, x):
        return self.out(self.temporal(x))


def frames_reversed():
    reference = _seeded(VideoNet(), 5)
    port = _copy(reference, VideoNet(reversed_frames=True))
    return reference, port, ((torch.randn(1, 4, 5, 3, 3),), {}), "temporal", ["axis 2", "reordered"]


# ------------------------------------------------------------------------------------------ the catalogue
CASES = {
    "unpatchify-channels-last": unpatchify_channels_last,
    "joint-concat-order": concat_order,
    "rotary-interleaved": rotary_interleaved,
    "residual-dropped": _residual("dropped", False, ["− x"]),
    "residual-twice": _residual("twice", False, ["+ x"]),
    "residual-rescaled": _residual("rescaled", True, ["√2"]),
    "gate-twice": gate_twice,
    "frames-reversed": frames_reversed,
}


def clean(name: str):
    r"""The same pair with no bug: a correct port (its culprit None)."""

    def build():
        reference, port, inputs, _, _ = CASES[name]()
        fixed = type(port)() if not isinstance(port, ResidualNet) else ResidualNet(scaled=port.block.scaled)
        return reference, _copy(reference, fixed), inputs, None, []

    return build


CLEAN = {f"{name} (correct port)": clean(name) for name in ("joint-concat-order", "residual-rescaled", "gate-twice")}
