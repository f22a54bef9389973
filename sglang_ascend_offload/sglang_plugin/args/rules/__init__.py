"""SGLang-side startup rules, one module per feature (the engine-agnostic rules live in
:mod:`sglang_ascend_offload.config`)."""
