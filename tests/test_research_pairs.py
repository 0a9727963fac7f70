"""Real port pairs: published research code (tests/research.py) against diffusers' own classes, weights moved by
diffusers' own converters. Nothing on the reference side copies diffusers."""

from __future__ import annotations

import pytest
import torch
from paritykit.bisection.entry import bisect

from tests.research import wan_vae

LATENT = (1, 4, 3, 2, 2)  # three latent frames, each decoded as one chunk through the causal cache


class Decode(torch.nn.Module):
    """One side's decode as a module: the research VAE with its latent scale set to identity (diffusers'
    AutoencoderKLWan leaves the scale to the pipeline), or diffusers' ``decode(z).sample``."""

    def __init__(self, vae: torch.nn.Module, research: bool):
        super().__init__()
        self.vae, self.research = vae, research

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        if self.research:
            return self.vae.decode(z, [torch.zeros(z.shape[1]), torch.ones(z.shape[1])])
        return self.vae.decode(z).sample


@pytest.fixture(scope="module")
def wan_pair():
    from diffusers import AutoencoderKLWan
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    torch.manual_seed(0)
    research = wan_vae().VideoVAE_(dim=4, z_dim=4).eval()  # the research layout, channels cut to 4
    port = AutoencoderKLWan(base_dim=4, z_dim=4).eval()
    missing, unexpected = port.load_state_dict(convert_wan_vae_to_diffusers(research.state_dict()))
    assert not missing and not unexpected
    return research, port


def test_correct_chunked_causal_vae_port_matches(wan_pair):
    # diffusers' residual block calls one shared SiLU twice per frame chunk, the research block has two SiLUs:
    # calls paired by order would compare the first SiLU's second call with the shared one's second call (the
    # other activation), a "masked" on a bit-identical port
    research, port = wan_pair
    report = bisect(Decode(research, True), Decode(port, False), [torch.randn(LATENT)])
    assert report.verdict == "match" and report.exit_code == 0, report.render()
    assert report.first_output_divergence is None


def test_wan_vae_port_with_a_wrong_activation_is_found_in_its_block(wan_pair):
    research, port = wan_pair
    import copy

    broken = copy.deepcopy(port)
    broken.decoder.mid_block.resnets[1].nonlinearity = torch.nn.GELU()
    report = bisect(Decode(research, True), Decode(broken, False), [torch.randn(LATENT)])
    assert report.verdict == "diverge", report.render()
    assert report.culprit.port == "vae.decoder.mid_block.resnets.1.nonlinearity", report.render()
    assert any(h.verified and "nn.SiLU()" in (h.fix or "") for h in report.culprit.hints), report.render()
