"""Server arguments: the plugin's flags, how their configuration reaches every SGLang
process, the deployment facts read from SGLang's resolved arguments, and the startup
rules that accept or refuse a deployment (``rules/``, one module per feature)."""
