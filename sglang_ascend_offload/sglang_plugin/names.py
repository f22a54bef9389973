"""The name the plugin registers its attention backend under with SGLang.

One home for it, below every other plugin module (this module imports nothing): the
backend registers itself under it, and the startup rules, resolution steps, pool and
speculative hooks compare SGLang's selected backend against it without importing the
backend (and with it torch and SGLang's attention layers).
"""

from __future__ import annotations

__all__ = ["BACKEND_NAME"]

BACKEND_NAME = "ascend_offload"  # --attention-backend ascend_offload
