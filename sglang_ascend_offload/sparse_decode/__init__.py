"""Sparse decode offload, engine-agnostic (no sglang import): host KV pool, hot
buffers, residency manager and policies, per-step engine, statistics, traces,
Belady's optimum and trace replay. See ``docs/sparse_decode.md``.

Modules: ``host_pool`` (pool + TP append gate), ``hot_buffer`` (device buffers),
``policies`` (the residency policies), ``engine``, ``stats``, ``trace``, ``belady``,
``replay``, ``verify``. The residency contract's types and its reference ops
(``residency_manage``, ``copy_miss_rows``) live in ``ops/contract.py`` and
``ops/residency.py``: this package uses ``ops``, never the other way round.
Nothing is imported here, so importing the package is free.
"""
