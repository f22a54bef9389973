"""Conformance of the project's calls into NPU-only packages, checked without an NPU.

The plugin reaches ``memfabric_hybrid``, ``memcache_hybrid``, ``torch_npu`` and SGLang's
NPU-side modules lazily, so a wrong attribute or keyword there only fails on an Ascend
node. This package finds those uses in the source (:mod:`.callsites`), checks them
against the real packages (:mod:`.packages`: the installed pybind modules;
:mod:`.torch_npu_schemas`: op schemas extracted from the torch_npu wheel;
:mod:`.sglang_source`: SGLang's installed source, parsed, not imported) and reports
(:mod:`.report`, ``python -m sglang_ascend_offload env --npu-api``).

Nothing here imports torch_npu; the memfabric / memcache modules are imported (they
import on CPU), their drivers are never initialised.
"""

__all__ = ["callsites", "packages", "torch_npu_schemas", "sglang_source", "report"]
