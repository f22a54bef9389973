"""Memcache host KV store (``memcache_hybrid``, Ascend deployments).

Pieces:

* :class:`MetaServiceProcess` -- the Memcache meta service, started in a child
  process from an ``mmc-meta.conf`` file (``MMC_META_CONFIG_PATH``). It is a plain
  CPU service: it runs on any Linux machine with ``memcache-hybrid`` installed.
* :class:`MemcacheClient` -- a checked wrapper around
  ``memcache_hybrid.DistributedObjectStore``, configured from an ``mmc-local.conf``
  file (``MMC_LOCAL_CONFIG_PATH``; the protocol from our config overrides the
  file's). The client's data path (``init_bm=True``) needs the Ascend driver.
  Initialisation is checked explicitly: ``init`` must return 0 *and* the client
  must report a local service id, because an uninitialised client still answers
  ``batch_alloc`` with ``[0, ...]`` -- which reads like success but is a null
  address. :meth:`MemcacheClient.batch_alloc` therefore also rejects null addresses.
* :class:`MemcacheHostKVStore` -- the :class:`~.store.HostKVStore` on top:
  batched put/get of multi-part objects ("layers" in Memcache terms) straight
  from/to the physical layer buffers (device: L2G / G2L; host: H2G / G2H), leases
  on loaded prefixes, registration of the layer buffers.

Nothing here imports ``memcache_hybrid`` at module import time.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from sglang_ascend_offload.layerwise_prefill.store import (
    HostKVStore,
    StoreError,
    StoreStats,
    StoreUnavailable,
    parts_nbytes,
)

__all__ = [
    "read_mmc_conf",
    "write_mmc_conf",
    "shipped_config",
    "MetaServiceProcess",
    "MemcacheClient",
    "MemcacheHostKVStore",
    "UNSET_SERVICE_ID",
    "local_config_from_conf",
]

UNSET_SERVICE_ID = 2**32 - 1  # what get_local_service_id() answers before a successful init
_INSTALL_HINT = (
    "install memcache-hybrid (pip install memcache-hybrid memfabric-hybrid) on the "
    "Ascend node, or use store_backend 'local'"
)
_ENV_LOCK = threading.Lock()
_META_MAIN = "import sys, memcache_hybrid as m\nrc = m.MetaService.main()\nsys.exit(int(rc or 0))\n"

# Memcache copy directions (memcache_hybrid.{L2G,G2L,G2H,H2G}); checked against the package.
L2G, G2L, G2H, H2G = 0, 1, 2, 3


def _memcache():
    if importlib.util.find_spec("memcache_hybrid") is None:
        raise StoreUnavailable(f"memcache_hybrid is not installed: {_INSTALL_HINT}")
    try:
        mod = importlib.import_module("memcache_hybrid")
    except Exception as exc:  # noqa: BLE001 - a broken native install
        raise StoreUnavailable(f"memcache_hybrid failed to import ({exc}): {_INSTALL_HINT}") from exc
    got = tuple(int(getattr(mod, n)) for n in ("L2G", "G2L", "G2H", "H2G"))
    if got != (L2G, G2L, G2H, H2G):
        raise StoreUnavailable(
            f"memcache_hybrid copy directions {got} differ from the ones this "
            "plugin was written for; check the memcache-hybrid version"
        )
    return mod


# ------------------------------------------------------------------ config files
def read_mmc_conf(path: str) -> Dict[str, str]:
    """``key = value`` lines of an ``mmc-*.conf`` file (``#`` comments ignored)."""
    items: Dict[str, str] = {}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            text = line.strip()
            if not text or text.startswith("#"):
                continue
            if "=" not in text:
                raise StoreError(f"{path}:{n}: expected 'key = value', got {text!r}")
            key, value = text.split("=", 1)
            items[key.strip()] = value.strip()
    return items


def write_mmc_conf(path: str, items: Dict[str, str]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for key, value in items.items():
            f.write(f"{key} = {value}\n")


def local_config_from_conf(local, conf: Dict[str, str]):
    """Fill a ``memcache_hybrid.LocalConfig`` from ``mmc-local.conf`` items.

    ``ock.mmc.[local_service.]a.b`` maps to the attribute ``a_b`` (e.g.
    ``ock.mmc.local_service.dram.size`` -> ``dram_size``), converted to the
    attribute's type. Keys without such an attribute raise StoreError (all listed).
    """
    unknown = []
    for key, value in conf.items():
        name = key
        for prefix in ("ock.mmc.", "local_service."):
            if name.startswith(prefix):
                name = name[len(prefix) :]
        name = name.replace(".", "_")
        if not hasattr(local, name):
            unknown.append(key)
            continue
        current = getattr(local, name)
        if isinstance(current, bool):
            parsed = value.strip().lower() in ("true", "1", "yes", "on")
        elif isinstance(current, int):
            parsed = int(value)
        else:
            parsed = value
        setattr(local, name, parsed)
    if unknown:
        raise StoreError(
            f"mmc-local.conf keys with no LocalConfig field: {unknown}; remove them "
            "or start the process with MMC_LOCAL_CONFIG_PATH set instead"
        )
    return local


def shipped_config(name: str) -> str:
    """Path of a config file shipped with memcache-hybrid (``mmc-meta.conf`` / ``mmc-local.conf``)."""
    spec = importlib.util.find_spec("memcache_hybrid")
    if spec is None or not spec.submodule_search_locations:
        raise StoreUnavailable(f"memcache_hybrid is not installed: {_INSTALL_HINT}")
    path = os.path.join(list(spec.submodule_search_locations)[0], "config", name)
    if not os.path.exists(path):
        raise StoreUnavailable(f"memcache_hybrid ships no {name}; pass the file explicitly")
    return path


def _tcp_endpoint(url: str, what: str) -> Tuple[str, int]:
    if not url.startswith("tcp://") or ":" not in url[6:]:
        raise StoreError(f"{what} {url!r} must look like tcp://host:port")
    host, port = url[6:].rsplit(":", 1)
    return host, int(port)


# ------------------------------------------------------------------ meta service
class MetaServiceProcess:
    """The Memcache meta service in a child process, configured from ``meta_config``.

    ``stop()`` sends SIGTERM and kills the process after ``stop_grace_s``.
    ``start()`` returns once the service accepts connections on
    ``ock.mmc.meta_service_url`` and raises :class:`StoreUnavailable` (with the tail
    of its log) if it exits or does not listen within ``start_timeout_s``.
    """

    def __init__(self, meta_config: Optional[str] = None, start_timeout_s: float = 30.0, stop_grace_s: float = 10.0):
        self.config_path = meta_config or shipped_config("mmc-meta.conf")
        conf = read_mmc_conf(self.config_path)
        self.url = conf.get("ock.mmc.meta_service_url", "tcp://127.0.0.1:5000")
        self.host, self.port = _tcp_endpoint(self.url, "ock.mmc.meta_service_url")
        self.start_timeout_s = start_timeout_s
        self.stop_grace_s = stop_grace_s  # a clean shutdown takes ~4 s
        self._proc: Optional[subprocess.Popen] = None
        self._log = None

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc else None

    def _log_tail(self) -> str:
        if self._log is None:
            return ""
        self._log.flush()
        with open(self._log.name, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-15:])

    def start(self) -> "MetaServiceProcess":
        _memcache_installed = importlib.util.find_spec("memcache_hybrid") is not None
        if not _memcache_installed:
            raise StoreUnavailable(f"memcache_hybrid is not installed: {_INSTALL_HINT}")
        self._log = tempfile.NamedTemporaryFile("w+", prefix="mmc-meta-", suffix=".log", delete=False)
        env = dict(os.environ, MMC_META_CONFIG_PATH=os.path.abspath(self.config_path))
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _META_MAIN],
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                rc = self._proc.returncode
                raise StoreUnavailable(
                    f"memcache meta service exited with {rc} (config {self.config_path}):\n{self._log_tail()}"
                )
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise StoreUnavailable(
            f"memcache meta service not listening on {self.url} after {self.start_timeout_s:.0f}s:\n{self._log_tail()}"
        )

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=self.stop_grace_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=5)
        self._proc = None
        if self._log is not None:
            self._log.close()
            os.unlink(self._log.name)
            self._log = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ------------------------------------------------------------------ client
