"""SGLang token-to-KV pools, one module per feature; ``device`` is the plain device
layout the others extend."""
