"""STAND-IN torch_npu.op_plugin.atb (tests only)."""
