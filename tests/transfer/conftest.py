"""Shared fixtures of the P/D transfer tests.

``pd_pool``: six spawned worker processes (enough for p_tp=4 + d_tp=2), started
once per test session and reused by every multi-process scenario.
"""

import importlib.util
import os

import pytest

os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake logs through glog (before any engine starts)
os.environ.setdefault("MOONCAKE_PROTOCOL", "tcp")

from sglang_ascend_offload.testing.workers import WorkerPool

HAVE_MOONCAKE = importlib.util.find_spec("mooncake") is not None


@pytest.fixture(scope="session")
def pd_pool():
    if not HAVE_MOONCAKE:
        pytest.skip("needs mooncake-transfer-engine-non-cuda (scripts/requirements-cpu.txt)")
    pool = WorkerPool(6)
    yield pool
    pool.close()
