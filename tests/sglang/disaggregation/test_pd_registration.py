"""How the ascend_offload P/D backend enters SGLang, and what stops startup.

* real ``ServerArgs.resolve_once()`` in process: ``ascend_offload`` becomes SGLang's
  ``ascend`` and the validated ``pd_transfer`` is published; invalid settings stop
  resolution with every reason; the pair rules (``p_tp >= d_tp``, divisible) at pairing;
* SGLang's own ``get_kv_class`` (HookRegistry-wrapped) returns our classes only where
  the P/D config is published;
* the decode advert (typed, validated, fuzzed);
* the receiver's poll holds a failed request until no read writes into its pages.
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from types import SimpleNamespace

import msgspec
import pytest
from conftest import TINY_DSA
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_ascend_offload import config as cfg
from sglang_ascend_offload.sglang_plugin.args import carrier, flags
from sglang_ascend_offload.sglang_plugin.args.rules import pd_transfer as rules
from sglang_ascend_offload.transfer.advert import (
    ADVERT_FRAME_INDEX,
    ADVERT_VERSION,
    DecodeAdvert,
    advert_from_registration,
    decode_advert,
    encode_advert,
)
from sglang_ascend_offload.transfer.errors import ProtocolError
from sglang_ascend_offload.transfer.status import DONE, PENDING, RequestStatus, TransferState

PD = {"engine": "mooncake", "kv_port": 31000}


def raw(pd=None, pd_on=None, sparse=None, layerwise=None):
    return flags.RawFlags(
        enabled={
            "pd_transfer": pd is not None if pd_on is None else pd_on,
            "sparse_decode": sparse is not None,
            "layerwise_prefill": layerwise is not None,
        },
        configs={"pd_transfer": pd, "sparse_decode": sparse, "layerwise_prefill": layerwise},
    )


def _server_args(**kw):
    from sglang.srt.server_args import ServerArgs

    return ServerArgs(
        model_path=str(TINY_DSA),
        device="cpu",
        load_format="dummy",
        skip_tokenizer_init=True,
        disable_cuda_graph=True,
        **kw,
    )


# ------------------------------------------------------------------ startup (real resolution)
def test_choice_and_hooks_are_registered(plugins_loaded):
    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_ascend_offload.sglang_plugin import compat

    assert "ascend_offload" in DISAGG_TRANSFER_BACKEND_CHOICES
    for target in (
        compat.TARGET_GET_KV_CLASS,
        compat.TARGET_CONFIG_STORE,
        compat.TARGET_PREFILL_MANAGER,
        compat.TARGET_DECODE_MANAGER,
        compat.TARGET_RUN_BATCH,
        compat.TARGET_IDLE_SLEEP,
    ):
        assert target in HookRegistry._patched, target


def test_prefill_resolves_to_ascend_and_publishes_the_config(plugins_loaded, clean_state):
    from sglang.srt.arg_groups.model_override_base import resolving_view

    sa = _server_args(disaggregation_mode="prefill", disaggregation_transfer_backend="ascend_offload")
    flags.remember(raw(pd=json.dumps(PD)))
    sa.resolve_once()
    assert resolving_view(sa).disaggregation_transfer_backend == "ascend"  # what TransferBackend(...) accepts
    assert carrier.active_config().pd_transfer == cfg.PDTransferConfig(engine="mooncake", kv_port=31000)


def test_decode_with_sparse_decode_offload_resolves(plugins_loaded, clean_state):
    sa = _server_args(
        disaggregation_mode="decode",
        disaggregation_transfer_backend="ascend_offload",
        disaggregation_decode_retraction_backup="cpu_tensor",
    )
    flags.remember(raw(pd=json.dumps(PD), sparse='{"hot_tokens": 64}'))
    sa.resolve_once()
    published = carrier.active_config()
    assert published.pd_transfer is not None and published.sparse_decode.hot_tokens == 64


def test_backend_without_enable_flag_stops_startup(plugins_loaded, clean_state):
    sa = _server_args(disaggregation_mode="prefill", disaggregation_transfer_backend="ascend_offload")
    flags.remember(raw())
    with pytest.raises(cfg.ConfigError) as info:
        sa.resolve_once()
    assert [v.rule for v in info.value.violations] == ["sglang.pd_backend"]
    assert "--enable-pd-transfer" in str(info.value)


def test_invalid_pd_settings_stop_startup_listing_every_reason(plugins_loaded, clean_state):
    sa = _server_args(
        disaggregation_mode="decode",
        disaggregation_transfer_backend="mooncake",
        disaggregation_decode_enable_radix_cache=True,
        tp_size=2,
    )
    flags.remember(raw(pd=json.dumps({"engine": "memfabric", "kv_port": 31000})))
    with pytest.raises(cfg.ConfigError) as info:
        sa.resolve_once()
    found = {v.rule for v in info.value.violations}
    assert {
        "sglang.pd_backend",
        "sglang.pd_engine_device",
        "sglang.pd_unsupported",
        "sglang.pd_cpu_retraction_backup",
        "pd_transfer.decode_tp",
    } <= found, found
    text = str(info.value)
    assert "--disaggregation-transfer-backend ascend_offload" in text and "cpu_tensor" in text
    assert carrier.published_text() is None


LAYERWISE = '{"shared_buffers": 1, "independent_layers": [], "store_backend": "local"}'


def test_layerwise_prefill_with_pd_resolves(plugins_loaded, clean_state):
    sa = _server_args(disaggregation_mode="prefill", disaggregation_transfer_backend="ascend_offload")
    flags.remember(raw(pd=json.dumps(PD), layerwise=LAYERWISE))
    sa.resolve_once()
    published = carrier.active_config()
    assert published.pd_transfer is not None and published.layerwise_prefill.shared_buffers == 1


def test_layerwise_prefill_with_optimistic_prefill_stops_startup(plugins_loaded, clean_state):
    sa = _server_args(
        disaggregation_mode="prefill", disaggregation_transfer_backend="ascend_offload", optimistic_prefill_attempts=2
    )
    flags.remember(raw(pd=json.dumps(PD), layerwise=LAYERWISE))
    with pytest.raises(cfg.ConfigError) as info:
        sa.resolve_once()
    bad = [v for v in info.value.violations if v.rule == "sglang.pd_unsupported"]
    assert len(bad) == 1 and "--optimistic-prefill-attempts 2 with layerwise prefill offload" in bad[0].problem
    assert carrier.published_text() is None


SPEC = dict(
    speculative_algorithm="NEXTN",
    speculative_num_steps=3,
    speculative_eagle_topk=1,
    speculative_num_draft_tokens=4,
    disable_overlap_schedule=True,
    page_size=16,
)


def test_speculative_pd_resolves_where_the_draft_layer_is_moved(plugins_loaded, clean_state):
    """NextN on P/D: a device-pool prefill and an attention-TP-1 decode (with or without
    sparse decode offload) resolve; a layerwise prefill, and a decode whose attention TP
    ranks would each need the whole per-rank draft layer, are refused with their reasons,
    both at once."""

    def resolve(role, sparse=None, layerwise=None, **kw):
        flags.forget()
        carrier.clear()
        flags.remember(raw(pd=json.dumps(PD), sparse=sparse, layerwise=layerwise))
        args = dict(disaggregation_mode=role, disaggregation_transfer_backend="ascend_offload", **SPEC, **kw)
        if role == "decode":
            args["disaggregation_decode_retraction_backup"] = "cpu_tensor"
        _server_args(**args).resolve_once()
        return carrier.active_config()

    assert resolve("prefill").pd_transfer is not None
    assert resolve("decode", sparse='{"hot_tokens": 64}').sparse_decode.hot_tokens == 64
    assert resolve("decode").pd_transfer is not None
    with pytest.raises(cfg.ConfigError) as info:
        resolve("prefill", layerwise=LAYERWISE)
    bad = [v for v in info.value.violations if v.rule == "sglang.pd_speculative"]
    assert len(bad) == 1 and "speculative method 'mtp' with layerwise prefill offload" in bad[0].problem
    with pytest.raises(cfg.ConfigError) as info:
        resolve("decode", sparse='{"hot_tokens": 64}', tp_size=2)
    bad = [v for v in info.value.violations if v.rule == "sglang.pd_speculative"]
    assert len(bad) == 1 and "with decode attention TP 2" in bad[0].problem


def test_decode_attention_tp_rule(plugins_loaded, clean_state):
    """``--tp 2 --dp 2 --enable-dp-attention``: attention TP 1 per DP rank (SGLang rewrites it
    to ``attn_dp_size = 2``, ``dp_size = 1``), served with or without offload; plain
    ``--tp 2`` is attention TP 2: served with sparse decode offload (TP-shared host pool),
    refused without it (per-rank device main KV), with the same verdict as ``config.violations``
    (what ``check-config`` runs)."""
    decode = dict(
        disaggregation_mode="decode",
        disaggregation_transfer_backend="ascend_offload",
        disaggregation_decode_retraction_backup="cpu_tensor",
        tp_size=2,
    )

    def resolve(sparse, **kw):
        flags.forget()
        carrier.clear()
        flags.remember(raw(pd=json.dumps(PD), sparse=sparse))
        _server_args(**decode, **kw).resolve_once()
        assert carrier.active_config().pd_transfer is not None

    resolve('{"hot_tokens": 64}', dp_size=2, enable_dp_attention=True)
    resolve(None, dp_size=2, enable_dp_attention=True)
    resolve('{"hot_tokens": 64}')  # attention TP 2 with the TP-shared host pool
    with pytest.raises(cfg.ConfigError) as info:
        resolve(None)
    bad = [v for v in info.value.violations if v.rule == "pd_transfer.decode_tp"]
    assert len(bad) == 1 and "decode attention TP 2 without sparse decode offload" in bad[0].problem
    assert "--enable-sparse-decode-offload" in bad[0].fix and "--enable-dp-attention" in bad[0].fix
    pd = cfg.PDTransferConfig(**PD)
    d = cfg.Deployment(device="cpu", pd_role="decode", tp=2, attn_tp=2)
    assert [v.rule for v in cfg.violations(cfg.OffloadConfig(pd_transfer=pd), d)] == ["pd_transfer.decode_tp"]
    sd = cfg.SparseDecodeOffloadConfig(hot_tokens=64)
    assert cfg.violations(cfg.OffloadConfig(pd_transfer=pd, sparse_decode=sd), d) == []
    npu = cfg.Deployment(device="npu", soc="A3", pd_role="decode", tp=2, attn_tp=2)
    pd_npu = cfg.PDTransferConfig(**{**PD, "engine": "memfabric"})
    bad = [
        v
        for v in cfg.violations(cfg.OffloadConfig(pd_transfer=pd_npu, sparse_decode=sd), npu)
        if v.rule == "pd_transfer.decode_tp"
    ]
    assert len(bad) == 1 and "has no mapping a P/D engine can write" in bad[0].problem


def test_attention_parallel_reads_both_spellings():
    from sglang_ascend_offload.sglang_plugin.args.deployment import attention_parallel

    def getter(**kw):
        return lambda name, default=None: kw.get(name, default)

    assert attention_parallel(getter(tp_size=8, dp_size=1, attn_dp_size=8)) == (8, 1)  # resolved
    assert attention_parallel(getter(tp_size=8, dp_size=4, enable_dp_attention=True)) == (4, 2)  # as given
    assert attention_parallel(getter(tp_size=8)) == (1, 8)
    assert attention_parallel(getter(tp_size=8, attn_dp_size=2, attn_cp_size=2)) == (2, 2)
    d = cfg.Deployment(device="cpu", pd_role="decode", tp=8, dp=8, attn_tp=1, peer_tp=2)
    found = {v.rule for v in cfg.violations(cfg.OffloadConfig(pd_transfer=cfg.PDTransferConfig(**PD)), d)}
    assert "pd_transfer.tp_ratio" not in found  # p_tp 2 >= attention d_tp 1
    assert "attn_tp must be between 1 and tp" in cfg.Deployment(tp=2, attn_tp=4)._check()


def test_stated_invalid_peer_tp_stops_startup(plugins_loaded, clean_state):
    sa = _server_args(disaggregation_mode="prefill", disaggregation_transfer_backend="ascend_offload")
    flags.remember(raw(pd=json.dumps({**PD, "peer_tp": 2})))  # p_tp 1 < d_tp 2
    with pytest.raises(cfg.ConfigError) as info:
        sa.resolve_once()
    assert "pd_transfer.tp_ratio" in {v.rule for v in info.value.violations}


def test_pd_on_a_colocated_server_is_refused(plugins_loaded, clean_state):
    flags.remember(raw(pd=json.dumps(PD)))
    with pytest.raises(cfg.ConfigError) as info:
        _server_args().resolve_once()
    assert "pd_transfer.role" in {v.rule for v in info.value.violations}


def test_pd_facts_reach_config_violations():
    d = cfg.Deployment(device="cpu", pd_role="prefill", tp=2, disaggregation_transfer_backend="ascend")
    sa = SimpleNamespace(_raw_input={"disaggregation_transfer_backend": "ascend_offload"})
    cfg_pd = cfg.OffloadConfig(pd_transfer=cfg.PDTransferConfig(engine="mooncake"))
    assert rules.with_pd_facts(d, cfg_pd, sa).disaggregation_transfer_backend == "ascend_offload"
    cfg_peer = cfg.OffloadConfig(pd_transfer=cfg.PDTransferConfig(engine="mooncake", peer_tp=4))
    with_peer = rules.with_pd_facts(d, cfg_peer, sa)
    assert with_peer.peer_tp == 4
    assert "pd_transfer.tp_ratio" in {v.rule for v in cfg.violations(cfg_pd, with_peer)}  # p_tp 2 < d_tp 4


@pytest.mark.parametrize(
    "p_tp,d_tp,ok", [(1, 1, True), (2, 1, True), (4, 2, True), (1, 2, False), (3, 2, False), (2, 4, False)]
)
def test_pair_rules_at_pairing(p_tp, d_tp, ok):
    pd = cfg.PDTransferConfig(engine="mooncake")
    problems = rules.pair_problems(pd, role="decode", own_tp=d_tp, peer_tp=p_tp, device="cpu")
    assert (problems == []) == ok, problems
    if not ok:
        assert all("pd_transfer.tp_ratio" in p and "->" in p for p in problems)
    assert rules.pair_problems(pd, role="prefill", own_tp=p_tp, peer_tp=d_tp, device="cpu") == problems
    assert any(
        "sglang.pd_parallel" in p
        for p in rules.pair_problems(pd, role="decode", own_tp=1, peer_tp=1, device="cpu", peer_pp=2)
    )


# ------------------------------------------------------------------ get_kv_class routing
def test_get_kv_class_routes_ascend_to_our_classes_only_with_the_config(plugins_loaded, clean_state):
    from sglang.srt.disaggregation import utils

    from sglang_ascend_offload.sglang_plugin.disaggregation.ascend_offload import conn

    ascend, kinds = utils.TransferBackend.ASCEND, utils.KVClassType
    carrier.publish(cfg.OffloadConfig(pd_transfer=cfg.PDTransferConfig(engine="mooncake")))
    assert utils.get_kv_class(ascend, kinds.MANAGER) is conn.AscendOffloadKVManager
    assert utils.get_kv_class(ascend, kinds.SENDER) is conn.AscendOffloadKVSender
    assert utils.get_kv_class(ascend, kinds.RECEIVER) is conn.AscendOffloadKVReceiver
    assert utils.get_kv_class(ascend, kinds.BOOTSTRAP_SERVER) is conn.AscendOffloadKVBootstrapServer
    assert utils.get_kv_class(utils.TransferBackend.MOONCAKE, kinds.MANAGER).__name__ == "MooncakeKVManager"
    # the prefill scheduler module's own binding is the wrapped function too
    from sglang.srt.disaggregation import prefill

    assert prefill.get_kv_class(ascend, kinds.SENDER) is conn.AscendOffloadKVSender
    assert not conn.AscendOffloadKVSender.supports_host_tensor_indices  # prefill.py:1746-1760 stays off CUDA
    carrier.clear()
    assert utils.get_kv_class(ascend, kinds.MANAGER).__name__ == "AscendKVManager"  # SGLang's own


# ------------------------------------------------------------------ decode advert
def advert(**kw):
    base = dict(
        version=ADVERT_VERSION,
        host="127.0.0.1",
        control_port=31005,
        kv_port=31000,
        dp_rank=1,
        d_tp=4,
        d_rank=1,
        engine="mooncake",
        data_protocol="tcp",
        layout_kind="host_rows",
        main_kv="tp_shared",
    )
    base.update(kw)
    return DecodeAdvert(**base)


def test_advert_round_trip_and_validation():
    a = advert()
    frames = [b"x"] * ADVERT_FRAME_INDEX
    assert advert_from_registration(frames) is None  # a decode without the backend
    assert advert_from_registration(frames + [encode_advert(a)]) == a
    for bad, msg in (
        (advert(control_port=31004), "control port"),
        (advert(d_rank=4), "d_rank"),
        (advert(version=ADVERT_VERSION + 1), "version"),
        (advert(main_kv="per_rank"), "decode attention TP 4 with a per-rank main-KV pool"),
    ):
        with pytest.raises(ProtocolError, match=msg):
            decode_advert(msgspec.msgpack.encode(bad))
    for junk in (
        b"",
        b"\x80",
        msgspec.msgpack.encode({"host": "h"}),
        msgspec.msgpack.encode({**msgspec.structs.asdict(a), "extra": 1}),
        msgspec.msgpack.encode({**msgspec.structs.asdict(a), "layout_kind": "other"}),
        msgspec.msgpack.encode({**msgspec.structs.asdict(a), "main_kv": "device"}),
        msgspec.msgpack.encode({**msgspec.structs.asdict(a), "control_port": 80}),
        b"x" * 5000,
    ):
        with pytest.raises(ProtocolError):
            decode_advert(junk)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_advert_decoder_never_crashes_on_arbitrary_bytes(data):
    try:
        decode_advert(data)
    except ProtocolError:
        pass


# ------------------------------------------------------------------ receiver poll (decode)
class _Sink:
    """A decode sink whose request failed with a read still writing into its pages."""

    def __init__(self, status):
        self.st = status
        self.released_flag = False
        self.failed_with = None
        self.claimed_rooms = []

    def status(self, room):
        return self.st

    def released(self, room):
        return self.released_flag

    def fail(self, room, reason):
        self.failed_with = reason
        self.st = RequestStatus(TransferState.FAILED, reason)

    def claim(self, room):
        self.claimed_rooms.append(room)

    def forget(self, room, reason):
        self.forgotten = reason
        return True

    def note_prefill_done(self, room):
        import time

        return time.monotonic()

    def failure_reason(self, room):
        return self.st.reason if self.st.state is TransferState.FAILED else None


def _receiver(sgl_status, sink):
    import threading

    from sglang.srt.disaggregation.base.conn import KVPoll

    from sglang_ascend_offload.sglang_plugin.disaggregation.ascend_offload.conn import AscendOffloadKVReceiver

    mgr = SimpleNamespace(
        sink=sink,
        request_status={7: sgl_status},
        failure_records={},
        failure_lock=threading.Lock(),
        waiting_timeout=300,
        pd_config=cfg.PDTransferConfig(engine="mooncake", handshake_timeout_s=1.0, layer_timeout_s=1.0),
        check_status=lambda room: mgr.request_status[room],
        defer_decode_allocation=False,
        required_prefill_response_num_table={},
        prefill_response_tracker={},
        addr_to_rooms_tracker={"p:1": {7}},
    )
    r = AscendOffloadKVReceiver.__new__(AscendOffloadKVReceiver)
    r.kv_mgr, r.bootstrap_room, r.bootstrap_addr, r.conclude_state = mgr, 7, "p:1", None
    r._prefill_wait_start, r.init_time, r._lifecycle_lock = None, None, nullcontext()
    return r, KVPoll


def test_receiver_poll_combines_sglang_status_with_the_protocol(plugins_loaded):
    from sglang.srt.disaggregation.base.conn import KVPoll

    sink = _Sink(PENDING)
    r, _ = _receiver(KVPoll.Success, sink)  # SGLang's aux/status arrived, the KV not yet
    assert r.poll() == KVPoll.Transferring
    sink.st = DONE
    assert r.poll() == KVPoll.Success and sink.claimed_rooms == [7]

    sink = _Sink(RequestStatus(TransferState.FAILED, "layer 1: read failed"))
    r, _ = _receiver(KVPoll.Transferring, sink)
    assert r.poll() == KVPoll.Transferring  # a read still writes into the pages: hold them
    sink.released_flag = True
    assert r.poll() == KVPoll.Failed
    with pytest.raises(Exception, match="layer 1: read failed"):
        r.failure_exception()
    assert sink.forgotten and 7 not in r.kv_mgr.request_status  # SGLang's room state cleared too

    sink = _Sink(PENDING)
    r, _ = _receiver(KVPoll.Failed, sink)  # SGLang failed it (e.g. prefill reported failure)
    r.kv_mgr.failure_records[7] = "prefill died"
    assert r.poll() == KVPoll.Transferring and "prefill died" in sink.failed_with
    sink.released_flag = True
    assert r.poll() == KVPoll.Failed

    sink = _Sink(PENDING)
    r, _ = _receiver(KVPoll.WaitingForInput, sink)
    assert r.poll() == KVPoll.WaitingForInput  # never upgraded before SGLang's own progress
