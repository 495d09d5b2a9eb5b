"""llama.cpp for `liger export`: its quantizer, and a loaded GGUF that tokenizes, evaluates and says which
tokens end a generation, run in a child process (`child.py`) that holds llama.cpp's objects (`library.py`).

A crash in llama.cpp ends that process, not liger: the call raises RunFailed naming the signal and the
check it was in, and the export's temporary folder goes as after any failed check. Here, the parent's
side: what `verify.py` and `verify_image.py` call, llama.cpp's numbers turned into torch tensors.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from liger_cli.export.child import deadline, shared
from liger_cli.export.library import MEDIA, QUANT_TYPES, binding, multimodal_binding, threads

__all__ = ["MEDIA", "QUANT_TYPES", "Runtime", "binding", "multimodal_binding", "quantize", "threads"]


def quantize(source: Path, target: Path, quant: str) -> None:
    """llama.cpp's own quantizer (`llama_model_quantize`): `source` (f32/f16/bf16) to `target`."""
    shared().call(f"quantizing {source.name} to {quant}", deadline(source), "quantize", str(source), str(target),
                  quant)  # fmt: skip


def log_softmax(logits: np.ndarray) -> torch.Tensor:
    return torch.log_softmax(torch.from_numpy(logits.astype(np.float64)), dim=-1)


class Runtime:
    """One GGUF loaded in llama.cpp (in the child process), every position's logits kept, its KV cache in
    f32 (`library.Loaded`)."""

    def __init__(self, path: Path, context: int):
        self.path, self.child = path, shared()
        what = f"loading {path.name}"
        self.handle, self.metadata = self.child.call(what, deadline(path), "open", str(path), context)

    def call(self, what: str, method: str, *args, files: tuple[Path, ...] = ()):
        return self.child.call(
            f"{what} {self.path.name}", deadline(self.path, *files), method, self.handle, *args
        )

    def tokenize(self, text: str, add_bos: bool) -> list[int]:
        """llama.cpp's ids for `text`, special tokens parsed (as a chat runtime feeds a rendered prompt)."""
        return self.call("checking the tokens of", "tokenize", text, add_bos)

    def log_probs(self, ids: list[int]) -> torch.Tensor:
        """log softmax of llama.cpp's logits at every position of `ids` (float64), evaluated from scratch."""
        return log_softmax(self.call("checking next tokens of", "logits", list(ids)))

    def end_of_generation(self) -> set[int]:
        """Every id llama.cpp ends a generation on (its EOG set: eos, eot, eom and what it infers)."""
        return self.call("checking the stops of", "end_of_generation")

    def piece(self, token: int) -> str:
        return self.call("reading a token of", "piece", token)

    def close(self) -> None:
        if self.child.alive():  # not after a crash: that error stands
            self.call("closing", "close")

    def generate_greedy(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        """llama.cpp generating token by token (its KV cache filled as it goes): the argmax of its logits,
        stopping on its EOG set."""
        return self.call("generating with", "generate_greedy", list(prompt), max_new_tokens)

    def image_log_probs(
        self, projector: Path, text: str, rgb: np.ndarray, size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The probe image's embeddings (tokens x `size`) and the log softmax of llama.cpp's next-token logits
        after `text`, whose MEDIA marker stands for the image `rgb` (`library.Loaded.image`: mtmd with the
        projector file, its own preprocessing)."""
        embeddings, logits = self.call(f"checking the probe image with {projector.name} and", "image",
                                       str(projector), text, rgb, size, files=(projector,))  # fmt: skip
        return torch.from_numpy(embeddings), log_softmax(logits)
