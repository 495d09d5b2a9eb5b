"""liger_kernels: our Triton kernels with PyTorch reference paths (installed from `kernels/`).

Each kernel runs Triton on CUDA tensors and PyTorch elsewhere; `LIGER_KERNEL_BACKEND=triton|torch`
forces one. `patch_model` puts them into one Hugging Face model instance. `fused_linear_logprob` and
`preference_loss` are the kernel half of preference training (DPO/IPO/SimPO/ORPO);
`fused_linear_token_logprob` (the same kernel, per token) and `grpo_loss` that of online RL;
`fused_linear_divergence` (reverse KL or TRL GKD's generalized JSD between a student's and a frozen
teacher's next-token distributions, from both models' hidden states and heads) that of distillation.
"""

from .cross_entropy import cross_entropy
from .fused_linear_cross_entropy import fused_linear_cross_entropy
from .fused_linear_distill import fused_linear_divergence
from .fused_linear_logprob import fused_linear_logprob, fused_linear_token_logprob
from .patch import PatchReport, patch_model
from .patch_loss import sequence_logprobs_loss, token_logprobs_loss
from .preference import check_preference_options, preference_loss
from .rms_norm import rms_norm
from .rope import apply_rope
from .swiglu import swiglu

__all__ = [
    "PatchReport",
    "apply_rope",
    "check_preference_options",
    "cross_entropy",
    "fused_linear_cross_entropy",
    "fused_linear_divergence",
    "fused_linear_logprob",
    "fused_linear_token_logprob",
    "patch_model",
    "preference_loss",
    "rms_norm",
    "sequence_logprobs_loss",
    "token_logprobs_loss",
    "swiglu",
]
