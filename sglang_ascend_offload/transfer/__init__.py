"""Remote device-to-host P/D transfer: decode pulls each prefill layer (seed 000 §5-7).

Engine-agnostic (no sglang import; torch, mooncake and memfabric_hybrid are
imported only where used). Entry points: :class:`.decode_side.DecodeReceiver`,
:class:`.prefill_side.PrefillSender`, :class:`.topology.PDTopology`,
:func:`.engine.create_engine`; the wire format is in :mod:`.protocol`.
See docs/pd_transfer.md.
"""
