"""The README's "Try it on CPU" blocks, executed exactly as written.

Each block marked ``<!-- try-it: NAME -->`` is run by ``bash`` from the repository
root with only ``PORT`` set (a reserved port, so parallel blocks and other tests
never collide). A block must start its server, answer the request with the asked
number of tokens, log what the feature planned, and stop its server again.
"""

from __future__ import annotations

import json
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import REPO, free_port, server_env

pytestmark = pytest.mark.slow

BLOCK = re.compile(r"<!-- try-it: (?P<name>[\w-]+) -->\s*```bash\n(?P<code>.*?)```", re.S)
# What each block's server log must show: the feature really planned something.
PLANNED = {"sparse-decode": "sparse decode offload: host pool", "layerwise-prefill": "layerwise prefill offload:"}


def readme_blocks() -> dict:
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Try it on CPU") :]
    section = section[: section.index("\n## ", 5)]
    return {m["name"]: m["code"] for m in BLOCK.finditer(section)}


def test_every_block_is_checked():
    assert set(readme_blocks()) == set(PLANNED)


def _run(code: str) -> subprocess.CompletedProcess:
    env = {
        k: v for k, v in server_env().items() if k not in ("SGLANG_USE_CPU_ENGINE", "OMP_NUM_THREADS")
    }  # the block sets them itself
    env["PORT"] = str(free_port())
    return subprocess.run(["bash", "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=480)


def test_try_it_blocks_run_as_written():
    blocks = readme_blocks()
    with ThreadPoolExecutor(len(blocks)) as pool:
        results = dict(zip(blocks, pool.map(_run, blocks.values())))
    for name, result in results.items():
        out = result.stdout + result.stderr
        assert result.returncode == 0, f"{name}: exit {result.returncode}\n{out[-3000:]}"
        answer = next((json.loads(line) for line in result.stdout.splitlines() if '"output_ids"' in line), None)
        assert answer is not None, f"{name}: no /generate answer\n{out[-3000:]}"
        assert len(answer["output_ids"]) == 16, name
        assert PLANNED[name] in out, f"{name}: the log does not show the feature's plan\n{out[-3000:]}"
