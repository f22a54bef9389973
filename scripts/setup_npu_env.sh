#!/usr/bin/env bash
# Prepare an Ascend (CANN) node to run every npu-marked test (idempotent):
#
#   bash scripts/setup_npu_env.sh && python -m pytest -m npu
#
# Steps, each stopping the script with what to do when it fails:
#   1. CANN is sourced: ASCEND_HOME_PATH (or ASCEND_TOOLKIT_HOME) names an installed toolkit.
#   2. This project with its [npu,test] extras is installed into the current Python
#      (${PYTHON:-python}); a stamp in that environment skips the step when nothing changed.
#   3. The AscendC extension sglang_ascend_offload._C_ascend is built and installed
#      (ascendc_ops/build.sh --install); a stamp of its sources skips an up-to-date build.
#   4. The extension imports and registers every fused op; the pre-flight report
#      (python -m sglang_ascend_offload env --npu-check) is printed.
# Step 1 comes first and installs nothing, so on a machine without CANN the script only
# says what is missing and exits 2. Never run this on the CPU development machine's .venv:
# torch_npu breaks `import torch` without CANN (docs/cpu_environment.md).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

say() { echo "[setup-npu] $*"; }
die() {
    local code="$1"; shift
    echo "[setup-npu] FAILED: $*" >&2
    exit "$code"
}

# ------------------------------------------------------------------ 1. CANN sourced
cann="${ASCEND_HOME_PATH:-${ASCEND_TOOLKIT_HOME:-}}"
if [[ -z "$cann" ]]; then
    found=""
    for candidate in /usr/local/Ascend/cann/set_env.sh /usr/local/Ascend/ascend-toolkit/set_env.sh \
                     "$HOME/Ascend/cann/set_env.sh" "$HOME/Ascend/ascend-toolkit/set_env.sh"; do
        [[ -f "$candidate" ]] && { found="$candidate"; break; }
    done
    if [[ -n "$found" ]]; then
        die 2 "CANN is installed but not sourced (ASCEND_HOME_PATH is not set). Run: source $found  then re-run: bash scripts/setup_npu_env.sh"
    fi
    die 2 "CANN not found: ASCEND_HOME_PATH / ASCEND_TOOLKIT_HOME are not set and no set_env.sh exists under /usr/local/Ascend or ~/Ascend. This script prepares an Ascend NPU node: install the Ascend driver, the CANN 8.5 toolkit and the operator package of the node's SoC (A2/A3), then 'source <install>/set_env.sh' and re-run it. On a machine without an NPU use: bash scripts/setup_cpu_env.sh"
fi
[[ -d "$cann" ]] || die 2 "ASCEND_HOME_PATH=$cann does not exist: source the set_env.sh of an installed CANN toolkit"
say "CANN at $cann"

py="${PYTHON:-$(command -v python || command -v python3 || true)}"
[[ -n "$py" ]] || die 3 "no python on PATH: activate the serving environment (or set PYTHON)"
prefix="$("$py" -c 'import sys; print(sys.prefix)')"
say "python $py (environment $prefix)"

# ---------------------------------------------------------- 2. project + [npu,test]
stamp_dir="$prefix/.sglang_ascend_offload"
mkdir -p "$stamp_dir" 2>/dev/null || stamp_dir="$root/ascendc_ops/build/stamps"  # (git-ignored)
mkdir -p "$stamp_dir"
want_pkg="$( (cat scripts/setup_npu_env.sh pyproject.toml; echo "$py") | sha256sum | cut -d' ' -f1)"
if [[ -f "$stamp_dir/npu_env" && "$(cat "$stamp_dir/npu_env")" == "$want_pkg" ]]; then
    say "project and [npu,test] extras are up to date"
else
    say "installing this project with [npu,test] (editable)"
    "$py" -m pip --disable-pip-version-check -q install -e ".[npu,test]" \
        || die 4 "pip install -e '.[npu,test]' failed (see above): torch-npu must match torch and this CANN release"
    echo "$want_pkg" > "$stamp_dir/npu_env"
fi
"$py" -c "import torch, torch_npu" 2>/dev/null \
    || die 4 "$py cannot import torch_npu with CANN at $cann: check that torch-npu matches torch and CANN, and that set_env.sh was sourced in this shell"
"$py" -c "import importlib.metadata as m; v = m.version('sglang'); assert v == '0.5.23', v" 2>/dev/null \
    || say "warning: SGLang 0.5.23 is not installed in this environment; install SGLang's Ascend build for the sglang tests"

# ------------------------------------------------------------ 3. AscendC extension
want_ext="$(cd ascendc_ops && find CMakeLists.txt build.sh host include kernels -type f | sort | xargs cat | sha256sum | cut -d' ' -f1)"
ext="$(ls sglang_ascend_offload/_C_ascend*.so 2>/dev/null | head -n 1 || true)"
if [[ -n "$ext" && -f "$stamp_dir/ascendc_ops" && "$(cat "$stamp_dir/ascendc_ops")" == "$want_ext" ]]; then
    say "AscendC extension is up to date ($ext)"
else
    say "building the AscendC extension (ascendc_ops/build.sh --install)"
    bash ascendc_ops/build.sh --install --python "$py" \
        || die 5 "the AscendC build failed (see above; ascendc_ops/README.md); the fused npu tests cannot run without it"
    echo "$want_ext" > "$stamp_dir/ascendc_ops"
fi

# --------------------------------------------------------------------- 4. verify
"$py" - <<'PY' || die 6 "the AscendC extension does not import or lacks ops (see above): rebuild with bash ascendc_ops/build.sh --clean --install"
import importlib
import torch, torch_npu  # noqa: F401 - the extension links against torch_npu
from sglang_ascend_offload.ops.npu_impls import FUSED_EXTENSION_MODULE, FUSED_KERNELS, FUSED_OP_NAMESPACE
importlib.import_module(FUSED_EXTENSION_MODULE)
ns = getattr(torch.ops, FUSED_OP_NAMESPACE)
missing = [k for k in FUSED_KERNELS if not hasattr(ns, k)]
print("[setup-npu] _C_ascend ops:", ", ".join(k for k in FUSED_KERNELS if k not in missing) or "none")
raise SystemExit(f"missing ops: {missing}" if missing else 0)
PY
say "pre-flight (python -m sglang_ascend_offload env --npu-check):"
"$py" -m sglang_ascend_offload env --npu-check \
    || say "warning: some capabilities fail (above); the npu tests that need them will fail"
say "done: python -m pytest -m npu"
