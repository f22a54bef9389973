"""``bench soak`` helpers without servers: the memory breakdown read per process and
the shape-cache bound given to the servers."""

from __future__ import annotations

import os
import sys

import pytest

from sglang_ascend_offload.bench import soak

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_status_breakdown_adds_up_to_rss():
    mb = soak._status_mb(os.getpid())
    assert set(mb) == {"VmRSS", "RssAnon", "RssFile", "RssShmem"}
    assert mb["VmRSS"] > 0
    # VmRSS is the sum of its three parts (the kernel adds them up; rounding to KiB only)
    assert abs(mb["RssAnon"] + mb["RssFile"] + mb["RssShmem"] - mb["VmRSS"]) < 0.01
    assert soak._rss_mb(os.getpid()) == mb["VmRSS"]


def test_status_of_a_gone_process_is_empty():
    assert soak._status_mb(2**22 + 12345) == {}  # above pid_max's default: no such process


def test_cli_defaults_and_validation():
    import argparse

    p = argparse.ArgumentParser()
    soak.add_arguments(p)
    args = p.parse_args([])
    assert args.minutes == 10.0 and args.shape_cache == soak.DEFAULT_SHAPE_CACHE and args.warmup_requests == 100
    assert soak.main(p.parse_args(["--shape-cache", "-1"])) == 2
    assert soak.main(p.parse_args(["--minutes", "0"])) == 2
