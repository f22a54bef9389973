"""Speculative decoding (EAGLE / NextN-MTP) with the ``ascend_offload`` backend, and the
CPU graphs of its verify forward."""
