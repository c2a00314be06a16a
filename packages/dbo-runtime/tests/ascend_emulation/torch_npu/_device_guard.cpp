// STAND-IN (tests only): the emulated NPU's device guard. "npu" (PrivateUse1) devices are CPU memory: one
// stream, nothing to switch; the device index is kept per thread as torch_npu keeps it.
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/alloc_cpu.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/CPUAllocator.h>
#include <torch/extension.h>

namespace {
struct EmulatedNpuGuard final : public c10::impl::DeviceGuardImplInterface {
  static thread_local c10::DeviceIndex current;
  c10::DeviceType type() const override { return c10::DeviceType::PrivateUse1; }
  c10::Device exchangeDevice(c10::Device d) const override {
    auto old = getDevice(); current = d.index(); return old; }
  c10::Device getDevice() const override { return c10::Device(c10::DeviceType::PrivateUse1, current); }
  void setDevice(c10::Device d) const override { current = d.index(); }
  void uncheckedSetDevice(c10::Device d) const noexcept override { current = d.index(); }
  c10::Stream getStream(c10::Device d) const noexcept override {
    return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream getDefaultStream(c10::Device d) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream exchangeStream(c10::Stream s) const noexcept override { return s; }
  c10::DeviceIndex deviceCount() const noexcept override { return 8; }
  void record(void**, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const c10::DeviceIndex) const override {}
};
thread_local c10::DeviceIndex EmulatedNpuGuard::current = 0;
C10_REGISTER_GUARD_IMPL(PrivateUse1, EmulatedNpuGuard);

// The hooks PyTorch asks of an accelerator: "pinned" host memory is plain CPU memory (pin_memory() copies into it).
struct EmulatedNpuHooks final : public at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  bool isPinnedPtr(const void*) const override { return false; }
  c10::Allocator* getPinnedMemoryAllocator() const override { return c10::GetCPUAllocator(); }
  at::Device getDeviceFromPtr(void*) const override { return at::Device(c10::DeviceType::PrivateUse1, 0); }
};

struct RegisterHooks {
  RegisterHooks() { at::RegisterPrivateUse1HooksInterface(new EmulatedNpuHooks()); }
} register_hooks;
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}
