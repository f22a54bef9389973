"""Which collected tests a stand-in process runs, and why the others skip.

A stand-in process (``SAO_NPU_STANDIN=1``) runs npu-marked tests only: every other test
is a CPU test, which must see ``platform.device_kind() == "cpu"`` and runs in the
ordinary suite. Among the npu-marked tests, :data:`CANNOT_RUN` lists those that need
something the stand-in does not model, each with the reason; they run on an NPU
runner. :data:`CPU_TWIN_RUNS` lists cases a CPU twin already runs on the same
functional model while another stand-in test runs their device path (skipped here to
keep the stand-in run affordable; they run on a node). A test that needs a package or
extension the stand-in lacks skips through ``tests/npu_requirements.py`` with its own
reason. :data:`KNOWN_FINDINGS` lists the
npu-marked tests that fail on the stand-in because of what it found in the code, each a
strict xfail with the finding (an xfail, not a skip: the test runs, and fixing the code
turns it into an XPASS that fails until the entry is removed).
"""

from __future__ import annotations

from typing import Dict

import pytest

CPU_TESTS_REASON = "a CPU test: it runs in the ordinary suite, not in an npu stand-in process (SAO_NPU_STANDIN=1)"

_SGLANG_NPU_LAYERS = (
    "drives SGLang's NPU model layers (its DSA indexer / norms import sgl_kernel_npu and call torch_npu's "
    "norm, rope and attention kernels), which the stand-in does not model"
)
_MEMFABRIC_TRANSFER = (
    "moves KV through MemFabric's transfer engine (memfabric_hybrid's device-to-device / SDMA path); the "
    "stand-in of memfabric_hybrid (tests/sglang/fake_memfabric.py) models the bm host-pool API only"
)
_MEMFABRIC_OFFLOAD = (
    "allocates through memfabric_hybrid.offload (MemFabric-registered host memory), which has no stand-in "
    "(tests/sglang/fake_memfabric.py models the bm API)"
)
_MEMCACHE = (
    "Memcache's data path (memcache_hybrid's bm client) needs the Ascend driver; no stand-in of it exists "
    "(the CPU suite covers the metadata-only client)"
)

#: npu-marked test node ids (or module paths) -> why the stand-in cannot run them
CANNOT_RUN: Dict[str, str] = {
    "tests/sglang/e2e/test_npu_path.py::test_served_deepseek_v32_offload_on_equals_off": (
        "serves DeepSeek-V3.2 on SGLang's own NPU model runner (NPU attention backends, sgl_kernel_npu, "
        "HCCL graphs), which the stand-in does not model"
    ),
    "tests/layerwise_prefill/test_store_memcache.py::test_npu_put_get_layers_bit_exact": _MEMCACHE,
    "tests/layerwise_prefill/test_store_memcache.py::test_npu_pipeline_on_memcache_equals_local": _MEMCACHE,
    "tests/sglang/mem_cache/test_layerwise_pool.py::test_npu_memcache_store_inside_the_pool": _MEMCACHE,
    "tests/sglang/e2e/test_npu_path.py::test_npu_backends_agree_with_each_other_and_the_cpu_reference": (
        _SGLANG_NPU_LAYERS
    ),
    "tests/sglang/attention/test_fused_indexer_npu.py": _SGLANG_NPU_LAYERS,
    "tests/sglang/mem_cache/test_kvpp_pool.py::test_kvpp_pool_over_hccl_on_npu": _SGLANG_NPU_LAYERS,
    "tests/sglang/disaggregation/test_pd_npu.py": _MEMFABRIC_TRANSFER,
    "tests/transfer/test_pd_engines.py::test_memfabric_npu_to_npu_read_bit_exact": _MEMFABRIC_TRANSFER,
    "tests/transfer/test_pd_memfabric_yardstick.py": _MEMFABRIC_TRANSFER,
    "tests/sparse_decode/test_host_pool.py::test_memfabric_pool_rows_round_trip_to_the_device": _MEMFABRIC_OFFLOAD,
}


#: npu-marked tests that fail on the stand-in for a reason the stand-in found in the code
#: (not in the stand-in): strict xfails until fixed, then the XPASS fails and the entry goes
KNOWN_FINDINGS: Dict[str, str] = {}


#: npu-marked cases whose arithmetic a CPU twin runs on the same functional model, and whose
#: device path another stand-in test already runs: the stand-in skips them (its run is
#: otherwise the CPU twin's again); on a node they run on the device
CPU_TWIN_RUNS: Dict[str, str] = {
    "tests/ops/test_fused_npu.py::test_fused_lim_serves_verify_rows_sharing_a_row": (
        "the CPU twin tests/ops/test_fused_cpu_model.py runs the same check_lim_verify_rows on the functional "
        "model; the fused LIM on npu tensors runs in test_fused_lim_matches_reference_over_steps"
    ),
    "tests/sparse_decode/test_engine_fused_npu.py::test_engine_fused_copy_sfa_on_the_npu_matches_full_kv[4]": (
        "the CPU twin tests/sparse_decode/test_engine_fused_cpu_model.py runs 4 heads (padded to 8) on the "
        "functional model; the engine's fused branch on npu tensors runs in the [16] case"
    ),
}


def reason_for(nodeid: str, table: Dict[str, str] = CANNOT_RUN):
    """The entry of ``table`` for ``nodeid`` (a node id, or a module / test it belongs
    to); ``None``: none."""
    for key, reason in table.items():
        if nodeid == key or nodeid.startswith(key + "[") or nodeid.startswith(key + "::"):
            return reason
    return None


def mark_collected(items) -> None:
    """Skip what a stand-in process does not run (CPU tests; :data:`CANNOT_RUN`;
    :data:`CPU_TWIN_RUNS`)."""
    for item in items:
        if "npu" not in item.keywords:
            item.add_marker(pytest.mark.skip(reason=CPU_TESTS_REASON))
            continue
        reason = reason_for(item.nodeid) or reason_for(item.nodeid, CPU_TWIN_RUNS)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=f"npu stand-in: {reason}"))
            continue
        finding = reason_for(item.nodeid, KNOWN_FINDINGS)
        if finding is not None:
            item.add_marker(pytest.mark.xfail(strict=True, reason=finding))
