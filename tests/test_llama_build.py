"""llama.cpp as scripts/setup.sh builds it: without its AMX kernels, which crash on virtualized Intel
Xeons (llama.cpp issue 20824), unless LIGER_LLAMA_AMX=1 asks for them (docs/export.md).

The machines this project runs on may have no AMX (an AMD EPYC), where no build has it and the crash
cannot happen, so each check is one that means something on both kinds:
- the switches (scripts/llama-cmake-args.sh): GCC puts the switches `-march=native` stands for before the
  command line's own (read off its cc1 command line, here), so ours win; given after a Sapphire Rapids'
  native switches they compile no AMX, which the same compile without them does (__AMX_INT8__ and
  __AVX512VNNI__: what ggml compiles its AMX matmul under). This fails here too if the switches go;
- the installed library: compiled with those switches (GCC records them in it: fails here with an older
  setup's build too), and on an AMX machine, the checks that bite there: its system info reports no
  AMX_INT8 and its code holds no AMX instruction (both hold here with or without the fix).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SAPPHIRE_RAPIDS = ["-march=sapphirerapids", "-mamx-tile", "-mamx-int8", "-mamx-bf16"]
"""What GCC's -march=native stands for on a Sapphire Rapids, as far as AMX goes."""
AMX_INSTRUCTION = re.compile(r"^\s*[0-9a-f]+:\s+(ldtilecfg|sttilecfg|tile\w+|tdp\w+|tcmm\w+)\b", re.MULTILINE)


def setup_flags(amx: bool = False) -> dict[str, list[str]]:
    """The compiler flags scripts/setup.sh builds llama.cpp with, per language (C, CXX)."""
    env = {k: v for k, v in os.environ.items() if k != "LIGER_LLAMA_AMX"}
    env.update({"LIGER_LLAMA_AMX": "1"} if amx else {})
    args = subprocess.run(["bash", REPO / "scripts" / "llama-cmake-args.sh"], env=env, capture_output=True,
                          text=True, check=True).stdout  # fmt: skip
    found = [re.match(r"-DCMAKE_(C|CXX)_FLAGS=(.*)", arg) for arg in shlex.split(args)]
    return {m[1]: m[2].split() for m in found if m}


def last_word(words: list[str], flag: str) -> str | None:
    """The last of `-mno-X` (`flag`) and `-mX` in `words`: GCC's last word on feature X."""
    said = [w for w in words if w in (flag, flag.replace("-mno-", "-m"))]
    return said[-1] if said else None


COMPILERS = {"C": (os.environ.get("CC", "cc"), "c"), "CXX": (os.environ.get("CXX", "c++"), "c++")}


def defined(lang: str, flags: list[str]) -> set[str]:
    """The AMX and AVX512-VNNI macros the compiler defines with `flags`."""
    compiler, source = COMPILERS[lang]
    out = subprocess.run([compiler, *flags, "-dM", "-E", "-x", source, os.devnull], capture_output=True, text=True,
                         check=True).stdout  # fmt: skip
    return set(re.findall(r"#define (__AMX_\w+__|__AVX512VNNI__) ", out))


@pytest.mark.parametrize("lang", COMPILERS)
def test_setups_switches_keep_amx_out_where_native_brings_it(lang: str) -> None:
    flags = setup_flags()[lang]
    ours = [f for f in flags if f.startswith("-mno-amx-")]
    assert {"-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"} <= set(ours), flags
    assert not [f for f in setup_flags(amx=True)[lang] if "amx" in f]  # LIGER_LLAMA_AMX=1 keeps AMX

    # ggml compiles with CMAKE_<LANG>_FLAGS first, then -march=native: the driver puts what native stands
    # for (from -march=<cpu> to -mtune=<cpu>) before the command line's own switches, so ours come last.
    compiler, source = COMPILERS[lang]
    verbose = subprocess.run([compiler, "-v", *flags, "-O3", "-march=native", "-E", "-x", source, os.devnull,
                              "-o", os.devnull], capture_output=True, text=True, check=True).stderr  # fmt: skip
    cc1 = next(line.split() for line in verbose.splitlines() if re.search(r"/cc1(plus)?\s", line))
    native_end = next(i for i, arg in enumerate(cc1) if arg.startswith("-mtune="))
    assert next(arg for arg in cc1 if arg.startswith("-march=")) != "-march=native"  # expanded by the driver
    for flag in ours:  # the last word on each AMX feature is ours, after native's
        assert last_word(cc1[native_end:], flag) == flag and last_word(cc1, flag) == flag, flag

    # A Sapphire Rapids' native switches compile ggml's AMX code in; with ours after them, nothing of it.
    assert {"__AMX_INT8__", "__AVX512VNNI__"} <= defined(lang, SAPPHIRE_RAPIDS)
    assert defined(lang, [*SAPPHIRE_RAPIDS, *flags]) == {"__AVX512VNNI__"}


def test_the_installed_llama_cpp_is_setups_build_without_amx() -> None:
    """libggml-cpu (llama.cpp's CPU backend, where its AMX kernels live) as installed: built with setup's
    switches, no AMX_INT8 in llama.cpp's own system info, no AMX instruction in its code."""
    import llama_cpp

    amx = os.environ.get("LIGER_LLAMA_AMX") == "1"
    library = Path(llama_cpp.__file__).parent / "lib" / "libggml-cpu.so"
    recorded = subprocess.run(["readelf", "-p", ".GCC.command.line", library], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip
    compiles = [line.split() for line in recorded.splitlines() if "GNU C" in line]  # one per kind of compile
    assert compiles, f"{library.name} records no compile switches: rebuild it with bash scripts/setup.sh"
    ours = [f for f in setup_flags(amx)["CXX"] if f.startswith("-mno-amx-")]
    for words in compiles:  # each of its compiles (C and C++): setup's is the last word on each AMX feature
        assert all(last_word(words, flag) == flag for flag in ours), " ".join(words)
    if amx:  # asked for: whatever this CPU has
        return
    assert b"AMX_INT8 = 1" not in llama_cpp.llama_print_system_info()
    code = subprocess.run(["objdump", "-d", "--no-show-raw-insn", library], capture_output=True, text=True,
                          check=True).stdout  # fmt: skip
    assert not AMX_INSTRUCTION.findall(code)


def test_the_amx_instruction_check_sees_amx(tmp_path: Path) -> None:
    """The objdump check above is not blind: AMX intrinsics compiled here are found by it."""
    source = tmp_path / "amx.c"
    source.write_text(
        "#include <immintrin.h>\n"
        "void f(const void *a, const void *b, void *c) {\n"
        "  _tile_loadd(1, a, 64); _tile_loadd(2, b, 64); _tile_dpbssd(0, 1, 2); _tile_stored(0, c, 64);\n"
        "}\n"
    )
    subprocess.run([COMPILERS["C"][0], "-O2", "-mamx-tile", "-mamx-int8", "-c", source, "-o", tmp_path / "amx.o"],
                   check=True)  # fmt: skip
    code = subprocess.run(["objdump", "-d", "--no-show-raw-insn", tmp_path / "amx.o"], capture_output=True,
                          text=True, check=True).stdout  # fmt: skip
    assert set(AMX_INSTRUCTION.findall(code)) == {"tileloadd", "tdpbssd", "tilestored"}
