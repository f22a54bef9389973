#!/usr/bin/env bash
# Build the AscendC fused operators (LIM, LIM-C8, Copy-SFA) into the extension module
# sglang_ascend_offload._C_ascend.
#
#   bash ascendc_ops/build.sh [--install] [--soc SOC_VERSION] [--python PYTHON] [--jobs N] [--clean]
#
#   --install   copy _C_ascend*.so and libsao_fused_kernels.so into sglang_ascend_offload/
#   --soc       Ascend SoC name (default: $SOC_VERSION, else read from npu-smi)
#   --python    interpreter with torch + torch_npu (default: python3)
#
# Needs an Ascend node with the CANN toolkit (source .../ascend-toolkit/set_env.sh, which sets
# ASCEND_HOME_PATH), cmake >= 3.18, and torch + torch_npu importable by the chosen Python.
# Everything is checked first; a missing piece stops the build with a message saying what to do.
# Afterwards: python -m pytest tests/ops/test_fused_npu.py -m npu
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
install=0
clean=0
soc="${SOC_VERSION:-}"
python="${PYTHON:-python3}"
jobs="$(nproc 2>/dev/null || echo 4)"

die() {
    echo "ascendc_ops/build.sh: $*" >&2
    exit 1
}

while [[ $# -gt 0 ]]; do
    case "$1" in
        --install) install=1 ;;
        --clean) clean=1 ;;
        --soc) soc="${2:?--soc needs a value}"; shift ;;
        --python) python="${2:?--python needs a value}"; shift ;;
        --jobs) jobs="${2:?--jobs needs a value}"; shift ;;
        -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
        *) die "unknown argument: $1 (see --help)" ;;
    esac
    shift
done

# ----------------------------------------------------------------- environment
cann="${ASCEND_HOME_PATH:-${ASCEND_TOOLKIT_HOME:-}}"
if [[ -z "$cann" ]]; then
    die "CANN not found: ASCEND_HOME_PATH is not set. The fused operators build only on an Ascend node with the CANN toolkit; run 'source /usr/local/Ascend/ascend-toolkit/set_env.sh' (or your install's set_env.sh) and retry. Without CANN use ops=reference|triton|npu."
fi
[[ -d "$cann" ]] || die "CANN not found: ASCEND_HOME_PATH=$cann does not exist; source the set_env.sh of an installed CANN toolkit"
found_kernel_cmake=0
for candidate in tools/tikcpp/ascendc_kernel_cmake compiler/tikcpp/ascendc_kernel_cmake ascendc_devkit/tikcpp/samples/cmake; do
    [[ -d "$cann/$candidate" ]] && found_kernel_cmake=1
done
[[ $found_kernel_cmake -eq 1 ]] || die "CANN at $cann has no ascendc_kernel_cmake: install the CANN toolkit (with AscendC), not only the runtime"
command -v cmake >/dev/null || die "cmake not found: install cmake >= 3.18"
"$python" -c "import torch" 2>/dev/null || die "$python cannot import torch: pass --python with the serving environment's interpreter"
"$python" -c "import torch_npu" 2>/dev/null || die "$python cannot import torch_npu: install the [npu] extra (torch-npu matching torch) in that environment"

if [[ -z "$soc" ]]; then
    if command -v npu-smi >/dev/null; then
        # the "Name" column of the first NPU row, e.g. "| 0     910B3     | OK ..." -> Ascend910B3
        name="$(npu-smi info 2>/dev/null | awk '/^\| [0-9]+ +[0-9A-Za-z_]+ / {print $3; exit}')"
        [[ -n "$name" ]] && soc="Ascend$name"
    fi
fi
[[ -n "$soc" ]] || die "cannot tell the SoC: pass --soc (e.g. Ascend910B3, Ascend910_9382) or set SOC_VERSION"

# ---------------------------------------------------------------------- build
build="$here/build"
[[ $clean -eq 1 ]] && rm -rf "$build"
mkdir -p "$build"
echo "ascendc_ops: CANN=$cann SOC=$soc python=$python build=$build"
cmake -S "$here" -B "$build" \
    -DASCEND_HOME_PATH="$cann" \
    -DSOC_VERSION="$soc" \
    -DPython3_EXECUTABLE="$(command -v "$python")" \
    -DSAO_INSTALL_DIR="$here/../sglang_ascend_offload"
cmake --build "$build" -j "$jobs"

if [[ $install -eq 1 ]]; then
    cmake --install "$build"
    "$python" -c "import torch, torch_npu, sglang_ascend_offload._C_ascend; ns = torch.ops.sglang_ascend_offload; \
print('installed:', [n for n in ('npu_fused_lightning_indexer_manage', 'npu_fused_quant_lightning_indexer_manage', \
'npu_fused_scatter_copy_sparse_flash_attention', 'npu_fused_copy_miss_rows', 'npu_fused_register_host_memory') if hasattr(ns, n)])"
else
    echo "built in $build (re-run with --install to put _C_ascend into sglang_ascend_offload/)"
fi
