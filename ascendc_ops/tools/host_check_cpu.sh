#!/usr/bin/env bash
# Compile the HOST half of the fused operators (host/torch_ops.cpp, host/tiling.cpp) on a
# machine without CANN, against CPU torch and the stand-in headers in tools/cpu_stubs/
# (kernel launches do nothing), into OUT_DIR/_C_ascend.so. Loading that module runs the
# TORCH_LIBRARY registrations, so torch checks every m.impl signature against its schema;
# with -DSAO_HOST_CHECK_ON_CPU the ops also dispatch on CPU tensors, which exercises the
# argument checks, tiling and output allocation. It says nothing about the kernels.
#
#   bash ascendc_ops/tools/host_check_cpu.sh OUT_DIR [PYTHON]
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:?usage: host_check_cpu.sh OUT_DIR [PYTHON]}"
python="${2:-python3}"
mkdir -p "$out"
torch_dir="$("$python" -c 'import os, torch; print(os.path.dirname(torch.__file__))')"
abi="$("$python" -c 'import torch; print(int(torch.compiled_with_cxx11_abi()))')"
py_inc="$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
"${CXX:-g++}" -std=c++20 -O0 -shared -fPIC -DSAO_HOST_CHECK_ON_CPU -D_GLIBCXX_USE_CXX11_ABI="$abi" \
    -I "$here/tools/cpu_stubs" -I "$here/include" -I "$here/host" \
    -isystem "$torch_dir/include" -isystem "$torch_dir/include/torch/csrc/api/include" -isystem "$py_inc" \
    "$here/host/torch_ops.cpp" "$here/host/tiling.cpp" \
    -L "$torch_dir/lib" -Wl,-rpath,"$torch_dir/lib" -ltorch -ltorch_cpu -lc10 -ltorch_python \
    -Wall -Wextra -Werror=return-type -o "$out/_C_ascend.so"
echo "$out/_C_ascend.so"
