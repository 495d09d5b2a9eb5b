"""Every edit liger makes to accelerate's and DeepSpeed's process-wide state, in one place.

accelerate keeps its state in process-wide singletons and reads `ACCELERATE_USE_*` and
`FSDP_TRANSFORMER_CLS_TO_WRAP` from the environment; DeepSpeed picks its accelerator from
`DS_ACCELERATOR` and its compiled ops from one module-level table; FSDP-1 hides the sizes we check
in private attributes. On a CPU accelerate silently runs DDP where FSDP or DeepSpeed was asked for
(see docs/fsdp-facts.md#launching-on-a-cpu), so a few of these must be set by hand. The tokenizers
library reads TOKENIZERS_PARALLELISM (set while the data is tokenized by forked processes). Nothing
outside this module touches them. And how a `liger` process ends (`leave`).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterable, MutableMapping
from pathlib import Path
from typing import NoReturn

BACKEND_ENV = ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED")
WRAP_ENV = "FSDP_TRANSFORMER_CLS_TO_WRAP"
_REPLACED = "_liger_replaced_type"


def set_deepspeed_accelerator(device: str) -> None:
    """Tell DeepSpeed (when accelerate imports it) its accelerator, rather than let it guess."""
    os.environ.setdefault("DS_ACCELERATOR", device)


def child_env(cpu: bool, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of `accelerate launch`'s ranks: each builds its backend from the recipe, so
    stale accelerate settings must not leak in; on a CPU, ACCELERATE_USE_CPU gives real gloo groups."""
    env = dict(os.environ)
    if cpu:
        env["ACCELERATE_USE_CPU"] = "1"
    for key in (*BACKEND_ENV, "ACCELERATE_CONFIG_FILE"):
        env.pop(key, None)
    env.update(extra or {})
    return env


def accelerate_env(classes: Iterable[str] | object, env: MutableMapping[str, str] | None = None) -> None:
    """Make FSDP_TRANSFORMER_CLS_TO_WRAP agree with the resolved wrap classes before accelerate reads it.

    accelerate 1.15 splits the variable with a bare `split(",")`, so "" or "LlamaDecoderLayer," fail
    (see docs/field-failures.md#empty-wrap-class-names), and child processes inherit the value. We
    write the clean comma-joined list, or remove the variable when there is nothing to wrap. Takes
    the class names, or anything with a `.classes` list (a WrapResolution).
    """
    env = os.environ if env is None else env
    names = list(getattr(classes, "classes", classes))
    if names:
        env[WRAP_ENV] = ",".join(names)
    else:
        env.pop(WRAP_ENV, None)


def reset_for_new_run() -> None:
    """Give the next Accelerator a clean slate, even after another run in this process.

    accelerate's state is a process-wide singleton, a plugin sets ACCELERATE_USE_* for every later
    Accelerator, an earlier CPU run may have overridden the distributed type, and transformers
    loads under ZeRO-3 while a DeepSpeed config is registered.
    """
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from transformers.integrations import unset_hf_deepspeed_config

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    if _REPLACED in PartialState._shared_state:  # undo the CPU override of an earlier run
        PartialState._shared_state["distributed_type"] = PartialState._shared_state.pop(_REPLACED)
    for key in BACKEND_ENV:
        os.environ.pop(key, None)
    unset_hf_deepspeed_config()


@contextlib.contextmanager
def loading_alone():
    """While a ZeRO-3 config is registered, transformers builds every model under ZeRO-3's init
    context, whose partitioning is collective: a model that one rank loads by itself (the final check's
    reload) must be built outside it, or that rank waits on the others forever."""
    from transformers.integrations import deepspeed as hf_deepspeed

    saved = getattr(hf_deepspeed, "_hf_deepspeed_config_weak_ref", None)
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved


def force_distributed_type_on_cpu(kind: str) -> object:
    """Make accelerate run `kind` ("FSDP" | "DEEPSPEED") on a CPU, where it would silently run DDP.

    Both singletons are set, as accelerate itself does on a GPU: a later AcceleratorState() copies
    PartialState's values over its own. Returns the AcceleratorState.
    """
    import torch
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    state = AcceleratorState()
    PartialState._shared_state[_REPLACED] = state.distributed_type
    for shared in (PartialState._shared_state, AcceleratorState._shared_state):
        shared["distributed_type"], shared["device"] = DistributedType[kind], torch.device("cpu")
    return state


