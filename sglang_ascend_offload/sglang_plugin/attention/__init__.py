"""The ``ascend_offload`` attention backend: DSA attention (MLA + indexer + top-k), its
per-forward metadata, the plain-torch indexer of the CPU path, and the backend with
sparse decode offload on."""
