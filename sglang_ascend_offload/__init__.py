"""KV-cache offload for DeepSeek-V3.2-style sparse-attention models on Ascend NPUs.

An out-of-tree plugin for SGLang 0.5.23. Everything outside ``sglang_plugin/`` is
engine-agnostic (tensors, layer ids, request rows, byte ranges) and never imports
sglang, torch_npu, memfabric or memcache at import time.
"""

__version__ = "0.1.0"
SUPPORTED_SGLANG_VERSION = "0.5.23"
