"""Sparse decode offload, engine-agnostic (no sglang import): host KV pool, hot
buffers, residency manager and policies, per-step engine, statistics, traces,
Belady's optimum and trace replay. See ``docs/sparse_decode.md``.

Modules: ``host_pool`` (pool + TP append gate), ``hot_buffer`` (device buffers +
``copy_miss_rows``), ``residency`` (the contract's reference op), ``policies``
(LRU, LRU-2, guarded LRU-2), ``engine``, ``stats``, ``trace``, ``belady``,
``replay``, ``verify``. Nothing is imported here, so importing the package is free.
"""
