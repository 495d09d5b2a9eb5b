"""`--kernels` for `liger generate` and `liger chat`: our RMSNorm, RoPE and SwiGLU kernels (the loss
kernels have nothing to do when generating), patched only where the tiny twin of this model proves
them equal, greedy generation included (`liger_cli.twin.kernel_check`), as `liger train` does."""

from __future__ import annotations

from types import SimpleNamespace

from liger_cli.generate.load import Target
from liger_cli.model import patch_kernels, twin_adapter
from liger_cli.twin.kernel_check import KERNELS, check_kernels

GENERATION_KERNELS = ("rms_norm", "rope", "swiglu")


def patch_proved_kernels(model, target: Target, echo) -> None:
    recipe = target.recipe
    trust = bool(recipe and recipe.model.trust_remote_code)
    adapter = twin_adapter(recipe) if recipe is not None else None
    requested = {name: name in GENERATION_KERNELS for name in KERNELS}
    check = check_kernels(model.config, requested, trust_remote_code=trust, add_adapter=adapter)
    for line in check.lines():
        echo(line)
    report = patch_kernels(model, SimpleNamespace(kernels=check.kernels, activation_checkpointing="off"))
    echo("kernels: " + "; ".join(report))
