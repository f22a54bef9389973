"""Host KV pools shared by the ranks of an attention-DP group: a named shared mapping
(``shared``) or MemFabric host memory reached through global addresses
(``npu_memfabric``, with the group's control block in ``group_rendezvous``)."""