class MemcacheClient:
    """``DistributedObjectStore`` that is known to be initialised; every call checked.

    local_config: ``mmc-local.conf`` path (``None`` = the shipped one); protocol:
    overrides ``ock.mmc.local_service.protocol``; init_bm: ``True`` for a client with a
    data path (needs the Ascend driver), ``False`` for a metadata-only client.
    """

    def __init__(
        self,
        local_config: Optional[str] = None,
        protocol: Optional[str] = None,
        device_id: int = 0,
        init_bm: bool = True,
    ):
        mh = _memcache()
        conf = read_mmc_conf(local_config or shipped_config("mmc-local.conf"))
        if protocol:
            conf["ock.mmc.local_service.protocol"] = protocol
        self.meta_url = conf.get("ock.mmc.meta_service_url", "?")
        self.init_bm = init_bm
        self._closed = False
        self._raw = mh.DistributedObjectStore()
        # The library reads MMC_LOCAL_CONFIG_PATH only once, when it is loaded, so the
        # file's settings are passed through LocalConfig + setup() instead.
        local = local_config_from_conf(mh.LocalConfig(), conf)
        rc = self._raw.setup(local)
        if rc != 0:
            raise StoreUnavailable(f"memcache client setup failed (rc={rc}) with {local.str()}")
        rc = self._raw.init(int(device_id), bool(init_bm))
        sid = self._raw.get_local_service_id() if rc == 0 else UNSET_SERVICE_ID
        if rc != 0 or sid == UNSET_SERVICE_ID:
            need = "the Ascend driver (CANN) on this node for the data path (init_bm=True), and " if init_bm else ""
            raise StoreUnavailable(
                f"memcache client init failed (rc={rc}, local service id={sid}) for device "
                f"{device_id}, protocol {conf.get('ock.mmc.local_service.protocol')}: it needs "
                f"{need}a meta service reachable at {self.meta_url}; see the memcache log lines above"
            )
        self.service_id = sid

    def _ok(self):
        if self._closed:
            raise StoreError("memcache client is closed")
        return self._raw

    @staticmethod
    def _check_codes(op: str, keys: Sequence[str], codes: Sequence[int]) -> None:
        bad = [(k, c) for k, c in zip(keys, codes) if c != 0]
        if bad or len(codes) != len(keys):
            raise StoreError(
                f"memcache {op} failed for {len(bad)}/{len(keys)} key(s), e.g. {bad[:3]}"
                + ("" if len(codes) == len(keys) else f" ({len(codes)} results)")
            )

    def batch_alloc(
        self, keys: Sequence[str], sizes: Sequence[int], media: int = 1, lease_ttl_ms: int = 0
    ) -> List[int]:
        """Allocate objects; their global addresses. A 0 address (what a storage-less or
        uninitialised client answers) raises StoreError."""
        addrs = list(self._ok().batch_alloc(list(keys), [int(s) for s in sizes], media, lease_ttl_ms))
        null = [k for k, a in zip(keys, addrs) if not a]
        if null or len(addrs) != len(keys):
            raise StoreError(
                f"memcache batch_alloc returned null addresses for {len(null)}/"
                f"{len(keys)} key(s), e.g. {null[:3]} (no storage behind the client?)"
            )
        return addrs

    def exists(self, keys: Sequence[str]) -> List[bool]:
        codes = list(self._ok().batch_is_exist(list(keys)))
        bad = [(k, c) for k, c in zip(keys, codes) if c not in (0, 1)]
        if bad:
            raise StoreError(f"memcache batch_is_exist failed, e.g. {bad[:3]}")
        return [c == 1 for c in codes]

    def put_layers(self, keys, ptrs, sizes, direct: int) -> None:
        self._check_codes(
            "batch_put_from_layers", keys, list(self._ok().batch_put_from_layers(list(keys), ptrs, sizes, direct))
        )

    def get_layers(self, keys, ptrs, sizes, direct: int) -> None:
        self._check_codes(
            "batch_get_into_layers", keys, list(self._ok().batch_get_into_layers(list(keys), ptrs, sizes, direct))
        )

    def add_lease(self, keys: Sequence[str], ttl_ms: int) -> None:
        self._check_codes("batch_add_lease", keys, list(self._ok().batch_add_lease(list(keys), ttl_ms)))

    def remove_lease(self, keys: Sequence[str]) -> None:
        rc = self._ok().batch_remove_lease(list(keys))
        if rc != 0:
            raise StoreError(f"memcache batch_remove_lease failed: {rc}")

    def register(self, ptr: int, nbytes: int) -> None:
        rc = self._ok().register_buffer(ptr, nbytes)
        if rc != 0:
            raise StoreError(f"memcache register_buffer({ptr:#x}, {nbytes}) failed: {rc}")

    def unregister(self, ptr: int, nbytes: int) -> None:
        self._ok().unregister_buffer(ptr, nbytes)

    def remove(self, keys: Sequence[str]) -> None:
        self._ok().remove_batch(list(keys))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._raw.close()


