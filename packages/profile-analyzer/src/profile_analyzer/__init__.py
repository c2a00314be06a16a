"""Where communication is not overlapped: msprof, torch_npu and Kineto profile analysis."""

__version__ = "0.1.0"
