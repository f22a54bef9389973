"""NPU API conformance checked on CPU: the project's memfabric / memcache / torch_npu /
SGLang-NPU uses against the real packages, and negative controls showing each check fails."""

import json
import os
import re
import subprocess
import sys
import textwrap
import types

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


def test_every_use_has_exactly_one_outcome(project_report):
    """checked + unverified + skipped + findings == the uses, per package and in all."""
    distinct = {(u.path, u.kind) for u in project_report_uses() if u.package in NPU_PACKAGES}
    assert len(distinct) >= 40  # the finder really sees the MemFabric / Memcache / torch_npu code
    outcomes = 0
    for r in project_report.details.values():
        outcomes += r.checked + len(r.unverified) + len(r.skipped) + len(r.findings)
    assert outcomes == project_report.uses
    assert project_report.checked_calls == sum(r.checked for r in project_report.details.values())
    assert project_report.checked_calls + len(project_report.unverified) + len(project_report.skipped) == outcomes
    for entry in project_report.unverified + project_report.skipped:  # each listed with where and why
        assert entry.file and entry.line > 0 and entry.what and entry.why


def project_report_uses():
    scan = callsites.scan()
    report._test_tree_torch_npu(scan)
    return scan.uses


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
    assert rep.checked_calls == 1  # the import; the attribute is unknown, not checked
    assert rep.summary() == "1 checked / 0 unverified / 0 skipped / 1 unknown"


def test_pybind_signature_parser():
    doc = (
        "create2(id: typing.SupportsInt, data_op_type: _pymf_hybrid.bm.BmDataOpType = <BmDataOpType.SDMA: 1>, "
        "tag: str = '') -> (anonymous namespace)::BigMemory\n\nCreate..."
    )
    (sig,) = packages.parse_pybind_signatures(doc, "create2")
    assert list(sig.signature.parameters) == ["id", "data_op_type", "tag"]
    assert sig.returns == "(anonymous namespace)::BigMemory"
    assert sig.signature.parameters["id"].default is sig.signature.parameters["id"].empty


def _outcomes(source: str):
    """Each checker's :class:`PackageResult` over one in-memory module, by package."""
    scan = callsites.scan_source({"snippet.py": textwrap.dedent(source)})
    results = [packages.check(scan.uses, p) for p in packages.DISTRIBUTIONS]
    results += [torch_npu_schemas.check(scan.uses), sglang_source.check(scan.uses)]
    return {r.package: r for r in results}


def test_a_call_without_a_readable_signature_is_unverified_not_checked():
    """torch.npu's names are extracted, not its signatures; an SGLang name bound to a value
    has no ``def`` to bind against: both calls resolve, neither is checked."""
    by_pkg = _outcomes("""
        import torch

        def sync():
            torch.npu.synchronize(no_such_argument=1)
            return torch.npu.current_stream

        def register():
            from sglang.srt.server_args import add_attention_backend_choices
            add_attention_backend_choices(["x"])
    """)
    tnpu, sgl = by_pkg["torch_npu"], by_pkg["sglang"]
    assert [(f.what, f.why) for f in tnpu.unverified] == [
        ("torch_npu.npu.synchronize(...)", "torch.npu.synchronize exists; torch.npu's signatures are not extracted")
    ]
    assert tnpu.checked == 1 and tnpu.findings == []  # the torch.npu.current_stream read
    assert [(f.what, f.why) for f in sgl.unverified] == [
        ("sglang.srt.server_args.add_attention_backend_choices(...)", "a call of a module-level value")
    ]
    assert sgl.checked == 1  # the import; the call is not counted as checked too


def test_a_pybind_function_without_a_signature_is_unverified():
    """The memfabric / memcache checker reads pybind11 signatures from ``__doc__``: a
    builtin whose doc has none (``len`` here, on a stand-in module) resolves, unverified."""
    module = types.ModuleType("memfabric_hybrid")
    module.no_doc_fn = len
    use = callsites.Use("snippet.py", 3, ("memfabric_hybrid", "no_doc_fn"), "call", positional=1)
    result = packages.PackageResult("memfabric_hybrid", "1.3.0", "stand-in module")
    packages._check_use(packages._Resolver(module), use, result)
    assert result.checked == 0 and result.skipped == [] and result.findings == []
    assert [(f.what, f.why) for f in result.unverified] == [
        ("memfabric_hybrid.no_doc_fn(...)", "pybind11 function without a signature in __doc__")
    ]


def test_every_skipped_use_is_listed_with_its_reason():
    by_pkg = _outcomes("""
        from sglang.srt.runtime_context import get_parallel

        def rank():
            return get_parallel().tp_rank
    """)
    sgl = by_pkg["sglang"]
    assert [(f.file, f.line, f.what, f.why) for f in sgl.skipped] == [
        ("snippet.py", 5, "sglang.srt.runtime_context.get_parallel().tp_rank", "the result of a function call")
    ]
    assert sgl.as_dict()["skipped"] == 1 and sgl.unverified == []


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
    assert {"packages", "checked_calls", "unverified", "skipped", "unknown"} <= set(doc)
    assert doc["unknown"] == [] and proc.returncode == 0, doc["unknown"]
    assert doc["checked_calls"] > 0 and doc["packages"]["memcache_hybrid"] == "1.3.0"
    for key in ("unverified", "skipped"):
        assert doc[key] and all(set(e) == {"where", "package", "what", "why"} for e in doc[key]), key
    assert len(doc["skipped"]) == sum(d["skipped"] for d in doc["details"].values())


def test_env_npu_api_summary_line():
    proc = subprocess.run(
        [sys.executable, "-m", "sglang_ascend_offload", "env", "--npu-api"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    first = proc.stdout.splitlines()[0]
    assert re.fullmatch(
        r"NPU API conformance: \d+ uses in \d+ files: \d+ checked / \d+ unverified / \d+ skipped / 0 unknown", first
    ), first
    assert "  SKIPPED " in proc.stdout and "  UNVERIFIED " in proc.stdout