# ------------------------------------------------------------------ store
class MemcacheHostKVStore(HostKVStore):
    """Host KV pool in Memcache. ``cfg`` is a :class:`~sglang_ascend_offload.config.MemcacheConfig`."""

    name = "memcache"

    def __init__(self, cfg, device_id: Optional[int] = None, client: Optional[MemcacheClient] = None):
        self.cfg = cfg
        self.meta: Optional[MetaServiceProcess] = None
        if cfg.start_meta_service and client is None:
            self.meta = MetaServiceProcess(cfg.meta_config).start()
        try:
            dev = device_id if device_id is not None else (cfg.device_id or 0)
            self.client = client or MemcacheClient(cfg.local_config, cfg.protocol, dev, init_bm=True)
        except BaseException:
            if self.meta:
                self.meta.stop()
            raise
        self._registered: List[Tuple[int, int]] = []
        self._stats = StoreStats()
        self._lock = threading.Lock()

    @staticmethod
    def _layout(keys, parts, host_dir: int, dev_dir: int):
        if len(keys) != len(parts):
            raise StoreError(f"{len(keys)} keys but {len(parts)} part lists")
        ptrs, sizes, kinds = [], [], set()
        for key, ps in zip(keys, parts):
            if any(not p.is_contiguous() for p in ps):
                raise StoreError(f"key {key}: parts must be contiguous")
            ptrs.append([p.data_ptr() for p in ps])
            sizes.append([p.numel() * p.element_size() for p in ps])
            kinds |= {p.device.type == "cpu" for p in ps}
        if len(kinds) > 1:
            raise StoreError("one batch mixes host and device tensors; split it")
        direct = host_dir if kinds == {True} else dev_dir
        return ptrs, sizes, direct

    def exists(self, keys: Sequence[str]) -> List[bool]:
        return self.client.exists(keys) if keys else []

    def put(self, keys: Sequence[str], parts: Sequence[Sequence[torch.Tensor]]) -> None:
        if not keys:
            return
        present = self.client.exists(keys)
        todo = [(k, p) for k, p, e in zip(keys, parts, present) if not e]
        if todo:
            ks, ps = [k for k, _ in todo], [p for _, p in todo]
            ptrs, sizes, direct = self._layout(ks, ps, H2G, L2G)
            self.client.put_layers(ks, ptrs, sizes, direct)
        with self._lock:
            self._stats.puts += len(todo)
            self._stats.skipped_existing += len(keys) - len(todo)
            self._stats.bytes_put += sum(parts_nbytes(p) for _, p in todo)

    def get_into(self, keys: Sequence[str], parts: Sequence[Sequence[torch.Tensor]]) -> None:
        if not keys:
            return
        ptrs, sizes, direct = self._layout(keys, parts, G2H, G2L)
        self.client.get_layers(keys, ptrs, sizes, direct)
        with self._lock:
            self._stats.gets += len(keys)
            self._stats.bytes_got += sum(parts_nbytes(p) for p in parts)

    def add_lease(self, keys: Sequence[str], ttl_ms: int) -> None:
        if keys:
            self.client.add_lease(keys, ttl_ms or self.cfg.lease_ttl_ms)

    def remove_lease(self, keys: Sequence[str]) -> None:
        if keys:
            self.client.remove_lease(keys)

    def register(self, tensors: Sequence[torch.Tensor]) -> None:
        for t in tensors:
            region = (t.data_ptr(), t.numel() * t.element_size())
            self.client.register(*region)
            self._registered.append(region)

    def remove(self, keys: Sequence[str]) -> None:
        if keys:
            self.client.remove(keys)

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(**vars(self._stats))

    def close(self) -> None:
        for ptr, n in self._registered:
            try:
                self.client.unregister(ptr, n)
            except StoreError:
                pass
        self._registered = []
        self.client.close()
        if self.meta:
            self.meta.stop()
            self.meta = None
