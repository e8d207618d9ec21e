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
ls -la .whl
