"""llama.cpp itself, through its Python binding (`llama-cpp-python`, the `export` extra): its quantizer,
and a loaded GGUF that tokenizes, evaluates and says which tokens end a generation.

What runs here runs in the export's child process (`child.py`): it imports llama_cpp and numpy, never
torch or transformers, so that process starts in a fraction of a second. Nothing here reimplements
llama.cpp: every figure `verify.py` checks comes out of its library.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np

from liger_cli.errors import RunFailed, UserError

QUANT_TYPES = {  # --quant -> llama.cpp's LLAMA_FTYPE_MOSTLY_* name
    "q8_0": "Q8_0", "q6_k": "Q6_K", "q5_k_m": "Q5_K_M", "q5_k_s": "Q5_K_S", "q5_0": "Q5_0",
    "q4_k_m": "Q4_K_M", "q4_k_s": "Q4_K_S", "q4_0": "Q4_0", "q3_k_m": "Q3_K_M", "q2_k": "Q2_K",
}  # fmt: skip
F32 = 0  # GGML_TYPE_F32
MEDIA = "<media>"
"""Where an image goes in a prompt given to `Loaded.image` (llama.cpp's own marker replaces it)."""


def binding():
    """The llama_cpp module, or a UserError saying how to install it."""
    try:
        import llama_cpp
    except ImportError:
        raise UserError(
            "liger export needs llama.cpp's Python binding: pip install 'liger-cli[export]' "
            "(bash scripts/setup.sh installs it)"
        ) from None
    import logging

    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # llama.cpp's own log: errors only
    return llama_cpp


def multimodal_binding():
    """llama.cpp's multimodal library (mtmd) through the binding, or a UserError: a llama-cpp-python built
    without it (LLAVA_BUILD=OFF) cannot load a projector file."""
    binding()
    try:
        from llama_cpp import mtmd_cpp
    except (ImportError, OSError, FileNotFoundError) as err:
        raise UserError(
            f"this llama-cpp-python has no multimodal library (mtmd: {err}), which a vision-language export "
            "is checked with: reinstall it built with it (bash scripts/setup.sh does)"
        ) from None
    mtmd_cpp.mtmd_log_set(errors_only(), ctypes.c_void_p(0))  # its progress lines are not the user's
    mtmd_cpp.mtmd_helper_log_set(errors_only(), ctypes.c_void_p(0))
    return mtmd_cpp


_ERRORS_ONLY = []


def errors_only():
    """A llama.cpp log callback that passes its errors to stderr and drops the rest (kept alive here:
    llama.cpp holds only the pointer)."""
    if not _ERRORS_ONLY:
        import sys

        import llama_cpp

        erring = [False]

        @llama_cpp.llama_log_callback
        def callback(level, text, user_data):
            if level != 5:  # GGML_LOG_LEVEL_CONT goes on the line before
                erring[0] = level == 4  # GGML_LOG_LEVEL_ERROR (3 is a warning)
            if erring[0]:
                sys.stderr.write(text.decode("utf-8", errors="replace"))

        _ERRORS_ONLY.append(callback)
    return _ERRORS_ONLY[0]


def threads() -> int:
    return max(1, min(8, len(os.sched_getaffinity(0))))


def quantize(source: str, target: str, quant: str) -> None:
    """llama.cpp's own quantizer (`llama_model_quantize`): `source` (f32/f16/bf16) to `target`."""
    llama_cpp = binding()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{QUANT_TYPES[quant]}")
    params.nthread = threads()
    if llama_cpp.llama_model_quantize(source.encode(), target.encode(), ctypes.byref(params)) != 0:
        raise RunFailed(f"llama.cpp's quantizer failed to write {quant} from {Path(source).name}")


class Loaded:
    """One GGUF loaded in llama.cpp, every position's logits kept (`logits_all`). The KV cache is kept in
    f32 (llama.cpp's default is f16): the check is of the file, not of a runtime's cache precision."""

    def __init__(self, path: str, context: int):
        llama_cpp = binding()
        from llama_cpp import Llama

        self.llama_cpp = llama_cpp
        try:
            self.model = Llama(
                model_path=path, n_ctx=context, n_batch=context, n_ubatch=context, n_threads=threads(),
                n_threads_batch=threads(), logits_all=True, verbose=False, seed=0, type_k=F32, type_v=F32,
                swa_full=False,  # a windowed model's cache holds its window (the full one says so on stderr)
            )  # fmt: skip
        except ValueError as err:
            raise RunFailed(f"llama.cpp cannot load the written {Path(path).name}: {err}") from None
        self.metadata = dict(self.model.metadata)

    def tokenize(self, text: str, add_bos: bool) -> list[int]:
        """llama.cpp's ids for `text`, special tokens parsed (as a chat runtime feeds a rendered prompt)."""
        return list(self.model.tokenize(text.encode("utf-8"), add_bos=add_bos, special=True))

    def logits(self, ids: list[int]) -> np.ndarray:
        """llama.cpp's logits at every position of `ids` (float32, positions x vocab), evaluated from scratch."""
        self.model.reset()
        self.model.eval(ids)
        return np.array(self.model.scores[: len(ids)], dtype=np.float32)

    def end_of_generation(self) -> set[int]:
        """Every id llama.cpp ends a generation on (its EOG set: eos, eot, eom and what it infers)."""
        vocab = self.llama_cpp.llama_model_get_vocab(self.model.model)
        return {t for t in range(self.model.n_vocab()) if self.llama_cpp.llama_vocab_is_eog(vocab, t)}

    def piece(self, token: int) -> str:
        return self.model.detokenize([token], special=True).decode("utf-8", errors="replace")

    def close(self) -> None:
        self.model.close()

    def generate_greedy(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        """llama.cpp generating token by token (its KV cache filled as it goes): the argmax of its logits,
        stopping on its EOG set."""
        eog = self.end_of_generation()
        self.model.reset()
        self.model.eval(prompt)
        out: list[int] = []
        for _ in range(max_new_tokens):
            token = int(np.argmax(self.model.scores[self.model.n_tokens - 1]))
            out.append(token)
            if token in eog:
                break
            self.model.eval([token])
        return out

    def image(self, projector: str, text: str, rgb: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
        """The image's embeddings (tokens x `size`, float32: what llama.cpp's tower and projector make of
        it, tile by tile in prompt order where it cuts the picture) and llama.cpp's next-token logits
        (float32) after `text`, whose MEDIA marker stands for the image `rgb` (height x width x 3, uint8):
        llama.cpp's multimodal library (mtmd) with the projector file, its own preprocessing, tower,
        projector and positions. The evaluation encodes the image again (mtmd's helper takes no
        embeddings): twice the tower on one probe picture."""
        mtmd_cpp = multimodal_binding()
        llama_cpp = self.llama_cpp
        params = mtmd_cpp.mtmd_context_params_default()
        params.use_gpu, params.print_timings, params.n_threads, params.warmup = False, False, threads(), False
        context = mtmd_cpp.mtmd_init_from_file(projector.encode(), self.model.model, params)
        if not context:
            raise RunFailed(f"llama.cpp cannot load the written {Path(projector).name}")
        height, width, _ = rgb.shape
        data = np.ascontiguousarray(rgb, dtype=np.uint8)
        bitmap = mtmd_cpp.mtmd_bitmap_init(width, height, data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)))
        chunks = mtmd_cpp.mtmd_input_chunks_init()
        try:
            marked = text.replace(MEDIA, mtmd_cpp.mtmd_default_marker().decode())
            inputs = mtmd_cpp.mtmd_input_text(
                marked.encode("utf-8"), len(marked.encode("utf-8")), False, True
            )
            bitmaps = (mtmd_cpp.mtmd_bitmap_p_ctypes * 1)(bitmap)
            if mtmd_cpp.mtmd_tokenize(context, chunks, ctypes.byref(inputs), bitmaps, 1) != 0:
                raise RunFailed("llama.cpp's multimodal library could not tokenize the image prompt")
            images = [
                mtmd_cpp.mtmd_input_chunks_get(chunks, i) for i in range(mtmd_cpp.mtmd_input_chunks_size(chunks))
                if mtmd_cpp.mtmd_input_chunk_get_type(mtmd_cpp.mtmd_input_chunks_get(chunks, i))
                == mtmd_cpp.MTMD_INPUT_CHUNK_TYPE_IMAGE
            ]  # fmt: skip
            parts = []  # one chunk per image, or per tile and the global view (Idefics 3), in prompt order
            for image in images:
                if mtmd_cpp.mtmd_encode_chunk(context, image) != 0:
                    raise RunFailed("llama.cpp's multimodal library could not encode the probe image")
                tokens = mtmd_cpp.mtmd_input_chunk_get_n_tokens(image)
                embedded = np.ctypeslib.as_array(
                    mtmd_cpp.mtmd_get_output_embd(context), shape=(tokens * size,)
                )
                parts.append(embedded.copy().reshape(tokens, size))
            embeddings = np.concatenate(parts)
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.model.ctx), True)
            past = llama_cpp.llama_pos(0)
            if mtmd_cpp.mtmd_helper_eval_chunks(
                context, self.model.ctx, chunks, 0, 0, 512, True, ctypes.byref(past)
            ):
                raise RunFailed("llama.cpp's multimodal library could not evaluate the image prompt")
            logits = np.ctypeslib.as_array(
                llama_cpp.llama_get_logits_ith(self.model.ctx, -1), shape=(self.model.n_vocab(),)
            )
            return embeddings, logits.copy()
        finally:
            mtmd_cpp.mtmd_input_chunks_free(chunks)
            mtmd_cpp.mtmd_bitmap_free(bitmap)
            mtmd_cpp.mtmd_free(context)
