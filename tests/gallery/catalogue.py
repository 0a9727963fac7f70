r"""The bug catalogue: every case with its ground truth.

A case names the pair, the planted bug (the ``bug`` argument of the pair's ``build``), the culprits in
execution order as ``(reference module, port module)``, the hint ids that state the true cause, what kind of
cause it is (``config``, ``weights`` or ``code``: a hint claiming another kind is false), and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

Pair = tuple[str, str]


@dataclass(frozen=True)
class Case:
    id: str
    pair: str  # module of tests.gallery: mha, vae, rope, clip
    bug: str | None
    what: str
    culprits: tuple[Pair, ...] = ()
    # other (reference, port) names that are also a correct first culprit (same work, coarser or finer)
    also: tuple[Pair, ...] = ()
    hints: frozenset[str] = field(default_factory=frozenset)
    # hints that are true statements without naming the cause (neither counted as true nor as false)
    neutral: frozenset[str] = field(default_factory=frozenset)
    cause: str = (
        "code"  # config | weights | code; decides whether an "unknown, forward code differs" hint lies
    )
    fix: str | None = None
    conversion: bool = False  # the bug is in the weight conversion: weights map must show it
    planted: str | None = None  # for conversion bugs: the port tensor the slip wrote
    invisible_when_fresh: bool = False  # fresh init makes the bug a no-op (all-ones scale, zero shift)
    # edits of the repair search that state the true fix, as "kind@target" prefixes (a verified repair
    # matching none of them is a false hint): written from the planted bug, not from what the search says
    repairs: tuple[str, ...] = ()
    # "named": a bug class an issue described (a catalogue detector may know it); "held-out": planted after
    # the repair search was written, a class no detector in the code knows
    split: str = "named"

    @property
    def clean(self) -> bool:
        return not self.culprits

    def expected(self, variant: str) -> tuple[Pair, ...]:
        return () if self.invisible_when_fresh and variant == "fresh" else self.culprits


def _hints(*ids: str) -> frozenset[str]:
    return frozenset(ids)


CASES: tuple[Case, ...] = (
    # ---- pair 1: torch.nn.MultiheadAttention block <-> diffusers BasicTransformerBlock
    Case("mha-clean", "mha", None, "faithful port; native MHA kernel vs SDPA (float noise only)"),
    Case(
        "mha-math-attention", "mha", "math-attention", "faithful port on the explicit-math attention backend"
    ),
    Case(
        "mha-eps",
        "mha",
        "eps",
        "port LayerNorm eps 1e-5 (diffusers default), reference 1e-6",
        (("norm1", "norm1"),),
        hints=_hints("module-config", "norm-eps"),
        cause="config",
        fix="norm1.eps = 1e-06",
        repairs=("attribute@norm1.eps", "setting@norm1"),
    ),
    Case(
        "mha-gelu-tanh",
        "mha",
        "gelu-tanh",
        "port GELU tanh approximation, reference exact GELU",
        (("mlp", "ff"),),
        also=(("mlp.1", "ff.net.0"),),
        hints=_hints("activation", "module-config"),
        cause="config",
        fix="ff.net.0.approximate = 'none'",
        repairs=("attribute@ff.net.0.approximate", "setting@ff"),
    ),
    Case(
        "mha-swap-qk",
        "mha",
        "swap-qk",
        "conversion splits in_proj_weight as k, q, v",
        (("attn", "attn1"),),
        hints=_hints("weights"),
        cause="weights",
        fix="attn1.to_q <- in_proj_weight chunk 0, attn1.to_k <- chunk 1",
        conversion=True,
        planted="attn1.to_q.weight",
        repairs=("swap-parameters@attn1.to_k <-> attn1.to_q",),
    ),
    Case(
        "mha-attention-scale",
        "mha",
        "attention-scale",
        "port softmax scale 1/sqrt(model dim 32) instead of 1/sqrt(head dim 8)",
        (("attn", "attn1"),),
        hints=_hints("attention-scale", "module-config"),
        cause="config",
        fix="attn1.scale = 0.3536",
        repairs=("attribute@attn1.scale",),
    ),
    Case(
        "mha-bf16-norm",
        "mha",
        "bf16-norm",
        "port computes norm3 in bfloat16",
        (("norm2", "norm3"),),
        hints=_hints("bf16-cast"),
        cause="code",
        fix="run norm3 in float32",
    ),
    Case(
        "mha-two-bugs",
        "mha",
        "eps+gelu-tanh",
        "eps and GELU approximation at once (--all)",
        (("norm1", "norm1"), ("mlp", "ff")),
        also=(("mlp.1", "ff.net.0"),),
        hints=_hints("module-config", "norm-eps", "activation"),
        cause="config",
        fix="norm1.eps = 1e-06",
        repairs=("attribute@norm1.eps", "setting@norm1", "attribute@ff.net.0.approximate", "setting@ff"),
    ),
    # ---- pair 2: taming Encoder/Decoder (original SD VAE code) <-> diffusers AutoencoderKL
    Case(
        "vae-clean", "vae", None, "faithful conversion by convert_ldm_vae_checkpoint (bmm attention vs SDPA)"
    ),
    Case(
        "vae-math-attention", "vae", "math-attention", "faithful port on the explicit-math attention backend"
    ),
    Case(
        "vae-num-groups",
        "vae",
        "num-groups",
        "one decoder GroupNorm built with 16 groups, reference 32",
        (("decoder.mid.block_1.norm1", "decoder.mid_block.resnets.0.norm1"),),
        hints=_hints("module-config"),
        cause="config",
        fix="decoder.mid_block.resnets.0.norm1.num_groups = 32",
        repairs=(
            "attribute@decoder.mid_block.resnets.0.norm1.num_groups",
            "setting@decoder.mid_block.resnets.0.norm1",
        ),
    ),
    Case(
        "vae-affine-off",
        "vae",
        "affine-off",
        "encoder's last GroupNorm built with affine=False (its scale and shift dropped)",
        (("encoder.norm_out", "encoder.conv_norm_out"),),
        hints=_hints("module-config", "weights"),
        cause="config",
        fix="encoder.conv_norm_out.affine = True (and load its weights)",
        invisible_when_fresh=True,
    ),
    Case(
        "vae-transposed-1x1",
        "vae",
        "transposed-1x1",
        "conversion of the 1x1-conv query to linear transposes it",
        (("decoder.mid.attn_1", "decoder.mid_block.attentions.0"),),
        hints=_hints("weights"),
        cause="weights",
        fix="decoder.mid_block.attentions.0.to_q.weight = q.weight[:, :, 0, 0] (no transpose)",
        conversion=True,
        planted="decoder.mid_block.attentions.0.to_q.weight",
        repairs=("transpose@decoder.mid_block.attentions.0.to_q.weight",),
    ),
    Case(
        "vae-bf16-attention",
        "vae",
        "bf16-attention",
        "port's encoder mid attention runs in bfloat16",
        (("encoder.mid.attn_1", "encoder.mid_block.attentions.0"),),
        hints=_hints("bf16-cast"),
        cause="code",
        fix="run the attention in float32",
    ),
    Case(
        "vae-two-bugs",
        "vae",
        "num-groups+transposed-1x1",
        "16-group norm and a transposed query at once (--all)",
        (
            ("decoder.mid.block_1.norm1", "decoder.mid_block.resnets.0.norm1"),
            ("decoder.mid.attn_1", "decoder.mid_block.attentions.0"),
        ),
        hints=_hints("module-config", "weights"),
        cause="config",
        fix="decoder.mid_block.resnets.0.norm1.num_groups = 32",
        repairs=(
            "attribute@decoder.mid_block.resnets.0.norm1.num_groups",
            "setting@decoder.mid_block.resnets.0.norm1",
            "transpose@decoder.mid_block.attentions.0.to_q.weight",
        ),
    ),
    # ---- pair 3: rotary-embedding-torch attention <-> diffusers Attention + get_1d_rotary_pos_embed
    Case("rope-clean", "rope", None, "faithful port: interleaved layout, theta 500, positions / 2"),
    Case(
        "rope-half-split",
        "rope",
        "half-split",
        "port uses the half-split rotary layout, reference interleaved pairs",
        (("attn", "attn"),),
        also=(("attn", "rope"),),
        hints=_hints("module-fit", "module-config"),
        # "reference rotary.freqs used by no port parameter ... or the port lacks the layer": true, not the
        # cause
        neutral=_hints("weights"),
        cause="config",
        fix="rope.interleaved = True (and the processor's unbind dim -1)",
        repairs=("attribute@rope.interleaved", "setting@rope"),
    ),
    Case(
        "rope-theta-default",
        "rope",
        "theta-default",
        "port rotary theta left at the 10000 default, config says 500",
        (("attn", "attn"),),
        also=(("attn", "rope"),),
        hints=_hints("module-fit", "module-config"),
        # "reference rotary.freqs used by no port parameter ... or the port lacks the layer": true, not the
        # cause
        neutral=_hints("weights"),
        cause="config",
        fix="rope.theta = 500.0",
        repairs=("attribute@rope.theta", "setting@rope"),
    ),
    Case(
        "rope-interpolate-default",
        "rope",
        "interpolate-default",
        "port position scale left at the default 1, config interpolates by 2",
        (("attn", "attn"),),
        also=(("attn", "rope"),),
        hints=_hints("module-fit", "module-config"),
        # "reference rotary.freqs used by no port parameter ... or the port lacks the layer": true, not the
        # cause
        neutral=_hints("weights"),
        cause="config",
        fix="rope.linear_factor = 2.0",
        repairs=("attribute@rope.linear_factor", "setting@rope", "rescale@rope input 0"),
    ),
    # ---- pair 4: transformers CLIPEncoderLayer <-> diffusers BasicTransformerBlock
    Case("clip-clean", "clip", None, "faithful rename; eager attention vs SDPA (float noise only)"),
    Case(
        "clip-swap-kv",
        "clip",
        "swap-kv",
        "rename table crosses k_proj and v_proj",
        (("self_attn", "attn1"),),
        hints=_hints("weights"),
        cause="weights",
        fix="attn1.to_k <- self_attn.k_proj, attn1.to_v <- self_attn.v_proj",
        conversion=True,
        planted="attn1.to_k.weight",
        repairs=("swap-parameters@attn1.to_k <-> attn1.to_v",),
    ),
    Case(
        "clip-two-bugs",
        "clip",
        "swap-kv+gelu-tanh",
        "crossed k/v and GELU approximation at once (--all)",
        (("self_attn", "attn1"), ("mlp", "ff")),
        also=(("mlp.activation_fn", "ff.net.0"),),
        hints=_hints("weights", "activation", "module-config"),
        cause="weights",
        fix="attn1.to_k <- self_attn.k_proj, attn1.to_v <- self_attn.v_proj",
        conversion=True,
        planted="attn1.to_k.weight",
        repairs=("swap-parameters@attn1.to_k <-> attn1.to_v", "attribute@ff.net.0.approximate", "setting@ff"),
    ),
    # ---- look-alikes: bugs whose signature resembles a known hint without being its cause
    Case(
        "clip-quick-gelu",
        "clip",
        "quick-gelu",
        "reference CLIP uses quick_gelu (x * sigmoid(1.702 x)); the port keeps exact GELU",
        (("mlp", "ff"),),
        also=(("mlp.activation_fn", "ff.net.0"),),
        hints=_hints("activation"),
        # BasicTransformerBlock offers no quick-GELU setting: the port's activation code must change
        cause="code",
    ),
    Case(
        "clip-eps",
        "clip",
        "eps",
        "port LayerNorm eps 1e-6, CLIP's layer_norm_eps 1e-5",
        (("layer_norm1", "norm1"),),
        hints=_hints("module-config", "norm-eps"),
        cause="config",
        fix="norm1.eps = 1e-05",
        # fresh init (unit-scale LayerNorms, small attention logits): the block output moves by 3.9e-6 of a
        # max 3.8, below float32 tolerance, so "match" is the right answer there (distinct: 1.8e-5, visible)
        invisible_when_fresh=True,
        repairs=("attribute@norm1.eps", "setting@norm1"),
    ),
    Case(
        "mha-out-scale",
        "mha",
        "out-scale",
        "port forward code multiplies the attention out-projection by 1.01 (no setting or weight"
        " explains it)",
        (("attn", "attn1"),),
        also=(("attn.out_proj", "attn1.to_out.0"),),
        # a constant factor is the true observation; any config, weights or cast claim is false
        hints=_hints("constant-scale"),
        cause="code",
        repairs=("rescale@attn1 output",),
    ),
    Case(
        "mha-bias-twice",
        "mha",
        "bias-twice",
        "port forward code adds the attention out-projection bias a second time",
        (("attn", "attn1"),),
        also=(("attn.out_proj", "attn1.to_out.0"),),
        # a per-channel offset fits no known signature: "unknown, the forward code differs" is the true answer
        hints=_hints("no-signature"),
        cause="code",
        invisible_when_fresh=True,  # nn.MultiheadAttention initialises the out-projection bias to zero
        repairs=("rescale@attn1.to_out.0.bias",),
    ),
    Case(
        "vae-attention-scale",
        "vae",
        "attention-scale",
        "port decoder mid attention scaled by 1/sqrt(32) (the base width) instead of 1/sqrt(64)",
        (("decoder.mid.attn_1", "decoder.mid_block.attentions.0"),),
        hints=_hints("attention-scale", "module-config"),
        cause="config",
        fix="decoder.mid_block.attentions.0.scale = 0.125",
        repairs=("attribute@decoder.mid_block.attentions.0.scale",),
    ),
)


def _held_out(
    id: str,
    pair: str,
    what: str,
    culprit: tuple[str, str],
    repairs: tuple[str, ...],
    cause: str,
    also: tuple[Pair, ...] = (),
    invisible_when_fresh: bool = False,
    hints: tuple[str, ...] = (),
) -> Case:
    r"""A held-out case: its true hint is a verified repair whose edit is one of ``repairs`` (or one of
    ``hints``: the weights map does know row reorders, so its verified layout slip is true too); the
    catalogue's other observations at the culprit (a constant scale, unmatched weights) are true but not
    counted as the cause."""
    return Case(
        id,
        pair,
        id.split("-", 1)[1],
        what,
        (culprit,),
        also=also,
        cause=cause,
        repairs=repairs,
        hints=_hints(*hints),
        neutral=_hints(
            "constant-scale",
            "weights",
            "inline-reference",
            "inline-input",
            "transpose",
            "sign-flip",
            "permutation",
            "no-signature",
            "remix",
            "module-config",
            "zeroed",
            "swapped-halves",
        ),
        split="held-out",
        invisible_when_fresh=invisible_when_fresh,
    )


# ---- held-out split: written after the repair search (issue 22), each a bug class no detector knows
HELD_OUT: tuple[Case, ...] = (
    _held_out(
        "mha-out-heads-permuted",
        "mha",
        "conversion crosses heads 0 and 1 in the out-projection's inputs",
        ("attn", "attn1"),
        ("permute-chunks@attn1.to_out.0.weight",),
        "weights",
        also=(("attn.out_proj", "attn1.to_out.0"),),
        hints=("weights",),
    ),
    _held_out(
        "mha-norm-log-weight",
        "mha",
        "second norm's scale loaded as its logarithm",
        ("norm2", "norm3"),
        ("exp@norm3.weight",),
        "weights",
    ),
    _held_out(
        "mha-mlp-halves",
        "mha",
        "first MLP projection's output rows loaded half-swapped",
        ("mlp.0", "ff.net.0.proj"),
        ("permute-chunks@ff.net.0.proj",),
        "weights",
        also=(("mlp", "ff"),),
        hints=("weights",),
    ),
    _held_out(
        "mha-attention-subtracted",
        "mha",
        "port forward code subtracts the attention branch",
        ("attn", "attn1"),
        ("rescale@attn1 output",),
        "code",
    ),
    _held_out(
        "vae-conv-flipped",
        "vae",
        "decoder conv_in kernel flipped spatially by the conversion",
        ("decoder.conv_in", "decoder.conv_in"),
        ("flip@decoder.conv_in.weight",),
        "weights",
    ),
    _held_out(
        "vae-norm-bias-negated",
        "vae",
        "encoder's last norm shift negated by the conversion",
        ("encoder.norm_out", "encoder.conv_norm_out"),
        ("negate@encoder.conv_norm_out.bias",),
        "weights",
        invisible_when_fresh=True,
    ),  # a fresh norm's shift is zero: negating it changes nothing
    _held_out(
        "vae-residual-sign",
        "vae",
        "decoder mid resnet returns input - h (residual with the wrong sign)",
        ("decoder.mid.block_2", "decoder.mid_block.resnets.1"),
        ("input-residual@decoder.mid_block.resnets.1",),
        "code",
    ),
    _held_out(
        "vae-latent-scaled",
        "vae",
        "port divides the latents by 0.18215 again before post_quant_conv",
        ("post_quant_conv", "post_quant_conv"),
        ("rescale@post_quant_conv input",),
        "code",
    ),
    _held_out(
        "clip-k-heads-permuted",
        "clip",
        "k_proj rows loaded with heads 0 and 1 crossed",
        ("self_attn", "attn1"),
        ("permute-chunks@attn1.to_k",),
        "weights",
        hints=("weights",),
    ),
    _held_out(
        "clip-norm-inverse-weight",
        "clip",
        "second norm's scale stored as its reciprocal",
        ("layer_norm2", "norm3"),
        ("reciprocal@norm3.weight",),
        "weights",
        invisible_when_fresh=True,
    ),  # a fresh norm's scale is one: its reciprocal is itself
    _held_out(
        "rope-cos-sin-swapped",
        "rope",
        "the port hands attention (sin, cos) instead of (cos, sin)",
        ("attn", "attn"),
        ("swap-inputs@attn",),
        "code",
        also=(("attn", "rope"),),
    ),
)

ALL_CASES: tuple[Case, ...] = CASES + HELD_OUT
BY_ID = {c.id: c for c in ALL_CASES}
