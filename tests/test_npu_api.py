"""NPU API conformance checked on CPU: the project's memfabric / memcache / torch_npu /
SGLang-NPU uses against the real packages, and negative controls showing each check fails."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from sglang_ascend_offload.npu_api import callsites, packages, report, sglang_source, torch_npu_schemas

pytest.importorskip("memfabric_hybrid")
pytest.importorskip("memcache_hybrid")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NPU_PACKAGES = ("memfabric_hybrid", "memcache_hybrid", "torch_npu")


@pytest.fixture(scope="module")
def project_report():
    return report.collect()


@pytest.fixture(scope="module")
def project_scan():
    return callsites.scan()


def _check_snippet(source: str):
    """Every checker over one in-memory module; returns (findings, scan)."""
    scan = callsites.scan_source({"snippet.py": textwrap.dedent(source)})
    results = [packages.check(scan.uses, p) for p in packages.DISTRIBUTIONS]
    results.append(torch_npu_schemas.check(scan.uses))
    results.append(sglang_source.check(scan.uses))
    findings = [f for r in results for f in r.findings]
    return findings, scan


def test_project_source_conforms(project_report):
    assert [f.as_dict() for f in project_report.unknown] == []
    assert project_report.packages["memfabric_hybrid"] == "1.3.0"
    assert project_report.packages["torch_npu"] == "2.13.0"


def test_checked_calls_cover_every_distinct_npu_use(project_report, project_scan):
    distinct = {(u.path, u.kind) for u in project_scan.uses if u.package in NPU_PACKAGES}
    checked = sum(project_report.details[p].checked for p in NPU_PACKAGES)
    assert len(distinct) >= 40  # the finder really sees the MemFabric / Memcache / torch_npu code
    assert checked >= len(distinct)
    assert project_report.checked_calls >= len({(u.path, u.kind) for u in project_scan.uses})


def test_finder_types_returned_objects(project_scan):
    dotted = {u.dotted for u in project_scan.uses}
    for expected in (
        "memfabric_hybrid.bm.create2().peer_rank_ptr",  # result of a pybind call
        "memfabric_hybrid.offload.OffloadConfig().flags",  # attribute set on a config
        "memfabric_hybrid.TransferEngine().batch_register_memory",  # via the base class's self._engine
        "memcache_hybrid.DistributedObjectStore().batch_alloc",  # via self._ok()
        "memfabric_hybrid.bm.BmDataOpType.DEVICE_RDMA",  # getattr of a dataclass default
        "memfabric_hybrid.TransDataOpType.DEVICE_URMA",  # getattr guarded by `in PROTOCOLS`
        "memcache_hybrid.H2G",  # getattr over a literal tuple
        "torch_npu.npu_sparse_flash_attention",  # _torch_npu_op("...")(...)
        "sglang.srt.hardware_backend.npu.memory_pool_npu.NPUMLATokenToKVPool().set_kv_buffer",
    ):
        assert expected in dotted, expected


def test_schema_file_covers_the_ops_called(project_scan):
    data = torch_npu_schemas.load()
    assert set(torch_npu_schemas.project_ops(project_scan.uses)) <= set(data["ops"])
    assert data["source"].endswith("libtorch_npu.so") and data["lib_yaml_disagreements"] == {}


# ---------------------------------------------------------------------------- negative controls
def test_missing_memfabric_flag_is_reported():
    findings, _ = _check_snippet("""
        def alloc():
            from memfabric_hybrid import offload
            cfg = offload.OffloadConfig()
            cfg.flags = offload.OFFLOAD_FLAG_URMA_POOL
            cfg.no_such_field = 1
            return offload.initialize(cfg)
    """)
    whats = {f.what for f in findings}
    assert "memfabric_hybrid.offload.OFFLOAD_FLAG_URMA_POOL" in whats
    assert "memfabric_hybrid.offload.OffloadConfig().no_such_field = ..." in whats
    assert len(findings) == 2


def test_wrong_create2_keyword_and_arity_are_reported():
    findings, _ = _check_snippet("""
        import memfabric_hybrid as mf
        from memfabric_hybrid import bm

        def make(n):
            handle = bm.create2(id=0, local_dram_size=n, max_dram_sizes=n)
            handle.copy_data(1, 2)
            engine = mf.TransferEngine()
            return engine.initialize("tcp://h:1", "h:2", "Prefill", 0, mf.TransDataOpType.SDMA, "Decode", "", 9)
    """)
    by_what = {f.what: f.why for f in findings}
    assert "max_dram_sizes" in by_what["memfabric_hybrid.bm.create2(...)"]
    assert "missing a required argument" in by_what["memfabric_hybrid.bm.create2().copy_data(...)"]
    assert "too many positional" in by_what["memfabric_hybrid.TransferEngine().initialize(...)"]


def test_wrong_memcache_method_is_reported():
    findings, _ = _check_snippet("""
        import importlib

        def client():
            mh = importlib.import_module("memcache_hybrid")
            store = mh.DistributedObjectStore()
            store.batch_put_from_layer(["k"], [[0]], [[1]], mh.L2G)
    """)
    assert [f.what for f in findings] == ["memcache_hybrid.DistributedObjectStore().batch_put_from_layer(...)"]


def test_misspelled_torch_npu_keyword_is_reported():
    findings, _ = _check_snippet("""
        import importlib

        def _op(name):
            return getattr(importlib.import_module("torch_npu"), name)

        def sfa(q, k, idx):
            return _op("npu_sparse_flash_attention")(query=q, key=k, value=k, sparse_indice=idx, scale_value=1.0)

        def direct(q, k, w):
            import torch
            torch.ops.npu.npu_lightning_indexer(q, k, w, layout_querry="TND")
            import torch_npu
            return torch_npu.npu_no_such_op(q)
    """)
    by_what = {f.what: f.why for f in findings}
    assert "sparse_indice" in by_what["torch_npu.npu_sparse_flash_attention(...)"]
    assert "layout_querry" in by_what["torch_npu.npu_lightning_indexer(...)"]
    assert "no registered schema" in by_what["torch_npu.npu_no_such_op(...)"]


def test_torch_npu_positional_arity_is_checked():
    findings, _ = _check_snippet("""
        import torch_npu

        def li(q, k, w, lens):
            return torch_npu.npu_lightning_indexer(q, k, w, lens)   # actual_seq_lengths_query is keyword-only
    """)
    assert len(findings) == 1 and "too many positional" in findings[0].why


def test_missing_sglang_attribute_and_keyword_are_reported():
    findings, _ = _check_snippet("""
        from sglang.srt.hardware_backend.npu.memory_pool_npu import NPUMLATokenToKVPool, NoSuchPool
        from sglang.srt.mem_cache.memory_pool import KVCache

        class Pool(NPUMLATokenToKVPool):
            def write(self, layer, loc, k, v):
                super().set_kv_buffer(layer, loc, k, v)
                super().set_kv_bufer(layer, loc, k, v)
                KVCache.__init__(self, size=1, page_size=1, dtype=None, layer_num=1, device="cpu",
                                 enable_memory_saver=False, no_such_arg=1)

        TARGET = "sglang.srt.mem_cache.pool_host.npu_memfabric.ensure_memfabric_capacty"
    """)
    whats = {f.what for f in findings}
    assert "sglang.srt.hardware_backend.npu.memory_pool_npu.NoSuchPool" in whats
    assert "sglang.srt.hardware_backend.npu.memory_pool_npu.NPUMLATokenToKVPool().set_kv_bufer(...)" in whats
    assert "sglang.srt.mem_cache.memory_pool.KVCache.__init__(...)" in whats
    assert "sglang.srt.mem_cache.pool_host.npu_memfabric.ensure_memfabric_capacty" in whats
    assert len(findings) == 4


def test_unresolvable_dynamic_name_is_unknown():
    _, scan = _check_snippet("""
        from memfabric_hybrid import bm

        def pick(cfg):
            return getattr(bm.BmCopyType, cfg.kind + "2G")
    """)
    assert [u.what for u in scan.unresolved] == ["getattr(memfabric_hybrid.bm.BmCopyType, cfg.kind + '2G')"]


def test_report_fails_on_a_tree_with_the_old_flag(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "pool.py").write_text("from memfabric_hybrid import offload\nFLAG = offload.OFFLOAD_FLAG_URMA_POOL\n")
    rep = report.collect([str(pkg)])
    assert [f.what for f in rep.unknown] == ["memfabric_hybrid.offload.OFFLOAD_FLAG_URMA_POOL"]
    assert rep.checked_calls == 2  # the import and the attribute


def test_pybind_signature_parser():
    doc = (
        "create2(id: typing.SupportsInt, data_op_type: _pymf_hybrid.bm.BmDataOpType = <BmDataOpType.SDMA: 1>, "
        "tag: str = '') -> (anonymous namespace)::BigMemory\n\nCreate..."
    )
    (sig,) = packages.parse_pybind_signatures(doc, "create2")
    assert list(sig.signature.parameters) == ["id", "data_op_type", "tag"]
    assert sig.returns == "(anonymous namespace)::BigMemory"
    assert sig.signature.parameters["id"].default is sig.signature.parameters["id"].empty


# ---------------------------------------------------------------------------- CLI
def test_env_npu_api_json_is_one_document():
    proc = subprocess.run(
        [sys.executable, "-m", "sglang_ascend_offload", "env", "--npu-api", "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    doc = json.loads(proc.stdout)  # exactly one JSON document: extra text would not parse
    assert {"packages", "checked_calls", "unknown"} <= set(doc)
    assert doc["unknown"] == [] and proc.returncode == 0, doc["unknown"]
    assert doc["checked_calls"] > 0 and doc["packages"]["memcache_hybrid"] == "1.3.0"
