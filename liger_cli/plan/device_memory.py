"""How much memory the device has: given on the command line (`--device-memory 80GB`) or detected."""

from __future__ import annotations

import re

from liger_cli.errors import UserError


def parse_device_memory(text: str) -> int:
    """'80GB', '80GiB', '81920MB', '1.5TB': GB and GiB both mean 2**30 bytes, as GPU sizes are quoted."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT])i?B?\s*", text, re.IGNORECASE)
    if not match:
        raise UserError(f"--device-memory {text!r}: give a size such as 80GB, 24GiB or 16384MB")
    number, unit = float(match.group(1)), match.group(2).upper()
    return int(number * 1024 ** "KMGT".index(unit) * 1024)


def detected_device_memory() -> int | None:
    """The first CUDA device's memory, or None without one."""
    import torch

    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
