"""STAND-IN (tests only): NPU tensor IPC is not emulated."""


def rebuild_npu_tensor(*args, **kwargs):
    from torch_npu import NotEmulatedError

    raise NotEmulatedError("torch_npu.multiprocessing.reductions.rebuild_npu_tensor is not emulated")
