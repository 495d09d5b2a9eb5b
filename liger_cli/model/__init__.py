"""Stage 3, the model: the recipe's model (real, or on the meta device), its adapter, activation
checkpointing and our kernels patched into the instance (`build.py`); a vision-language model's parts
(`vision.py`) and which of them train (`vision_training.py`); a distill run's frozen teacher
(`teacher.py`); and what its loss on a batch is (`objectives/`), which the run trains with and the
twin's checks prove.

Takes plain decisions (which kernels, which checkpointing) rather than the Plan, which is decided
later in the flow from this stage's meta model. May import `recipe` and `data`.
"""

from liger_cli.model.build import (
    adapter_in_model_dtype,
    add_adapter,
    build_meta_model_for,
    build_model,
    count_parameters,
    is_reward_config,
    load_base_model,
    meta_model_from_config,
    meta_twin,
    model_class,
    model_dtype,
    patch_kernels,
    read_config,
    recipe_config,
    reward_config,
    twin_adapter,
)

__all__ = [
    "adapter_in_model_dtype",
    "add_adapter",
    "build_meta_model_for",
    "build_model",
    "count_parameters",
    "is_reward_config",
    "load_base_model",
    "meta_model_from_config",
    "meta_twin",
    "model_class",
    "model_dtype",
    "patch_kernels",
    "read_config",
    "recipe_config",
    "reward_config",
    "twin_adapter",
]
