"""STAND-IN torch_npu.multiprocessing (tests only)."""
