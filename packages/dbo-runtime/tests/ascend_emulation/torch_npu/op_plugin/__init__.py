"""STAND-IN torch_npu.op_plugin (tests only)."""
