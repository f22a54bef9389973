"""The operator ladder: the contract (``contract``: types and one signature per op),
the rungs (``reference``, ``residency``, ``triton_impls``, ``npu_impls``, ``fused``) and
the registry that selects among them (``registry``). See docs/operators.md.
"""
