"""Remote device-to-host P/D transfer: decode pulls each prefill layer.

Engine-agnostic (no sglang import; torch, mooncake and memfabric_hybrid are
imported only where used). Entry points: :class:`.decode_side.DecodeReceiver`,
:class:`.prefill_side.PrefillSender`, :class:`.topology.PDTopology`,
:func:`.engine.create_engine`; the wire format is in :mod:`.protocol`. The SGLang backend's engine-agnostic parts:
:class:`.publisher.PrefillPublisher` (prefill side, implemented by
:class:`.prefill_links.PrefillLinks` and :class:`.layerwise_publisher.LayerwisePublisher`),
:class:`.decode_sink.DecodeSink`, :mod:`.advert`, :mod:`.pool_layouts`. Test and
benchmark scaffolding (fault injection, multi-process harness) is in
``sglang_ascend_offload/testing/``. See docs/pd_transfer.md.
"""
