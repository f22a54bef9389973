"""SGLang disaggregation (P/D) transfer backends of the plugin."""
