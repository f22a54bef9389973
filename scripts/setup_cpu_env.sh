#!/usr/bin/env bash
# Create or refresh the CPU environment in .venv (idempotent).
#
#   bash scripts/setup_cpu_env.sh
#
# A stamp file records a hash of everything that decides the environment; when
# nothing changed a re-run only checks the stamp (about a second).
# Never installs torch_npu or triton-ascend: see docs/cpu_environment.md.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="$root/.venv"
py="${PYTHON:-python3}"
sglang_version="0.5.23"

stamp_inputs=(scripts/setup_cpu_env.sh scripts/requirements-cpu.txt pyproject.toml)
want="$(cat "${stamp_inputs[@]}" | sha256sum | cut -d' ' -f1)"
stamp="$venv/.sglang_ascend_offload_env"

# The CPU residency kernel (sparse decode offload; g++, about a second): its library's
# name carries a hash of its source, so this is a no-op when it is current.
build_cpu_kernel() {
  "$venv/bin/python" -m sglang_ascend_offload.sparse_decode.cpu_kernel --build >/dev/null \
    && echo "[setup] CPU residency kernel is built"
  # the score-aware policies' kernel (score_rank, score_rank_guarded): same compiler, own library
  "$venv/bin/python" -m sglang_ascend_offload.sparse_decode.score_kernel --build >/dev/null \
    && echo "[setup] score-aware CPU residency kernel is built"
  # ops=fused on CPU: the AscendC kernels compiled against their functional model (g++,
  # ~10-30 s when the kernel sources changed; cached by a hash of them otherwise)
  "$venv/bin/python" -m sglang_ascend_offload.ops.ascendc_model --build >/dev/null \
    && echo "[setup] AscendC functional model (ops=fused on CPU) is built"
}

if [[ -x "$venv/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  echo "[setup] .venv is up to date"
  build_cpu_kernel
  exit 0
fi

# Mooncake's TCP transport links against the RDMA user libraries even when it
# does not use RDMA; the README's "Try it on CPU" blocks use curl (Debian packages;
# we run as root on these machines). g++ compiles the host half and the AscendC kernel
# checks (check-kernels, tests/ascendc).
need_apt=()
for pkg in libibverbs1 librdmacm1 curl g++; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg")
done
if (( ${#need_apt[@]} )); then
  echo "[setup] apt-get install ${need_apt[*]}"
  if [[ $(id -u) -eq 0 ]]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
  else
    echo "[setup] warning: not root; install ${need_apt[*]} for the mooncake transfer tests" >&2
  fi
fi

[[ -x "$venv/bin/python" ]] || "$py" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
echo "[setup] installing CPU requirements (first run: a few minutes)"
"${pip[@]}" install -r scripts/requirements-cpu.txt
echo "[setup] installing sglang==$sglang_version without its CUDA dependency pins"
"${pip[@]}" install --no-deps "sglang==$sglang_version"
echo "[setup] installing this project (editable)"
"${pip[@]}" install --no-deps --no-build-isolation -e . 2>/dev/null || "${pip[@]}" install --no-deps -e .

# CPU-only stand-ins for packages that have no CPU build on PyPI (torchvision's
# PyPI wheel is a CUDA build; sgl_kernel's CPU build is not published). They live
# in cpu_env/stubs and are put on this venv's path only, never in the package.
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$root/cpu_env/stubs" > "$site/sglang_ascend_offload_cpu_stubs.pth"

"$venv/bin/python" - <<'PY'
import importlib.metadata as md
import torch, triton
assert torch.__version__.startswith("2.13.0"), torch.__version__
for forbidden in ("torch_npu", "triton-ascend"):
    try:
        md.version(forbidden)
    except md.PackageNotFoundError:
        continue
    raise SystemExit(f"{forbidden} is installed in the CPU venv; remove it (see docs/cpu_environment.md)")
print(f"[setup] torch {torch.__version__}, triton {triton.__version__}, sglang {md.version('sglang')}")
PY
build_cpu_kernel
echo "$want" > "$stamp"
echo "[setup] done"
