"""The ascend_offload P/D backend over MemFabric on Ascend NPUs (executed by a CANN runner).

Two processes (prefill rank, decode rank), each with the plugin's NPU pools and a
MemFabric engine (``sdma``) joined to one config store: the prefill links publish a
request layer by layer, the decode sink pulls it into its device pool (``split``) or
straight into its MemFabric-registered host pool (``host_rows``, sparse decode
offload); the decode checks the pulled pages bit for bit against the prefill pages.
"""

from __future__ import annotations

import pytest
import torch
from npu_requirements import npu_present, require_npu, require_package

from sglang_ascend_offload.testing.ports import reserve_port

pytestmark = [
    pytest.mark.npu,
    pytest.mark.skipif(not npu_present(), reason="needs an Ascend NPU with CANN, torch_npu and memfabric-hybrid"),
    pytest.mark.timeout(300),
]


@pytest.fixture(autouse=True)
def _npu_packages():
    """On an NPU runner a missing torch_npu or memfabric-hybrid fails these tests."""
    require_npu()
    require_package("memfabric_hybrid", "the [npu] extra")


PAGE, SLOTS, LAYERS = 128, 32 * 128, 3
SRC, DST = [3, 7, 1, 12], [9, 4, 20, 2]


def free_port() -> int:
    return reserve_port()  # reserved across processes, below the ephemeral range


def _pools(kind, device):
    from sglang_ascend_offload import config as cfg
    from sglang_ascend_offload.sglang_plugin.mem_cache.pool.device import DeviceDSAPool
    from sglang_ascend_offload.sglang_plugin.mem_cache.pool.sparse_decode import HostMainKVPool

    common = dict(
        page_size=PAGE,
        dtype=torch.bfloat16,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        layer_num=LAYERS,
        device=device,
        enable_memory_saver=False,
        index_head_dim=128,
    )
    if kind == "host_rows":
        from dsa_harness import hot_plan_for

        sd = cfg.SparseDecodeOffloadConfig(hot_tokens=4096)
        return HostMainKVPool(
            SLOTS,
            hot_plan=hot_plan_for(common, sd, top_k=2048, req_slots=4),
            offload=sd,
            host_pool_kind="memfabric",
            **common,
        )
    return DeviceDSAPool(SLOTS, index_size=SLOTS, index_page_size=PAGE, **common)


def _peer(role, kind, config_json, device, q_out, q_in):
    import torch_npu  # noqa: F401
    from dsa_harness import published_context

    from sglang_ascend_offload import config as cfg
    from sglang_ascend_offload.transfer.advert import decode_advert, encode_advert
    from sglang_ascend_offload.transfer.decode_sink import DecodeSink
    from sglang_ascend_offload.transfer.engine import create_engine
    from sglang_ascend_offload.transfer.prefill_links import PrefillLinks
    from sglang_ascend_offload.transfer.publisher import wait_terminal

    torch.npu.set_device(device)
    config = cfg.parse_section(cfg.PDTransferConfig, config_json)
    with published_context(device="npu"):
        engine = create_engine(config, role, device_id=device)
        if role == "prefill":
            pool = _pools("split", "npu")
            g = torch.Generator().manual_seed(5)
            for buf in (pool.k_buffer, pool.v_buffer, pool.index_k_buffer):
                buf.copy_(torch.randn(buf.shape, generator=g).to(buf.dtype))
            links = PrefillLinks(config, p_tp=1, p_rank=0, pool=pool, engine=engine, max_blocks=8)
            advert = decode_advert(q_in.get(timeout=120))
            links.note_peer("decode", advert)
            links.submit(1, ["decode"], SRC)
            st = wait_terminal(links, 1, 120)
            q_out.put(
                (
                    st.state.value,
                    st.reason,
                    [pool.k_buffer.cpu()[:, SRC], pool.v_buffer.cpu()[:, SRC], pool.index_k_buffer.cpu()[:, SRC]],
                )
            )
            q_in.get(timeout=120)
            links.close()
        else:
            pool = _pools(kind, "npu")
            sink = DecodeSink(config, d_tp=1, d_rank=0, dp_rank=0, pool=pool, engine=engine)
            sink.expect(1, DST)
            q_out.put(encode_advert(sink.advert()))
            state, reason, (k, v, idx) = q_in.get(timeout=180)
            ok = state == "done" and sink.status(1).state.value == "done"
            if kind == "host_rows":
                want = torch.cat((k.reshape(LAYERS, len(SRC), PAGE, 512), v.reshape(LAYERS, len(SRC), PAGE, 64)), -1)
                got = torch.stack([pool.host_page_blocks(i)[DST].cpu() for i in range(LAYERS)])
            else:
                want = torch.cat((k.flatten(2), v.flatten(2)), -1)
                got = torch.cat((pool.k_buffer.cpu()[:, DST].flatten(2), pool.v_buffer.cpu()[:, DST].flatten(2)), -1)
            ok = ok and torch.equal(got, want) and torch.equal(pool.index_k_buffer.cpu()[:, DST], idx)
            q_out.put((ok, reason))
            sink.close()
        engine.close()


@pytest.mark.parametrize("kind", ["split", "host_rows"])
def test_memfabric_pd_backend_bit_exact(kind, plugins_loaded):
    import json
    import multiprocessing as mp

    from sglang_ascend_offload.transfer.engine_memfabric import create_config_store

    url = f"tcp://127.0.0.1:{free_port()}"
    create_config_store(url)
    config = json.dumps(
        {
            "engine": "memfabric",
            "protocol": "sdma",
            "store_url": url,
            "kv_port": free_port(),
            "host": "127.0.0.1",
            "layer_timeout_s": 30,
        }
    )
    ctx = mp.get_context("spawn")
    qp_out, qp_in, qd_out, qd_in = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    ndev = torch.npu.device_count()
    p = ctx.Process(target=_peer, args=("prefill", kind, config, 0, qp_out, qp_in))
    d = ctx.Process(target=_peer, args=("decode", kind, config, 1 % ndev, qd_out, qd_in))
    p.start()
    d.start()
    try:
        qp_in.put(qd_out.get(timeout=180))  # the decode advert
        result = qp_out.get(timeout=240)
        assert result[0] == "done", result[1]
        qd_in.put(result)
        ok, reason = qd_out.get(timeout=120)
        assert ok, reason
    finally:
        qp_in.put("stop")
        p.join(60)
        d.join(60)
        for proc in (p, d):
            if proc.is_alive():
                proc.kill()
