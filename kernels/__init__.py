"""liger_kernels: our Triton kernels with PyTorch reference paths (installed from `kernels/`).

Each kernel runs Triton on CUDA tensors and PyTorch elsewhere; `LIGER_KERNEL_BACKEND=triton|torch`
forces one. `patch_model` puts them into one Hugging Face model instance.
"""

from .cross_entropy import cross_entropy
from .fused_linear_cross_entropy import fused_linear_cross_entropy
from .patch import PatchReport, patch_model
from .rms_norm import rms_norm
from .rope import apply_rope
from .swiglu import swiglu

__all__ = [
    "PatchReport",
    "apply_rope",
    "cross_entropy",
    "fused_linear_cross_entropy",
    "patch_model",
    "rms_norm",
    "swiglu",
]
