"""``torch_npu.multiprocessing.reductions`` of a stand-in process: the names SGLang's
import path binds (``sglang/srt/utils/patch_torch.py``). Sharing npu tensors or events
between processes through IPC handles is not modelled: each refuses when called."""

__all__ = ["rebuild_npu_event", "rebuild_npu_tensor"]


def _refuse(name: str):
    raise NotImplementedError(
        f"torch_npu.multiprocessing.reductions.{name}: the npu stand-in does not model IPC sharing of npu "
        "tensors (tests/npu_standin)"
    )


def rebuild_npu_event(device, handle):
    _refuse("rebuild_npu_event")


def rebuild_npu_tensor(*args, **kwargs):
    _refuse("rebuild_npu_tensor")
