"""Choose between the Triton and the PyTorch path of a kernel.

Triton runs on CUDA tensors; everywhere else the PyTorch path runs. `LIGER_KERNEL_BACKEND=triton|torch`
forces one (tests force triton on the CPU together with `TRITON_INTERPRET=1`). Triton is imported only
when its path is chosen, so importing `liger_kernels` on a CPU machine stays cheap.
"""

from __future__ import annotations

import os

import torch

ENV_VAR = "LIGER_KERNEL_BACKEND"


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether `tensor`'s kernel should take the Triton path."""
    choice = os.environ.get(ENV_VAR, "").strip().lower()
    if choice == "torch":
        return False
    if choice not in ("", "triton"):
        raise ValueError(
            f"{ENV_VAR}={choice!r} is not a backend: use 'triton' or 'torch', or leave it unset."
        )
    if choice == "" and not tensor.is_cuda:
        return False
    if not tensor.is_cuda and not interpreting():
        # Without the interpreter a Triton launch on CPU tensors fails with "0 active drivers".
        raise RuntimeError(
            f"{ENV_VAR}=triton on a {tensor.device} tensor needs TRITON_INTERPRET=1 set before triton is imported."
        )
    return True


def tile_elements() -> int:
    """How many elements one program's tile may hold.

    On a GPU a tile lives in registers, so it stays small; the interpreter runs each program as numpy
    calls at ~3 ms apiece, so there a large tile (many rows per program) is far faster.
    """
    return 1 << 16 if interpreting() else 1 << 13


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def rows_per_program(n_rows: int, block_cols: int) -> int:
    """A power-of-two row count so that one tile of `rows x block_cols` fits `tile_elements()`."""
    return max(1, min(next_power_of_2(n_rows), tile_elements() // block_cols))


class LazyKernel:
    """A `@triton.jit` kernel that imports and compiles Triton on its first launch, not at import.

    The kernel's module declares `tl = None`; on first launch it is bound to `triton.language`, which is
    where a Triton kernel looks its names up. Kernels written this way call no other jit functions.
    """

    def __init__(self, fn):
        self.fn = fn
        self._kernel = None

    def __getitem__(self, grid):
        if self._kernel is None:
            import triton
            import triton.language

            self.fn.__globals__["tl"] = triton.language
            self._kernel = triton.jit(self.fn)
        return self._kernel[grid]


def program_cap(tensor: torch.Tensor) -> int:
    """How many programs a persistent (row-looping) kernel launches: a few per SM, or a few on the CPU."""
    if tensor.is_cuda:
        return 2 * torch.cuda.get_device_properties(tensor.device).multi_processor_count
    return 4


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def cast_as_autocast_would(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """Do what autocast would do to a head's matmuls, once, before an autograd Function whose own
    matmuls use out= buffers (which autocast does not allow); the casts stay differentiable. The
    Function then runs with autocast disabled."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    return hidden, weight, bias
