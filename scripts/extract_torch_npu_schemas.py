#!/usr/bin/env python3
"""Write sglang_ascend_offload/npu_api/torch_npu_ops.json from the torch_npu wheel.

Downloads the torch_npu version that pyproject.toml's ``[npu]`` extra pins with
``pip download --no-deps`` (never installs it), opens the wheel as a zip and keeps the
dispatcher schemas of the ops the project and its npu-marked tests call (found in
the source by ``sglang_ascend_offload.npu_api.callsites``). See ``npu_api/torch_npu_schemas.py`` for
why those schema strings are the authority.

    python scripts/extract_torch_npu_schemas.py               # download, extract, write
    python scripts/extract_torch_npu_schemas.py --wheel W.whl  # use a wheel already here
    python scripts/extract_torch_npu_schemas.py --check        # exit 1 if the file is stale
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from sglang_ascend_offload.npu_api import callsites, torch_npu_schemas  # noqa: E402


def pinned_version() -> str:
    """``X`` of ``torch-npu==X`` in pyproject.toml's ``[npu]`` extra."""
    import tomllib  # noqa: PLC0415 - Python 3.11+

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]["npu"]
    for req in extras:
        m = re.match(r"\s*torch[-_]npu\s*==\s*([^\s;,]+)", req)
        if m:
            return m.group(1)
    raise SystemExit("pyproject.toml's [npu] extra pins no torch-npu==X")


def download(version: str, dest: str) -> str:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary",
        ":all:",
        "--python-version",
        f"{sys.version_info.major}{sys.version_info.minor}",
        f"torch-npu=={version}",
        "-d",
        dest,
    ]
    subprocess.run(cmd, check=True)
    wheels = glob.glob(os.path.join(dest, f"torch_npu-{version}-*.whl"))
    if not wheels:
        raise SystemExit(f"pip download left no torch_npu-{version} wheel in {dest}")
    return wheels[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wheel", help="a downloaded torch_npu wheel (skips the download)")
    ap.add_argument("--out", default=torch_npu_schemas.DATA_FILE)
    ap.add_argument("--check", action="store_true", help="compare with --out instead of writing it")
    args = ap.parse_args(argv)
    version = pinned_version()
    uses = callsites.scan().uses + callsites.scan([os.path.join(REPO, "tests")]).uses
    ops = torch_npu_schemas.project_ops(uses)
    with tempfile.TemporaryDirectory(prefix="torch-npu-wheel-") as tmp:
        wheel = args.wheel or download(version, tmp)
        data = torch_npu_schemas.extract_from_wheel(wheel, ops)
    if data["torch_npu_version"] and data["torch_npu_version"].split("+")[0] != version:
        raise SystemExit(f"the wheel is torch_npu {data['torch_npu_version']}, pyproject pins {version}")
    text = json.dumps(data, indent=1, sort_keys=True) + "\n"
    if args.check:
        with open(args.out, encoding="utf-8") as f:
            stale = f.read() != text
        print(f"{args.out}: {'stale' if stale else 'up to date'} ({len(ops)} ops)")
        return 1 if stale else 0
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(text)
    print(
        f"wrote {args.out}: {len(data['ops'])} op(s) from {data['wheel']}; missing {data['missing']}; "
        f"lib/yaml disagreements {sorted(data['lib_yaml_disagreements'])}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
