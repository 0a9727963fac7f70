r"""Float32 as written while paritykit runs models. On NVIDIA GPUs torch may round float32 inputs to TF32
(a 10-bit mantissa) inside convolutions (cuDNN's default) and matrix products (when a script asks for it):
two correct float32 layers written differently, a 1x1 convolution and a Linear, then differ by about 1e-3,
far above float32's own error, and a correct port looks broken. Parity is judged in float32 as the code
writes it; the user's own settings come back afterwards."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def exact_float32() -> Iterator[None]:
    r"""TF32 off for cuDNN and cuBLAS inside the block (also usable as a decorator); nothing changes on a
    machine without CUDA."""
    import torch

    if not torch.cuda.is_available():
        yield
        return
    backends = (torch.backends.cudnn, torch.backends.cuda.matmul)
    try:
        saved = [b.allow_tf32 for b in backends]
        for b in backends:
            b.allow_tf32 = False
    except RuntimeError:  # a script that set the new fp32_precision API: torch refuses to mix the two
        saved = None
    try:
        yield
    finally:
        if saved is not None:
            for b, value in zip(backends, saved):
                b.allow_tf32 = value
