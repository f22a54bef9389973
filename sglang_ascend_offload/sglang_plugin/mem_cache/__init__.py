"""KV memory: the device pools (``pool/``, one module per feature), the host pools they
read from (``pool_host/``), the cell-size and budget hooks that let SGLang's memory
profile see each feature's footprint (``sizing/``), and retraction backups."""
