"""Memcache meta service started from a bad config: the error names it and carries the
service's log. A module of its own: ``test_store_memcache.py`` keeps a meta service
running for its whole module, and Memcache allows one per machine, so a start next to
it would fail for that reason instead of the config."""

import pytest
from test_store_memcache import needs_memcache

from sglang_ascend_offload.layerwise_prefill.store import StoreUnavailable
from sglang_ascend_offload.layerwise_prefill.store_memcache import MetaServiceProcess, write_mmc_conf
from sglang_ascend_offload.testing.machine_lock import machine_lock
from sglang_ascend_offload.testing.ports import reserve_port


@needs_memcache
def test_meta_service_bad_config_reports_log(tmp_path):
    p = tmp_path / "bad-meta.conf"
    port = reserve_port()
    write_mmc_conf(
        str(p), {"ock.mmc.meta_service_url": f"tcp://127.0.0.1:{port}", "ock.mmc.log_level": "nonsense-level"}
    )
    svc = MetaServiceProcess(str(p), start_timeout_s=60)
    with machine_lock("memcache_meta_service"):  # fails for its config, not for another run's service
        try:
            with pytest.raises(StoreUnavailable, match="meta service") as info:
                svc.start()
        finally:
            svc.stop()
    assert "Invalid value for <ock.mmc.log_level>" in str(info.value)  # the service's own log, verbatim
