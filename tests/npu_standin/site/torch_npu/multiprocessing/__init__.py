"""``torch_npu.multiprocessing`` of a stand-in process (SGLang imports its ``reductions``)."""
