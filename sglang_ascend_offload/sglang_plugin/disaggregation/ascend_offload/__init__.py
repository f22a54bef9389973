"""SGLang disaggregation transfer backend ``ascend_offload`` (P/D over the project's protocol).

``--disaggregation-mode prefill|decode --disaggregation-transfer-backend ascend_offload
--enable-pd-transfer [--pd-transfer-config JSON|@file]`` makes SGLang's P/D servers move
the prompt's KV with :mod:`sglang_ascend_offload.transfer` (decode pulls every layer:
main KV straight into its sparse-decode host pool when decode offload is on, else into
its device pool; the indexer into its device index-K cache), with that package's
handshake, per-layer gates, deadlines, bounded read retries and verdicts. SGLang's
own Common/Mooncake control plane keeps doing what is not KV: bootstrap, request
metadata (destination pages), the first-token aux data and terminal status.

Modules:

============  ===================================================================
``install``   registration with SGLang (choices, resolution step, HookRegistry hooks)
``rules``     startup rules and the runtime pair check (``config.violations`` rules)
``conn``      SGLang's manager / sender / receiver / bootstrap-server classes
============  ===================================================================

The SGLang-free parts live in :mod:`sglang_ascend_offload.transfer`: ``advert`` (the
decode advert carried in SGLang's registration message), ``pool_layouts``
(:class:`~sglang_ascend_offload.transfer.protocol.KVLayout` of the pools, packing
staging), ``publisher`` (the prefill publisher interface) with its two
implementations ``prefill_links`` (device pool: one worker per decode peer) and
``layerwise_publisher`` (layerwise prefill pool: published during the forward), and
``decode_sink`` (decode side: the rank's ``DecodeReceiver`` and per-request states).

See docs/pd_transfer.md ("SGLang backend").
"""