def keep_fsdp_plugin_on_cpu(state, plugin, precision: str) -> None:
    """accelerate drops the FSDP plugin on a CPU: give it back (and its mixed precision)."""
    state.fsdp_plugin = plugin
    if precision != "fp32":
        plugin.set_mixed_precision(precision)


def keep_deepspeed_on_cpu(state, plugin, accelerator) -> None:
    """Select the DeepSpeed plugin on a CPU, as accelerate does only on GPUs.

    DeepSpeed's CPU communication layer JIT-compiles a shared-memory op on first use (about 95 s on 2
    cores) that only inference uses: marking it incompatible in DeepSpeed's op table makes it fall
    back to gloo (see docs/fsdp-facts.md#deepspeed-on-a-cpu). `select()` registers the config with
    transformers (HfDeepSpeedConfig), so from_pretrained loads under ZeRO-3's init context.
    """
    import deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")  # wraps the existing gloo group
    plugin.set_mixed_precision(state._mixed_precision)
    plugin.select(_from_accelerator_state=True)
    state.deepspeed_plugins = plugin
    state._mixed_precision = "no"
    accelerator.deepspeed_engine_wrapped = None


def fsdp1_shard_sizes(unit) -> tuple[int, int] | None:
    """(local, full) parameter counts of an FSDP-1 unit's flat parameter; None if it has none.

    The local shard is padded to a multiple of the world size."""
    flat = getattr(unit, "_flat_param", None)
    if flat is None:
        return None
    return flat.numel(), flat._unpadded_unsharded_size.numel()


def fsdp1_reshard_all(model) -> None:
    """Every FSDP-1 unit back to its shard. A forward leaves the root unit gathered (FSDP-1 keeps it
    for the backward that usually follows), so writes into the shards would not be seen by the next
    forward; resharded, the next forward gathers them afresh."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp._runtime_utils import _reshard

    for unit in FSDP.fsdp_modules(model):
        handle = unit._handle
        initialized = handle is not None and hasattr(
            handle.flat_param, "_full_param_padded"
        )  # lazily, at a forward
        if initialized and handle.uses_sharded_strategy and not handle.needs_unshard():
            _reshard(unit, handle, True)


def clean_parameter_name(name: str) -> str:
    """A parameter name without the wrapper modules FSDP and checkpointing insert."""
    return name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")


HUB_KERNEL_NOTICE = "Failed to load CPU gemm_4bit_forward from kernels-community"
_BNB_CPU_LOGGER = "bitsandbytes.backends.cpu.ops"


def _not_hub_kernel_notice(record) -> bool:
    return not str(record.msg).startswith(HUB_KERNEL_NOTICE)


def hide_bitsandbytes_unless_quantized(quantize: str, model_path: Path | None) -> None:
    """peft imports bitsandbytes whenever it is installed, and bitsandbytes imports torch's compiler:
    about 3 s of CPU in every process that trains or serves, quantized or not. A process whose model
    is not quantized (the recipe's `model.quantize` is none and its local config names no
    quantization_config; `model_path` is the model's folder or its config file) hides it from every library, as if it were not installed. Decided once,
    before anything imports peft or bitsandbytes: peft and transformers cache what they find."""
    if quantize != "none" or {"peft", "bitsandbytes"} & sys.modules.keys():
        return
    config = model_path / "config.json" if model_path is not None and model_path.is_dir() else model_path
    if config is None or not config.is_file():
        return  # a hub name or a config we cannot read cheaply: leave bitsandbytes as it is
    try:
        if "quantization_config" in json.loads(config.read_text()):
            return
    except (OSError, ValueError):
        return
    sys.modules["bitsandbytes"] = None  # importlib's find_spec then says "not installed"


def hide_deepspeed_unless_used(backend: str) -> None:
    """transformers imports DeepSpeed at its own import whenever DeepSpeed is installed (about 0.3 s and
    a "Setting accelerator to CPU" log line in every process that loads a model). A process whose run
    does not use the deepspeed backend hides it from every library, as if it were not installed.
    Decided before transformers' DeepSpeed integration is imported (it caches what it found)."""
    if backend == "deepspeed" or {"deepspeed", "transformers.integrations.deepspeed"} & sys.modules.keys():
        return
    sys.modules["deepspeed"] = None  # importlib's find_spec then says "not installed"


def silence_hub_kernel_notice() -> None:
    """bitsandbytes' CPU backend tries, when imported, to fetch a kernel from the Hugging Face hub and
    logs HUB_KERNEL_NOTICE when it cannot (its own CPU code then runs). peft imports bitsandbytes
    whenever it is installed, so that line would land on every run's stderr, quantized or not. Only
    that one message of that one logger is dropped; anything else it says still shows. Cheap (no
    import of bitsandbytes): call it before peft or bitsandbytes is imported."""
    import logging

    logger = logging.getLogger(_BNB_CPU_LOGGER)
    if _not_hub_kernel_notice not in logger.filters:
        logger.addFilter(_not_hub_kernel_notice)


def quiet_libraries() -> None:
    """Our own progress and metrics lines are the run's log: silence libraries' bars and notices."""
    import logging
    import warnings

    from transformers.utils import logging as hf_logging

    silence_hub_kernel_notice()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    # peft still calls transformers' deprecated `is_gradient_checkpointing`: not the user's concern.
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)


