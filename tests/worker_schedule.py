"""How the suite is split over two pytest-xdist workers (``-n auto --dist loadscope``).

The suite's time is mostly SGLang test servers, and one served test keeps about one
of the machine's two cores busy; the unit tests use a little less than one. Two
workers therefore finish the suite in about the time of its served half.

Rules (the controller's scheduler, :func:`make_scheduler`, and each worker's collection
order, :func:`order_for_workers`):

* **A module is one unit of work.** Every test of a module runs on the same worker, so
  a module-scoped fixture (a server, a built extension) is set up once.
* **Modules that share a server run on one worker.** Modules naming the same server in
  a module-level ``SHARED_SERVERS`` tuple (``tests/sglang/conftest.py``) form one unit,
  so the server is launched once and stopped after its last user, as without workers.
  The controller imports no test module, so the tuples are read from the sources.
* **Longest first.** Units are handed out in the order of :data:`UNIT_SECONDS` (the
  served modules' seconds in a quiet serial run; only the order matters), then the
  remaining modules with slow tests, then the rest. Long units first and short ones as
  filler keeps both workers busy to the end. A module missing from the table is only
  scheduled later, never wrong.

With ``-n 0`` (or ``-p no:xdist``) nothing here applies and the suite runs serially in
its usual order.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List

import pytest

TESTS = Path(__file__).resolve().parent

# Seconds per module (setup + calls) from a quiet serial ``--durations`` run.
UNIT_SECONDS: Dict[str, float] = {
    "tests/sglang/test_pd_e2e_cpu.py": 200,
    "tests/sglang/test_bench_serve.py": 156,
    "tests/sglang/test_graph_speculative_e2e_cpu.py": 154,
    "tests/sglang/test_shared_host_pool_e2e_cpu.py": 146,
    "tests/sglang/test_offload_graphs_e2e.py": 126,
    "tests/sglang/test_pd_decode_tp_e2e_cpu.py": 122,
    "tests/sglang/test_bench_capacity.py": 107,
    "tests/sglang/test_trained_text_e2e_cpu.py": 100,
    "tests/sglang/test_fused_e2e_cpu.py": 98,
    "tests/sglang/test_layerwise_e2e_cpu.py": 75,
    "tests/sglang/test_dp_attention_e2e_cpu.py": 72,
    "tests/sglang/test_bench_soak.py": 72,
    "tests/sglang/test_kvpp_e2e_cpu.py": 71,
    "tests/sglang/test_speculative_offload_e2e_cpu.py": 63,
    "tests/sglang/test_e2e_dsa_adaptive_cpu.py": 51,
    "tests/sglang/test_pd_speculative_e2e_cpu.py": 49,
    "tests/test_train_tiny_dsa.py": 47,
    "tests/sglang/test_readme_try_it.py": 46,
    "tests/sglang/test_e2e_dsa_cpu.py": 41,
    "tests/test_npu_api.py": 29,
    "tests/sglang/test_score_policy_serving.py": 28,
    "tests/sglang/test_offload_sizing.py": 25,
    "tests/sglang/test_int8_indexer_e2e_cpu.py": 25,
    "tests/sglang/test_launch_checks.py": 24,
}


def module_path(nodeid: str) -> str:
    """``tests/x/test_y.py`` of a node id (relative to the repository root)."""
    return nodeid.split("::", 1)[0]


def _shared_server_names(source: str) -> List[str]:
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "SHARED_SERVERS" for t in node.targets):
            return [str(name) for name in ast.literal_eval(node.value)]
    return []


def units(tests_root: Path = TESTS) -> Dict[str, str]:
    """Module path -> unit, for the modules that share a server: all modules naming a
    server (transitively) map to the first of them in path order. A module missing here
    is its own unit."""
    repo = tests_root.parent
    parent: Dict[str, str] = {}

    def find(x: str) -> str:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for path in sorted(tests_root.rglob("test_*.py")):
        source = path.read_text()
        if "SHARED_SERVERS" not in source:
            continue
        module = path.relative_to(repo).as_posix()
        for name in _shared_server_names(source):
            a, b = sorted((find(module), find(f"server:{name}")), key=lambda x: (x.startswith("server:"), x))
            parent[b] = a
    return {m: find(m) for m in list(parent) if not m.startswith("server:")}


def unit_of(nodeid: str, shared: Dict[str, str]) -> str:
    module = module_path(nodeid)
    return shared.get(module, module)


def order_for_workers(items: List[pytest.Item], shared: Dict[str, str]) -> None:
    """Sort ``items`` in place into the order units are handed out: by estimated seconds
    (longest first), then units with slow tests, then the rest; the collection order
    inside a unit and among equals."""
    modules_of: Dict[str, set] = {}
    has_slow: Dict[str, bool] = {}
    first_seen: Dict[str, int] = {}
    for index, item in enumerate(items):
        unit = unit_of(item.nodeid, shared)
        modules_of.setdefault(unit, set()).add(module_path(item.nodeid))
        has_slow[unit] = has_slow.get(unit, False) or "slow" in item.keywords
        first_seen.setdefault(unit, index)
    seconds = {unit: sum(UNIT_SECONDS.get(m, 0.0) for m in mods) for unit, mods in modules_of.items()}
    position = {id(item): i for i, item in enumerate(items)}

    def key(item: pytest.Item):
        unit = unit_of(item.nodeid, shared)
        return (-seconds[unit], not has_slow[unit], first_seen[unit], position[id(item)])

    items.sort(key=key)


def make_scheduler(config, log):
    """pytest-xdist's load-by-scope scheduler with a unit (above) as the scope. Under
    ``--no-loadscope-reorder`` it hands units out in the workers' collection order,
    which :func:`order_for_workers` sorted."""
    from xdist.scheduler import LoadScopeScheduling

    shared = units()

    class UnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid, shared)

    return UnitScheduling(config, log)
