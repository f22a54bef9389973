"""The operator ladder: the contract (``contract``: types and one signature per op),
the rungs (``reference``, ``residency``, ``triton_impls``, ``npu_impls``, ``fused``) and
the registry that selects among them (``registry``), and ``request_union`` (a request's
verify rows sharing one residency step: the union of their top-k). See docs/operators.md.
"""