def fsdp2_reshard_after_forward(unit) -> tuple:
    """What an FSDP-2 unit does after its forward, to restore after generation changed it (torch's
    `set_reshard_after_forward` has no getter; the root is special-cased at lazy init)."""
    state = unit._get_fsdp_state()
    return state._auto_reshard_after_forward, [g.post_forward_mesh_info for g in state._fsdp_param_groups]


def restore_fsdp2_reshard_after_forward(unit, saved: tuple) -> None:
    state = unit._get_fsdp_state()
    state._auto_reshard_after_forward = saved[0]
    for group, info in zip(state._fsdp_param_groups, saved[1], strict=True):
        group.post_forward_mesh_info = info


def register_fsdp2_classes(model) -> None:
    """transformers looks up what a model's forward records (`output_hidden_states`) by the model's class
    (`_CAN_RECORD_REGISTRY`); FSDP-2 swaps each unit's class for a subclass (`FSDPCLIPVisionModel`) that
    it does not know, so a vision tower that is a unit returns no hidden states and LLaVA's forward fails
    on `None`. Register each swapped model under its new class, as transformers does at init (a
    transformers without this registry has nothing to register: a failure there stays loud)."""
    from torch.distributed.fsdp import FSDPModule
    from transformers import PreTrainedModel

    try:
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY
    except ImportError:
        return

    for module in model.modules():
        if isinstance(module, PreTrainedModel) and isinstance(module, FSDPModule):
            _CAN_RECORD_REGISTRY[module] = module._can_record_outputs


@contextlib.contextmanager
def zero3_hooks_lifted(engine):
    """A ZeRO-3 engine's per-module forward/backward hooks removed (they would release gathered
    parameters after each module), then registered again as DeepSpeed registers them."""
    offload = engine.optimizer.parameter_offload
    for param in offload.module.parameters():
        param.ds_active_sub_modules.clear()
    for hook in [*offload.forward_hooks, *offload.backward_hooks]:
        hook.remove()
    offload.forward_hooks, offload.backward_hooks = [], []
    try:
        yield
    finally:
        offload._register_deepspeed_module(offload.module)


@contextlib.contextmanager
def tokenizers_single_threaded(forking: bool):
    """Forked tokenizing processes each run the tokenizer on one thread (the cores are theirs to share),
    without the tokenizers library's warning about a fork after its threads were used."""
    if not forking:
        yield
        return
    with entry_set(os.environ, "TOKENIZERS_PARALLELISM", "false"):
        yield


@contextlib.contextmanager
def entry_set(mapping: MutableMapping, key: str, value):
    """`mapping[key] = value` for the block, then exactly as before (an absent key absent again)."""
    missing = object()
    before = mapping.get(key, missing)
    mapping[key] = value
    try:
        yield
    finally:
        if before is missing:
            mapping.pop(key, None)
        else:
            mapping[key] = before


def leave(code: object) -> NoReturn:
    """Exit as Python does (non-daemon threads joined, atexit hooks run, streams flushed), less the
    teardown of every module: once torch and transformers are imported, that teardown costs about 1.7
    CPU s of a process that has finished its work (measured in docs/testing.md)."""
    import atexit
    import threading

    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`liger ... | head`) or a closed stream
            pass
    os._exit(code)
