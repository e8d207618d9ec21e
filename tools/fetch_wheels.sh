#!/usr/bin/env bash
# The wheels the GPU machine needs beside its own packages (its numpy 2.5 breaks numba-cuda 0.30;
# it has no starlette / uvicorn), into .whl/ (ignored by git: .git/info/exclude), for the device
# tool's carry [".whl"] and tools/gpu_session.sh. Run here, in the repository's root.
set -e
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo "/.whl/" >> .git/info/exclude; }
plat=""
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do plat="$plat --platform $p"; done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    $plat -d .whl numpy==2.4.6 numba-cuda==0.30.4 starlette uvicorn

# the test reference at the version this checkout's tests are written against (the GPU machine
# has transformers 5.17, which predates MiniMax-M3's dense layers and MiniCPM5-MoE), with what it
# needs newer than that machine's: installed apart (/tmp/site_tf) by tools/gpu_session.sh's
# groups that ask for it
mkdir -p .whl/tf
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    $plat -d .whl/tf transformers==5.25.0 huggingface-hub==2.4.0 tokenizers==0.23.3 safetensors==0.8.0 \
    kernels==0.19.1 typer==0.29.2 regex==2026.12.2
ls -la .whl .whl/tf
