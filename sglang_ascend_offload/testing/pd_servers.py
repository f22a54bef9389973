"""P/D serving scaffolding shared by the served P/D tests and ``bench transfer --served``.

* launch settings of the CPU P/D servers with the tiny DSA fixture: :data:`COMMON`,
  :func:`pd_config_json`, :func:`prefill_args`, :func:`decode_args`, :data:`LAYERWISE`;
* :class:`PDRouter`: SGLang's router in PD mode (``python -m
  sglang_router.launch_router --pd-disaggregation``) on reserved ports, in its own
  session (stopped as a process group); a bind failure in its log is a
  :class:`~.servers.PortInUse` within a second, not a timeout.

Scaffolding only: runtime modules never import this package.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, List, Optional, Sequence

from .ports import log_reports_bind_failure, release_ports, reserve_port
from .servers import REPO, PortInUse, server_env, stop_process_group

__all__ = ["COMMON", "LAYERWISE", "pd_config_json", "prefill_args", "decode_args", "PDRouter", "logprobs_float32"]

#: Chunked prefill with the same chunk size everywhere (so a colocated reference computes
#: identically): prompts longer than 128 tokens reach the prefill sender in two chunks.
COMMON = ["--max-running-requests", "4", "--chunked-prefill-size", "128"]

#: Layerwise prefill offload with one shared buffer for every reusable layer.
LAYERWISE = json.dumps({"shared_buffers": 1, "independent_layers": [], "store_backend": "local", "wait_timeout_s": 60})


def pd_config_json(kv_port: int) -> str:
    """``--pd-transfer-config`` of a CPU P/D server (Mooncake over TCP on 127.0.0.1)."""
    return json.dumps(
        {
            "engine": "mooncake",
            "kv_port": kv_port,
            "host": "127.0.0.1",
            "layer_timeout_s": 20,
            "handshake_timeout_s": 30,
        }
    )


def prefill_args(bootstrap_port: int, kv_port: int, layerwise: bool = False) -> List[str]:
    """Server arguments of a P/D prefill server (``layerwise``: with layerwise prefill offload)."""
    args = COMMON + [
        "--disaggregation-mode",
        "prefill",
        "--disaggregation-transfer-backend",
        "ascend_offload",
        "--disaggregation-bootstrap-port",
        str(bootstrap_port),
        "--enable-pd-transfer",
        "--pd-transfer-config",
        pd_config_json(kv_port),
    ]
    if layerwise:
        args += ["--enable-layerwise-prefill-offload", "--layerwise-prefill-offload-config", LAYERWISE]
    return args


def decode_args(kv_port: int, offload: bool = False, residency: str = "always", **offload_config: Any) -> List[str]:
    """Server arguments of a P/D decode server (``offload``: with sparse decode offload,
    64 hot slots and ``residency``; ``offload_config`` adds or overrides config keys,
    e.g. ``hot_tokens=256`` for the trained checkpoint's top-k 64 x 4 verify rows)."""
    args = COMMON + [
        "--disaggregation-mode",
        "decode",
        "--disaggregation-transfer-backend",
        "ascend_offload",
        "--disaggregation-decode-retraction-backup",
        "cpu_tensor",
        "--enable-pd-transfer",
        "--pd-transfer-config",
        pd_config_json(kv_port),
    ]
    if offload:
        config = {"hot_tokens": 64} if residency == "always" else {"hot_tokens": 64, "residency": residency}
        config.update(offload_config)
        args += ["--enable-sparse-decode-offload", "--sparse-decode-offload-config", json.dumps(config)]
    return args


def logprobs_float32(out: dict) -> List[tuple]:
    """A ``/generate`` answer's output ``(logprob, token)`` pairs with each logprob as the
    server computed it (float32): SGLang's router re-encodes the JSON, which may move a
    float64 by one unit in its last place."""
    import numpy as np

    return [(float(np.float32(lp)), tok) for lp, tok, *_ in out["meta_info"]["output_token_logprobs"]]


class PDRouter:
    """SGLang's router in PD mode in front of one prefill and one decode server."""

    def __init__(self, prefill_url: str, bootstrap_port: int, decode_url: str, log_path: Path):
        self.prefill_url, self.bootstrap_port, self.decode_url = prefill_url, bootstrap_port, decode_url
        self.log_path = Path(log_path)
        self.port = reserve_port()
        self.metrics_port = reserve_port()
        self.proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "PDRouter":
        args = [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--pd-disaggregation",
            "--prefill",
            self.prefill_url,
            str(self.bootstrap_port),
            "--decode",
            self.decode_url,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(self.metrics_port),
        ]
        self.proc = subprocess.Popen(
            args,
            stdout=open(self.log_path, "wb"),
            stderr=subprocess.STDOUT,
            env=server_env(),
            cwd=REPO,
            start_new_session=True,
        )
        return self

    def generate(
        self, input_ids: Sequence[int], max_new_tokens: int = 8, timeout: float = 120.0, return_logprob: bool = False
    ) -> Any:
        """Greedy ``/generate`` through the router (``ignore_eos``); the JSON answer."""
        body = {
            "input_ids": list(input_ids),
            "return_logprob": return_logprob,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
        }
        req = urllib.request.Request(
            f"{self.url}/generate", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def wait_ready(self, probe: Sequence[int], deadline: float) -> None:
        """Until a one-token request for ``probe`` goes through (the router adds its workers
        in the background: 503 means not yet). ``deadline``: ``time.monotonic()`` value."""
        while True:
            if (
                log_reports_bind_failure(self.log_path.read_text(errors="replace"), [self.port, self.metrics_port])
                is not None
            ):
                raise PortInUse(f"router port {self.port} in use; log: {self.log_path}")
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited with {self.proc.returncode}; log: {self.log_path}")
            try:
                self.generate(probe, max_new_tokens=1, timeout=60)
                return
            except (urllib.error.HTTPError, urllib.error.URLError, ConnectionError, OSError) as exc:
                if isinstance(exc, urllib.error.HTTPError) and exc.code != 503:
                    raise
                if time.monotonic() > deadline:
                    raise TimeoutError(f"router not ready; log: {self.log_path}") from exc
                time.sleep(1.0)

    def stop(self) -> None:
        stop_process_group(self.proc, grace_s=10)
        if self.proc is None or self.proc.poll() is not None:
            release_ports([self.port, self.metrics_port])
