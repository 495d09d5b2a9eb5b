#!/usr/bin/env bash
# Print the CMAKE_ARGS scripts/setup.sh builds llama-cpp-python (llama.cpp) with, on one line.
#
# Only its libraries (llama, and mtmd for images). ggml compiles its CPU backend with -march=native, which
# on an Intel Xeon with AMX (Sapphire Rapids and later) compiles in its AMX matmul kernels; they crash
# virtualized ones (AWS m7i, GCP C4: llama.cpp issue 20824, Ollama issues 17205 and 17249), so every
# -mno-amx-* switch the compiler knows is added. GCC puts -march=native's own -m switches before the
# command line's, so these win wherever they are (tests/test_llama_build.py checks it). LIGER_LLAMA_AMX=1
# keeps AMX (a bare-metal Xeon). -frecord-gcc-switches keeps the switches in the libraries, where the
# tests read them.
set -euo pipefail

args="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF"
for lang in C CXX; do
  if [ "$lang" = C ]; then compiler=${CC:-cc} source=c user=${CFLAGS:-}; else compiler=${CXX:-c++} source=c++ user=${CXXFLAGS:-}; fi
  flags="$user -frecord-gcc-switches"
  if [ "${LIGER_LLAMA_AMX:-0}" != 1 ]; then
    for feature in amx-tile amx-int8 amx-bf16 amx-fp16 amx-complex amx-avx512 amx-tf32 amx-fp8 amx-movrs amx-transpose; do
      if echo 'int x;' | "$compiler" "-mno-$feature" -x "$source" -c -o /dev/null - 2>/dev/null; then
        flags="$flags -mno-$feature"
      fi
    done
  fi
  args="$args '-DCMAKE_${lang}_FLAGS=${flags# }'"
done
echo "$args"
