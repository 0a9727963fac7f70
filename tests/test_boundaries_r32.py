"""Rounds 30 to 32 of the agent A/B (benchmarks/results/agent_ab.md). A research downsampler written as
``Sequential(space-to-depth, 1x1 conv)`` that the port folds into one strided 2x2 conv (denoising-diffusion-
pytorch's ``Downsample`` against diffusers' ``Downsample2D``): the conv inside the Sequential and the port's
module hold one set of weights and give one output, but only the Sequential is fed what the port module is
fed."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.downsampling import Downsample2D
from paritykit.bisection.entry import bisect
from torch import nn

C = 8


class _SpaceToDepthRef(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.init_conv = nn.Conv2d(3, C, 3, padding=1)
        self.down = nn.Sequential(nn.PixelUnshuffle(2), nn.Conv2d(4 * C, C, 1))
        self.final_conv = nn.Conv2d(C, 3, 3, padding=1)

    def forward(self, x):
        return self.final_conv(torch.nn.functional.silu(self.down(self.init_conv(x))))


class _FoldedPort(nn.Module):
    def __init__(self, reference: _SpaceToDepthRef, with_bias: bool, inline: float = 0.0):
        super().__init__()
        self.inline = inline
        self.conv_in = nn.Conv2d(3, C, 3, padding=1)
        self.downsampler = Downsample2D(C, use_conv=True, out_channels=C, padding=0, kernel_size=2)
        self.conv_out = nn.Conv2d(C, 3, 3, padding=1)
        with torch.no_grad():
            self.conv_in.load_state_dict(reference.init_conv.state_dict())
            self.conv_out.load_state_dict(reference.final_conv.state_dict())
            # PixelUnshuffle puts pixel (i, j) of each 2x2 cell at channel 4c + 2i + j: the 1x1 weight's
            # columns are the 2x2 kernel's taps in that order
            self.downsampler.conv.weight.copy_(reference.down[1].weight.reshape(C, C, 2, 2))
            if with_bias:
                self.downsampler.conv.bias.copy_(reference.down[1].bias)

    def forward(self, x):
        return self.conv_out(torch.nn.functional.silu(self.downsampler(self.conv_in(x)))) + self.inline


@pytest.mark.parametrize("with_bias", [True, False])
def test_a_folded_space_to_depth_conv_is_paired_with_the_sequential_it_was_fed_like(with_bias):
    # round 29 (DDIM on denoising-diffusion-pytorch): the port's folded downsampler kept a random bias. bisect
    # paired it with the 1x1 conv inside the research's Sequential (fed the rearranged input, so never
    # replayed) and named the top level the culprit, with "[module-config] reference Conv2d kernel_size=(1,
    # 1), port kernel_size=(2, 2)" hints about the fold itself
    reference = _SpaceToDepthRef().eval()
    port = _FoldedPort(reference, with_bias).eval()
    report = bisect(reference, port, ((torch.randn(2, 3, 8, 8),), {}))
    text = report.render()
    if with_bias:  # must not fire: the fold is exact
        assert report.verdict == "match", text
        return
    assert report.verdict == "diverge", text
    assert [(c.reference, c.port) for c in report.culprits] == [("down", "downsampler")], text
    assert any(h.id == "weights" and "downsampler.conv.bias" in h.message for h in report.culprits[0].hints)
    assert "kernel_size" not in text and "stride" not in text, text


def test_a_later_culprit_has_no_setting_hints_about_a_module_already_substituted():
    # round 29: after the downsampler, `bisect --all`'s top-level culprit listed "[module-config] reference
    # Conv2d kernel_size=(1, 1), port kernel_size=(2, 2)" for the conv inside it, already given the
    # reference's outputs (one differing setting per hint was not looked through, only a combined hint)
    reference = _SpaceToDepthRef().eval()
    port = _FoldedPort(reference, with_bias=False, inline=0.1).eval()
    report = bisect(reference, port, ((torch.randn(2, 3, 8, 8),), {}), all_culprits=True)
    text = report.render()
    assert [c.port for c in report.culprits] == ["downsampler", ""], text
    assert not any(h.id == "module-config" for c in report.culprits for h in c.hints), text


D = 8


class _NormalisedQKV(nn.Module):
    # EDM2's forced weight normalisation (denoising-diffusion-pytorch's Karras U-Net): each row of the fused
    # q/k/v weight is normalised in the forward
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.to_qkv = nn.Linear(D, 3 * D, bias=False)
        self.to_out = nn.Linear(D, D, bias=False)

    def forward(self, x):
        w = self.to_qkv.weight / self.to_qkv.weight.norm(dim=1, keepdim=True)
        q, k, v = (x @ w.t()).chunk(3, -1)
        attn = torch.softmax(q @ k.transpose(-1, -2) / D**0.5, -1)
        return 0.7 * x + 0.3 * self.to_out(attn @ v)


class _SplitQKV(nn.Module):
    # the port: the normalisation folded into three plain weights at conversion time
    def __init__(self, reference: _NormalisedQKV, exact: bool):
        super().__init__()
        self.to_q, self.to_k, self.to_v = (nn.Linear(D, D, bias=False) for _ in range(3))
        self.to_out = nn.Linear(D, D, bias=False)
        w = reference.to_qkv.weight.detach()
        folded = w / w.norm(dim=1, keepdim=True)
        with torch.no_grad():
            for layer, part in zip((self.to_q, self.to_k, self.to_v), folded.chunk(3, 0)):
                layer.weight.copy_(part)
            if not exact:
                self.to_k.weight[0, 0] += 0.5  # one element off: no scaling of a chunk explains it
            self.to_out.weight.copy_(reference.to_out.weight)

    def forward(self, x):
        q, k, v = self.to_q(x), self.to_k(x), self.to_v(x)
        attn = torch.softmax(q @ k.transpose(-1, -2) / D**0.5, -1)
        return 0.3 * x + 0.7 * self.to_out(attn @ v)  # the slip: the residual weights swapped


@pytest.mark.parametrize("exact", [True, False])
def test_a_fused_qkv_split_and_normalised_by_the_conversion_is_said_as_scaled_chunks(exact):
    # round 31 (Karras U-Net 1-D): the port folds the forced weight normalisation into to_q/to_k/to_v, and the
    # [weights] hint at the (right) culprit said they "equal no reference tensor …, nor a layout op of one",
    # leading to the conversion, which was right
    reference = _NormalisedQKV().eval()
    report = bisect(reference, _SplitQKV(reference, exact).eval(), ((torch.randn(2, 5, D),), {}))
    text = report.render()
    (hint,) = [h for h in report.culprits[0].hints if h.id == "weights"]
    if exact:
        assert (
            "to_k.weight = reference to_qkv.weight rows 8:16 (chunk 1 of 3) with each row scaled"
            in hint.message
        )
        assert "equal no reference tensor" not in hint.message and hint.score < 0.5, text
    else:  # must not fire for the chunk no scaling explains
        assert "port parameters to_k.weight equal no reference tensor" in hint.message, text
        assert "to_q.weight = reference to_qkv.weight rows 0:8 (chunk 0 of 3)" in hint.message, text


class _TimeMLP(nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.lin1 = nn.Linear(D, 4 * D).to(dtype)
        self.lin2 = nn.Linear(4 * D, D).to(dtype)

    def forward(self, x):
        x = x.to(self.lin1.weight.dtype)
        return self.lin2(torch.nn.functional.silu(self.lin1(x))).float()


@pytest.mark.parametrize("stored", ["rounded", "reference-half", "exact"])
def test_weights_rounded_to_half_precision_by_the_conversion_are_named_with_a_verified_fix(stored):
    # round 32 (AudioLDM, torchcfm): a converter ending in `.to(torch.float16)`, loaded into a float32 model.
    # bisect named the first module and said "each parameter of the aligned pairs holds the values of its
    # aligned reference parameter … (checked without a match: … a bf16 or fp16 cast (re-run in each))"
    reference = _TimeMLP(torch.float16 if stored == "reference-half" else torch.float32).eval()
    port = _TimeMLP().eval()
    with torch.no_grad():
        for name, p in port.named_parameters():
            value = reference.get_parameter(name)
            p.copy_(value.half().float() if stored == "rounded" else value.float())
        if stored != "rounded":
            port.lin2.bias[0] += 0.1  # a slip of another kind, so that there is a culprit
    report = bisect(reference, port, ((torch.randn(3, D),), {}))
    text = report.render()
    rounded = [h for c in report.culprits for h in c.hints if "rounded to float16" in h.message]
    if stored != "rounded":  # must not fire: a half-precision reference read in float32 loses nothing
        assert not rounded, text
        return
    assert report.culprits[0].port == "lin1", text
    (hint,) = rounded
    assert "lin1.weight, lin1.bias hold the reference's values rounded to float16" in hint.message, text
    said = "in the whole models 4 of the port's 4 wider parameters hold only values float16 represents, 0 of"
    assert said in hint.message, text
    assert hint.verified, text


class _OneStepForBatch(nn.Module):
    # DiffWave's layout: one diffusion step (shape (1,)) for the whole batch, its features (1, D) broadcast
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(1, D)
        self.time_proj = nn.Linear(D, D)
        self.proj = nn.Linear(D, D)

    def forward(self, x, diffusion_step):
        temb = self.time_proj(torch.nn.functional.silu(self.embed(diffusion_step[:, None])))
        return self.proj(x + temb[:, None])


class _StepPerSample(nn.Module):
    # the diffusers port: a timestep per sample, features (B, D)
    def __init__(self, reference: _OneStepForBatch, bias: bool):
        super().__init__()
        self.embed = nn.Linear(1, D)
        self.time_proj = nn.Linear(D, D, bias=bias)
        self.proj = nn.Linear(D, D)
        with torch.no_grad():
            self.embed.load_state_dict(reference.embed.state_dict())
            self.proj.load_state_dict(reference.proj.state_dict())
            self.time_proj.weight.copy_(reference.time_proj.weight)
            if bias:
                self.time_proj.bias.copy_(reference.time_proj.bias)

    def forward(self, x, timestep):
        timestep = timestep.expand(x.shape[0])
        temb = self.time_proj(torch.nn.functional.silu(self.embed(timestep[:, None])))
        return self.proj(x + temb[:, None])


@pytest.mark.parametrize("bias", [True, False])
def test_time_features_of_one_row_for_the_batch_are_compared_with_the_ports_per_sample_rows(bias):
    # round 32 (DiffWave): the research feeds one diffusion step (1,) for a batch of 2, the port a timestep
    # per sample; every time-embedding pair was "untestable: inputs cannot be paired" (shapes (1, 512) against
    # (2, 512)), and the slip there (a bias dropped from the time projection) went unnamed
    reference = _OneStepForBatch().eval()
    port = _StepPerSample(reference, bias).eval()
    report = bisect(reference, port, ((torch.randn(2, 5, D), torch.tensor([42.9])), {}))
    text = report.render()
    if bias:  # must not fire: one row read for the batch is every row
        assert report.verdict == "match", text
        return
    assert [c.port for c in report.culprits] == ["time_proj"], text
    assert "one row read for the batch as [1, 8]" in text, text


class _BiasRef(nn.Module):  # tortoise's RelativePositionBias: it takes the logits and returns them biased
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.table = nn.Embedding(9, 1)

    def forward(self, logits):
        n = logits.shape[-1]
        pos = torch.arange(n)
        return logits + self.table((pos[None] - pos[:, None]).clamp(-4, 4) + 4)[..., 0] * 4.0


class _BiasPort(nn.Module):  # the port's: it takes nothing of the logits and returns the bias alone
    def __init__(self, reference: _BiasRef):
        super().__init__()
        self.table = nn.Embedding(9, 1)
        self.table.load_state_dict(reference.table.state_dict())

    def forward(self, positions, batch):
        bias = self.table((positions[None] - positions[:, None]).clamp(-4, 4) + 4)[..., 0] * 4.0
        return bias.expand(batch, -1, -1)


class _AttnRef(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.qk = nn.Linear(D, D)
        self.rel = _BiasRef()

    def forward(self, x):
        h = self.qk(x)
        return torch.softmax(self.rel(h @ h.transpose(-1, -2)), -1) @ x


class _AttnPort(nn.Module):
    def __init__(self, reference: _AttnRef):
        super().__init__()
        self.qk = nn.Linear(D, D)
        self.qk.load_state_dict(reference.qk.state_dict())
        self.rel = _BiasPort(reference.rel)

    def forward(self, x):
        h = self.qk(x)
        bias = self.rel(torch.arange(x.shape[1]), x.shape[0])
        return torch.softmax(h @ h.transpose(-1, -2) + bias, -1) @ x


def test_a_pair_whose_inputs_cannot_be_paired_is_no_masked_difference_on_a_matching_port():
    # round 32 (tortoise-tts): the fixed port was "ruled out: denoiser: … (bisect: masked: a submodule
    # (integrator.0.attention.relative_position_bias) differs beyond tolerance inside it, not at its output)":
    # the research module returns the logits plus the bias, the port's the bias alone
    reference = _AttnRef().eval()
    report = bisect(reference, _AttnPort(reference).eval(), ((torch.randn(2, 6, D),), {}))
    assert report.verdict == "match", report.render()


HEADS = 2


class _LegacyQKV(nn.Module):
    # guided diffusion's QKVAttentionLegacy (tortoise-tts): the fused rows laid out [head][q, k, v][row]
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, D)

    def forward(self, x):
        b, n, _ = x.shape
        qkv = self.qkv(x).reshape(b, n, HEADS, 3, D // HEADS).permute(3, 0, 2, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = torch.softmax(q @ k.transpose(-1, -2) / (D // HEADS) ** 0.5, -1)
        return self.out((attn @ v).transpose(1, 2).reshape(b, n, D)) + 0.1


class _SplitHeads(nn.Module):
    def __init__(self, reference: _LegacyQKV, exact: bool):
        super().__init__()
        self.to_q, self.to_k, self.to_v = (nn.Linear(D, D) for _ in range(3))
        self.out = nn.Linear(D, D)
        w = reference.qkv.weight.detach().reshape(HEADS, 3, D // HEADS, D)
        bias = reference.qkv.bias.detach().reshape(HEADS, 3, D // HEADS)
        with torch.no_grad():
            for i, layer in enumerate((self.to_q, self.to_k, self.to_v)):
                layer.weight.copy_(w[:, i].reshape(D, D))
                layer.bias.copy_(bias[:, i].reshape(D))
            if not exact:
                self.to_v.weight[0, 0] += 0.5  # one element off: no layout explains it
            self.out.load_state_dict(reference.out.state_dict())

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (
            layer(x).reshape(b, n, HEADS, -1).transpose(1, 2) for layer in (self.to_q, self.to_k, self.to_v)
        )
        attn = torch.softmax(q @ k.transpose(-1, -2) / (D // HEADS) ** 0.5, -1)
        return self.out((attn @ v).transpose(1, 2).reshape(b, n, D))  # the slip: the + 0.1 dropped


@pytest.mark.parametrize("exact", [True, False])
def test_a_fused_qkv_laid_out_head_by_head_is_said_as_gathered_not_unmatched(exact):
    # round 32 (tortoise-tts): the port split guided diffusion's legacy per-head q/k/v rightly, and the
    # [weights] hint said to_q/to_k/to_v "equal no reference tensor …, nor a layout op of one"
    reference = _LegacyQKV().eval()
    report = bisect(reference, _SplitHeads(reference, exact).eval(), ((torch.randn(2, 5, D),), {}))
    text = report.render()
    (hint,) = [h for c in report.culprits for h in c.hints if h.id == "weights"]
    said = "to_q.weight = reference qkv.weight rows of chunk 0 of 3 in each of 2 heads"
    assert said in hint.message, text
    if exact:
        assert "equal no reference tensor" not in hint.message and hint.score < 0.5, text
    else:  # must not fire for the tensor no layout explains
        assert "port parameters to_v.weight equal no reference tensor" in hint.message, text


def test_a_dropout_rate_is_no_setting_difference_in_eval_mode():
    # round 33 (f5-tts): "[module-config] reference Dropout p=0.1, port p=0" twice at a top-level culprit
    from paritykit.bisection.evidence.settings import settings_diff

    reference, port = nn.Dropout(0.1), nn.Dropout(0.0)
    assert settings_diff(reference.eval(), port.eval()) == []
    (training,) = settings_diff(reference.train(), port.train())  # must fire: in training it draws
    assert training.name == "p"


class _PlainBlock(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(D, D)

    def forward(self, x):
        return self.proj(x)


class _PositionedBlock(nn.Module):  # diffusers' BasicTransformerBlock with positional_embeddings set
    def __init__(self, reference: _PlainBlock):
        super().__init__()
        self.proj = nn.Linear(D, D)
        self.proj.load_state_dict(reference.proj.state_dict())
        self.register_buffer("pe", torch.sin(torch.arange(5 * D, dtype=torch.float32).reshape(5, D)))

    def forward(self, x):
        return self.proj(x + self.pe)


class _Wrap(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block
        self.out = nn.Linear(D, D)
        torch.manual_seed(2)
        self.out.reset_parameters()

    def forward(self, x):
        return self.out(self.block(x))


def test_a_table_only_the_port_holds_is_said_as_a_buffer_not_as_a_converted_parameter():
    # round 33 (Matcha-TTS): BasicTransformerBlock's default sinusoidal positional embedding; the hint said
    # "port parameters …pos_embed.pe equal no reference tensor", read as a conversion slip
    reference = _Wrap(_PlainBlock()).eval()
    port = _Wrap(_PositionedBlock(reference.block)).eval()
    port.out.load_state_dict(reference.out.state_dict())
    report = bisect(reference, port, ((torch.randn(2, 5, D),), {}))
    text = report.render()
    (hint,) = [h for c in report.culprits for h in c.hints if h.id == "weights"]
    assert "port buffers block.pe (tables the port's modules hold, not parameters)" in hint.message, text
    assert "port parameters block.pe" not in hint.message, text


def test_a_constant_parameter_below_the_top_level_is_said_with_its_value():
    # round 34 (mmdit): "port parameters transformer_blocks.0.attn.norm_q.weight, …norm_k.weight equal no
    # reference tensor" for q/k norms the research never applies, left at their fill of ones: the value was
    # looked up under the whole model's name in the culprit's own parameters, and never said
    reference = _Wrap(_PlainBlock()).eval()

    class _Normed(nn.Module):
        def __init__(self, plain):
            super().__init__()
            self.proj = nn.Linear(D, D)
            self.proj.load_state_dict(plain.proj.state_dict())
            self.norm_q = nn.LayerNorm(D)  # a part the research does not have, at its identity fill

        def forward(self, x):
            return self.proj(self.norm_q(x))

    port = _Wrap(_Normed(reference.block)).eval()
    port.out.load_state_dict(reference.out.state_dict())
    report = bisect(reference, port, ((torch.randn(2, 5, D),), {}))
    text = report.render()
    assert "block.norm_q.weight (all 1), block.norm_q.bias (all 0) equal no reference tensor" in text, text


def test_a_norm_gain_folded_with_a_constant_is_said_scaled_and_a_zero_bias_is_scaled_from_nothing():
    # round 34 (classifier guidance): RMS-norm gains folded with sqrt(W/C) were "equal no reference tensor";
    # once 1-D tensors were tried, the port's all-zero LayerNorm bias read as "reference … scaled by 0"
    from paritykit.bisection.evidence.weight_slices import _axis_scaled

    torch.manual_seed(0)
    g, h = torch.randn(8), torch.randn(8)
    port = {"norm.weight": g * 2**0.5, "norm.bias": torch.zeros(8), "other.weight": torch.randn(8)}
    found = _axis_scaled(port, list(port), {"ref.g": g, "ref.h": h})
    assert found == {"norm.weight": ("ref.g", "every element scaled by 1.414")}, found


class _FusedModulation(nn.Module):  # MMDiT: one projection's 12 chunks modulate two streams
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.to_cond = nn.Linear(D, 12 * D)
        self.norm = nn.LayerNorm(D, elementwise_affine=False)

    def forward(self, x, c, t):
        chunks = self.to_cond(t).chunk(12, -1)
        # text gammas, image gammas, then the betas text/image: each stream takes 2 gammas and 1 beta here
        x = self.norm(x) * chunks[4] + chunks[10]
        c = self.norm(c) * chunks[0] + chunks[8]
        return x * chunks[5], c * chunks[1]


class _SplitModulation(nn.Module):  # the port: one (shift, scale, gate) projection per stream, scale as 1 + s
    def __init__(self, reference: _FusedModulation, image: list[int], text: list[int]):
        super().__init__()
        self.norm1, self.norm1_context = nn.Linear(D, 3 * D), nn.Linear(D, 3 * D)
        self.norm = nn.LayerNorm(D, elementwise_affine=False)
        w, b = reference.to_cond.weight.detach().chunk(12), reference.to_cond.bias.detach().chunk(12)
        with torch.no_grad():
            for layer, order in ((self.norm1, image), (self.norm1_context, text)):
                layer.weight.copy_(torch.cat([w[j] for j in order]))
                layer.bias.copy_(torch.cat([b[j] - (1.0 if i == 1 else 0.0) for i, j in enumerate(order)]))

    def forward(self, x, c, t):
        shift, scale, gate = self.norm1(t).chunk(3, -1)
        c_shift, c_scale, c_gate = self.norm1_context(t).chunk(3, -1)
        x = (self.norm(x) * (1 + scale) + shift) * gate
        return x + 0.1, (self.norm(c) * (1 + c_scale) + c_shift) * c_gate  # the slip: + 0.1


@pytest.mark.parametrize("case", ["gathered", "one_element_off"])
def test_a_fused_modulation_gathered_into_two_projections_is_said_block_by_block(case):
    # round 34 (MMDiT): the port split a 12-chunk modulation into two AdaLayerNormZero projections, and the
    # [weights] hint said both "equal no reference tensor", the fused one "no port parameter … equals one"
    reference = _FusedModulation().eval()
    port = _SplitModulation(reference, [10, 4, 5], [8, 0, 1])
    if case == "one_element_off":
        with torch.no_grad():
            port.norm1.weight[0, 0] += 0.5
    x, c, t = torch.randn(2, 5, D), torch.randn(2, 3, D), torch.randn(2, 1, D)
    report = bisect(reference, port.eval(), ((x, c, t), {}))
    text = report.render()
    (hint,) = [h for c_ in report.culprits for h in c_.hints if h.id == "weights"]
    said = "norm1_context.weight = reference to_cond.weight row blocks 8, 0, 1 of 12, in that order"
    assert said in hint.message, text
    bias = "norm1_context.bias = reference to_cond.bias row blocks 8, 0, 1 of 12, in that order (-1 added to"
    bias += " blocks 0)"
    assert bias in hint.message, text
    if case == "one_element_off":  # must not fire for the projection one element breaks
        assert "port parameters norm1.weight equal no reference tensor" in hint.message, text
        assert "norm1.weight = reference" not in hint.message, text
    else:
        image = "norm1.weight = reference to_cond.weight row blocks 10, 4, 5 of 12, in that order"
        assert image in hint.message, text
        assert "equal no reference tensor" not in hint.message, text
        # six of the twelve blocks feed nothing in the port: said as such, never as the whole tensor unused
        spare = "reference to_cond.weight row blocks 2, 3, 6, 7, 9, 11 of 12: in no port parameter"
        assert spare in hint.message, text


class _MPAdd(nn.Module):
    def __init__(self, t: float = 0.3):
        super().__init__()
        self.t = t

    def forward(self, x, res):
        return (x * (1 - self.t) + res * self.t) / ((1 - self.t) ** 2 + self.t**2) ** 0.5


class _MPBlock(nn.Module):  # the research block: its constructor never passes the config's t on
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(D, D)
        self.res_mp_add = _MPAdd()

    def forward(self, x):
        return self.res_mp_add(self.proj(x), x)


class _MPPort(nn.Module):
    def __init__(self, reference: _MPBlock, t: float, reads_t: bool):
        super().__init__()
        self.proj = nn.Linear(D, D)
        self.proj.load_state_dict(reference.proj.state_dict())
        self.resnet_mp_add_t, self.reads_t = t, reads_t

    def forward(self, x):
        t = self.resnet_mp_add_t if self.reads_t else 0.3
        out = (self.proj(x) * (1 - t) + x * t) / ((1 - t) ** 2 + t**2) ** 0.5
        return out if self.reads_t else out + 0.1  # not reading t, the slip is elsewhere


class _Two(nn.Module):
    def __init__(self, first, second):
        super().__init__()
        self.first, self.second = first, second

    def forward(self, x):
        return self.second(self.first(x))


@pytest.mark.parametrize("reads_t", [True, False])
def test_a_setting_of_another_name_is_said_only_when_setting_it_makes_the_module_match(reads_t):
    # round 34 (karras3d): the port honoured the config's resnet_mp_add_t=0.25 where the research block's
    # MPAdd keeps t=0.3; the names differ, so no setting was compared and the hint was a correct conversion's
    reference = _Two(_MPBlock(), _MPBlock()).eval()
    port = _Two(_MPPort(reference.first, 0.3, True), _MPPort(reference.second, 0.25, reads_t)).eval()
    report = bisect(reference, port, ((torch.randn(2, 5, D),), {}))
    text = report.render()
    said = [h for c in report.culprits for h in c.hints if "paired by their name words" in h.message]
    if reads_t:
        (hint,) = said
        assert "reference second.res_mp_add.t=0.3, port second.resnet_mp_add_t=0.25" in hint.message, text
        assert hint.verified and hint.fix == "second.resnet_mp_add_t = 0.3", text
    else:  # must not fire: setting t changes nothing the module computes
        assert said == [], text


class RMSNorm(nn.Module):  # make-a-video's: normalised over the last axis, times a learned gain
    def __init__(self):
        super().__init__()
        self.dim, self.gamma = -1, nn.Parameter(torch.rand(D) + 0.5)

    def forward(self, x):
        return torch.nn.functional.normalize(x, dim=self.dim) * D**0.5 * self.gamma


class _FusedKV(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.norm, self.to_q, self.to_kv, self.to_out = (
            RMSNorm(),
            nn.Linear(D, D),
            nn.Linear(D, 2 * D),
            nn.Linear(D, D),
        )

    def forward(self, x):
        h = self.norm(x)
        q, (k, v) = self.to_q(h), self.to_kv(h).chunk(2, -1)
        return self.to_out(torch.softmax(q @ k.transpose(-1, -2), -1) @ v)


class _FoldedQKV(nn.Module):
    def __init__(self, reference: _FusedKV, fold_v: bool):
        super().__init__()
        from diffusers.models.normalization import RMSNorm as DiffusersRMSNorm

        self.norm = DiffusersRMSNorm(D, eps=1e-12, elementwise_affine=False)  # its dim is the shape (8,)
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(D, D) for _ in range(4))
        g = reference.norm.gamma.detach()
        k, v = reference.to_kv.weight.detach().chunk(2)
        kb, vb = reference.to_kv.bias.detach().chunk(2)
        with torch.no_grad():
            for layer, w, b, folds in (
                (self.to_q, reference.to_q.weight, reference.to_q.bias, True),
                (self.to_k, k, kb, True),
                (self.to_v, v, vb, fold_v),
            ):
                layer.weight.copy_(w * g[None, :] if folds else w)
                layer.bias.copy_(b)
            self.to_out.load_state_dict(reference.to_out.state_dict())

    def forward(self, x):
        h = self.norm(x)
        q, k, v = self.to_q(h), self.to_k(h), self.to_v(h)
        return self.to_out(torch.softmax(q @ k.transpose(-1, -2), -1) @ v)


@pytest.mark.parametrize("fold_v", [True, False])
def test_a_norm_gain_folded_into_its_readers_says_which_reader_lacks_it(fold_v):
    # round 35 (make-a-video): the port's norm has no gain, folded into to_q and to_k but not to_v; bisect
    # named the norm (by design it differs) with "[module-config] reference RMSNorm dim=-1, port dim=(16,)"
    reference = _Two(_FusedKV(), nn.Identity()).eval()
    port = _Two(_FoldedQKV(reference.first, fold_v), nn.Identity()).eval()
    report = bisect(reference, port, ((torch.randn(2, 5, D),), {}))
    text = report.render()
    assert "dim=-1" not in text, text  # an axis against a shape: two settings that share a name
    if fold_v:  # must not fire: every reader folds the gain, and nothing differs
        assert report.verdict in ("match", "masked"), text
        return
    (hint,) = [h for c in report.culprits for h in c.hints if h.id == "folded-gain"]
    folded = (
        "port first.to_q.weight, first.to_k.weight = reference first.to_q.weight, first.to_kv.weight rows 0:8"
    )
    assert folded in hint.message, text
    assert "port first.to_v.weight = reference first.to_kv.weight rows 8:16 without it" in hint.message, text
    assert "to_out" not in hint.message, text  # a layer of that width that reads something else


ORDER = [
    0,
    1,
    2,
    3,
    5,
    6,
    4,
    7,
]  # the port's features: three of them laid out otherwise (no swap: its own inverse)


class _Film(nn.Module):
    def __init__(self, columns=None):
        super().__init__()
        torch.manual_seed(0)
        self.cond, self.out = nn.Linear(D, D), nn.Linear(D, D)
        if columns is not None:  # the converter's columns, for the port's feature order
            with torch.no_grad():
                self.cond.weight.copy_(self.cond.weight[:, columns])
        self.slip = 0.0

    def forward(self, x, features):
        return self.out(x * self.cond(torch.nn.functional.mish(features))) + self.slip


class _FeaturesIn(nn.Module):  # the top level: the port's lays the features out in ORDER
    def __init__(self, film, order=None):
        super().__init__()
        self.film, self.order = film, order

    def forward(self, x, features):
        return self.film(x, features if self.order is None else features[..., self.order])


@pytest.mark.parametrize("columns", ["matched", "inverse"])
def test_a_module_fed_its_features_in_another_order_is_replayed_in_that_order(columns):
    # round 35 (lerobot): the port's FiLM layers read the observation features in its own order, the weights
    # converted to match (wrongly, by the inverse map); fed the reference's order, any such layer fails
    reference = _FeaturesIn(_Film()).eval()
    inverse = [ORDER.index(i) for i in range(D)]
    port_film = _Film(ORDER if columns == "matched" else inverse)
    port_film.slip = 0.1 if columns == "matched" else 0.0  # a real slip elsewhere in the matched port
    port = _FeaturesIn(port_film, ORDER)
    report = bisect(reference, port.eval(), ((torch.randn(2, 3, D), torch.randn(2, 3, D)), {}))
    text = report.render()
    assert report.culprits, text
    rows = {t.port: t for t in report.tested}
    cond = rows.get("film.cond")
    assert cond is not None, text
    if columns == "matched":  # must not fire: the layer computes the reference's on its own order
        assert cond.status == "pass" and "passes fed so" in cond.note, text
        assert all(c.port != "film.cond" for c in report.culprits), text
    else:
        assert (
            cond.status == "fail"
            and "with the last axis in another order; fed so, it still differs" in cond.note
        )


class _NormThen(nn.Module):
    def __init__(self, eps: float, off: float):
        super().__init__()
        torch.manual_seed(0)
        self.norm, self.proj, self.off = nn.LayerNorm(D, eps=eps), nn.Linear(D, D), off

    def forward(self, x):
        return self.proj(self.norm(x)) + self.off


@pytest.mark.parametrize("second_slip", [0.0, 0.25])
def test_a_verified_fix_says_how_far_it_takes_the_whole_output(second_slip):
    # round 35 (TabDDPM): "fix (verified): copy parameter proj.bias into proj_in.bias" held at the module, and
    # the whole model moved not at all (a batch norm behind it took the bias out; the cause was elsewhere)
    reference = _NormThen(1e-5, 0.0).eval()
    port = _NormThen(0.5, second_slip).eval()
    with torch.no_grad():
        port.proj.load_state_dict(reference.proj.state_dict())
    report = bisect(reference, port, ((torch.randn(2, 5, D) * 0.3,), {}))
    text = report.render()
    (hint,) = [h for c in report.culprits for h in c.hints if h.verified]
    after, before = hint.evidence["model_max_abs_after"], hint.evidence["model_max_abs_before"]
    assert "the whole output with it: max_abs" in text, text
    assert before > after, text
    if second_slip:  # the other slip is left: the whole output still differs by it
        assert after == pytest.approx(second_slip, rel=1e-4), text
    else:
        assert after < 1e-5, text


class _Attend(nn.Module):
    def __init__(self, off: float = 0.0):
        super().__init__()
        torch.manual_seed(0)
        self.to_q, self.to_k, self.to_v = (nn.Linear(D, D) for _ in range(3))
        self.off = off

    def forward(self, x, context=None):
        source = x if context is None else context
        q, k, v = self.to_q(x), self.to_k(source), self.to_v(source)
        return torch.softmax(q @ k.transpose(-1, -2) / D**0.5, -1) @ v + self.off


class _AttendBlock(nn.Module):
    def __init__(self, attn: _Attend, cross: bool):
        super().__init__()
        self.attn, self.cross = attn, cross

    def forward(self, x, context):
        return self.attn(x, context) if self.cross else self.attn(x)


@pytest.mark.parametrize("cross", [True, False])
def test_a_culprit_fed_an_input_the_reference_does_not_take_says_so_in_its_plain_hint(cross):
    # round 37 (imaginAIry): `only_cross_attention=True` made the port's self-attention attend to the context;
    # "[no-signature] … the settings … are equal" pointed away from the parent's setting that wires it
    reference = _AttendBlock(_Attend(), cross=False).eval()
    port = _AttendBlock(_Attend(off=0.0 if cross else 0.1), cross=cross).eval()
    report = bisect(reference, port, ((torch.randn(2, 5, D), torch.randn(2, 3, D)), {}), repair=False)
    text = report.render()
    said = "the port's call takes inputs the reference's does not (context), fed its own values"
    if cross:
        assert said in text, text
    else:  # must not fire: the same inputs on both sides, the slip inside
        assert "takes inputs the reference's does not" not in text, text
