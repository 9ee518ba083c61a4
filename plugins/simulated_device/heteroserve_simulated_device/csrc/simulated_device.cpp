// A simulated accelerator: torch's PrivateUse1 device type backed by host memory.
//
// Tensors on it are a device of their own (`sim`): torch refuses to mix them with CPU tensors in one operator, as
// it does for an NPU or a GPU, so code that leaves a tensor on the host is caught. Memory comes from our
// allocator (counted, so a test can see what the model placed on the device); the device guard, generators and
// the views, copies and resizes that only touch a tensor's metadata or storage are our own; every other operator
// runs through one boxed fallback that reads the arguments as CPU tensors over the same memory, runs the CPU
// kernel and hands the results back as device tensors.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/Allocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

namespace {

constexpr c10::DeviceType kDevice = c10::DeviceType::PrivateUse1;
constexpr c10::DeviceIndex kDeviceCount = 8;  // enough for one process per rank of tp x pp on one host

thread_local c10::DeviceIndex current_device = 0;
std::atomic<int64_t> allocated_bytes{0};
std::atomic<int64_t> peak_bytes{0};

struct Block {
  size_t bytes;
};

void free_block(void* context) {
  auto* block = static_cast<Block*>(context);
  allocated_bytes -= static_cast<int64_t>(block->bytes);
  std::free(block);
}

// Each allocation carries its size in a header before the data, so the deleter can count it down.
constexpr size_t kHeader = 64;

struct HostMemoryAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t bytes) override {
    c10::Device device(kDevice, current_device);
    if (bytes == 0) {
      return {nullptr, nullptr, &c10::detail::deleteNothing, device};
    }
    size_t rounded = (bytes + kHeader - 1) / kHeader * kHeader;
    void* raw = std::aligned_alloc(kHeader, kHeader + rounded);
    TORCH_CHECK(raw != nullptr, "the simulated device could not allocate ", bytes, " bytes");
    auto* block = static_cast<Block*>(raw);
    block->bytes = rounded;
    int64_t now = allocated_bytes += static_cast<int64_t>(rounded);
    int64_t peak = peak_bytes.load();
    while (now > peak && !peak_bytes.compare_exchange_weak(peak, now)) {
    }
    return {static_cast<char*>(raw) + kHeader, raw, &free_block, device};
  }

  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }

  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
};

HostMemoryAllocator host_memory;

struct SimulatedGuard final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kDevice; }

  c10::Device exchangeDevice(c10::Device device) const override {
    c10::Device previous = getDevice();
    setDevice(device);
    return previous;
  }

  c10::Device getDevice() const override { return c10::Device(kDevice, current_device); }

  void setDevice(c10::Device device) const override {
    TORCH_CHECK(device.type() == kDevice, "not a simulated device: ", device);
    TORCH_CHECK(device.index() < kDeviceCount, "the simulated device has ", int(kDeviceCount), " devices");
    if (device.index() >= 0) {
      current_device = device.index();
    }
  }

  void uncheckedSetDevice(c10::Device device) const noexcept override {
    if (device.index() >= 0) {
      current_device = device.index();
    }
  }

  c10::Stream getStream(c10::Device device) const override { return c10::Stream(c10::Stream::DEFAULT, device); }

  c10::Stream exchangeStream(c10::Stream stream) const override { return stream; }

  c10::DeviceIndex deviceCount() const noexcept override { return kDeviceCount; }

  void synchronizeDevice(c10::DeviceIndex) const override {}
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, SimulatedGuard);

// A CPU generator that says it belongs to the device, so `torch.Generator("sim")` works; the fallback lends its
// state to a CPU generator around a random operator.
struct SimulatedGenerator final : at::CPUGeneratorImpl {
  explicit SimulatedGenerator(c10::DeviceIndex index) : at::CPUGeneratorImpl(c10::detail::getNonDeterministicRandom()) {
    device_ = c10::Device(kDevice, index);
    key_set_ = c10::DispatchKeySet(c10::DispatchKey::PrivateUse1);
  }
};

struct SimulatedHooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return kDeviceCount; }
  c10::DeviceIndex getCurrentDevice() const override { return current_device; }
  void setCurrentDevice(c10::DeviceIndex device) const override { current_device = device; }

  const at::Generator& getDefaultGenerator(c10::DeviceIndex index) const override {
    static std::vector<at::Generator> generators = [] {
      std::vector<at::Generator> all;
      for (c10::DeviceIndex i = 0; i < kDeviceCount; ++i) {
        all.push_back(at::make_generator<SimulatedGenerator>(i));
      }
      return all;
    }();
    return generators.at(index < 0 ? current_device : index);
  }

  at::Generator getNewGenerator(c10::DeviceIndex index) const override {
    return at::make_generator<SimulatedGenerator>(index < 0 ? current_device : index);
  }

  at::Device getDeviceFromPtr(void*) const override { return c10::Device(kDevice, current_device); }

  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t bytes) const override {
    c10::DataPtr fresh = host_memory.allocate(bytes);
    size_t keep = std::min(bytes, storage.nbytes());
    if (keep > 0) {
      std::memcpy(fresh.get(), storage.data(), keep);
    }
    storage.unsafeGetStorageImpl()->set_data_ptr_noswap(std::move(fresh));
    storage.unsafeGetStorageImpl()->set_nbytes(bytes);
  }
};

SimulatedHooks hooks;

// --- operators that only touch metadata or storage ----------------------------------------------------------------

at::Tensor empty_memory_format(
    c10::IntArrayRef size,
    std::optional<at::ScalarType> dtype,
    std::optional<at::Layout> layout,
    std::optional<at::Device> device,
    std::optional<bool> pin_memory,
    std::optional<at::MemoryFormat> memory_format) {
  c10::OptionalDeviceGuard device_guard(device);
  return at::detail::empty_generic(
      size, &host_memory, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), c10::dtype_or_default(dtype),
      memory_format);
}

at::Tensor empty_strided(
    c10::IntArrayRef size,
    c10::IntArrayRef stride,
    std::optional<at::ScalarType> dtype,
    std::optional<at::Layout> layout,
    std::optional<at::Device> device,
    std::optional<bool> pin_memory) {
  c10::OptionalDeviceGuard device_guard(device);
  return at::detail::empty_strided_generic(
      size, stride, &host_memory, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), c10::dtype_or_default(dtype));
}

// The same memory read as a CPU tensor: what the fallback hands to the CPU kernels. The storage does not own the
// memory; a CPU kernel that resizes it gets fresh CPU memory, which the fallback copies back.
at::Tensor host_view(const at::Tensor& tensor) {
  const c10::Storage& storage = tensor.storage();
  c10::Storage host(
      c10::Storage::use_byte_size_t(), storage.nbytes(),
      c10::DataPtr(const_cast<void*>(storage.data()), c10::Device(c10::kCPU)), c10::GetAllocator(c10::kCPU),
      /*resizable=*/true);
  at::Tensor view = at::empty({0}, tensor.options().device(c10::kCPU));
  view.set_(host, tensor.storage_offset(), tensor.sizes(), tensor.strides());
  return view;
}

const at::Tensor& resize_(
    const at::Tensor& self, c10::IntArrayRef size, std::optional<at::MemoryFormat> memory_format) {
  int64_t elements = 1;
  for (int64_t s : size) {
    elements *= s;
  }
  auto* impl = self.unsafeGetTensorImpl();
  impl->set_sizes_contiguous(size);
  size_t needed = static_cast<size_t>((self.storage_offset() + elements) * self.element_size());
  if (needed > self.storage().nbytes()) {
    hooks.resizePrivateUse1Bytes(self.storage(), needed);
  }
  if (memory_format.has_value() && *memory_format != at::MemoryFormat::Preserve) {
    impl->empty_tensor_restride(*memory_format);
  }
  return self;
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  at::Tensor source = self.is_cpu() ? self : host_view(self);
  at::Tensor target = dst.is_cpu() ? dst : host_view(dst);
  target.copy_(source, non_blocking);
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  if (!dst.sizes().equals(self.sizes())) {
    if (dst.is_cpu()) {
      dst.resize_(self.sizes());
    } else {
      resize_(dst, self.sizes(), std::nullopt);
    }
  }
  return copy_from(self, dst, false);
}

at::Tensor& set_storage(
    at::Tensor& self, c10::Storage source, int64_t offset, c10::IntArrayRef size, c10::IntArrayRef stride) {
  auto* impl = self.unsafeGetTensorImpl();
  impl->set_storage_keep_dtype(std::move(source));
  impl->set_sizes_and_strides(size, stride, offset);
  return self;
}

at::Tensor& set_source_tensor(at::Tensor& self, const at::Tensor& source) {
  return set_storage(self, source.storage(), source.storage_offset(), source.sizes(), source.strides());
}

at::Tensor& set_empty(at::Tensor& self) {
  c10::Storage empty(c10::Storage::use_byte_size_t(), 0, host_memory.allocate(0), &host_memory, true);
  return set_storage(self, empty, 0, {0}, {1});
}

// --- everything else: the CPU kernel over the same memory ---------------------------------------------------------

bool copies_between_devices(const c10::OperatorHandle& op) {
  const std::string& name = op.schema().name();
  return name == "aten::copy_" || name == "aten::_copy_from" || name == "aten::_copy_from_and_resize" ||
         name == "aten::_to_copy";
}

at::Tensor to_host(const at::Tensor& tensor, const c10::OperatorHandle& op, bool mixing_allowed) {
  if (!tensor.defined()) {
    return tensor;
  }
  if (tensor.device().type() == kDevice) {
    return host_view(tensor);
  }
  // A CPU scalar (zero dimensions) may join a device operator, as torch allows for CUDA.
  TORCH_CHECK(
      mixing_allowed || tensor.dim() == 0 || !tensor.is_cpu(),
      "Expected all tensors to be on the same device, but found at least two devices, sim:", int(current_device),
      " and cpu! (in ", op.schema().name(), ")");
  return tensor;
}

at::Tensor to_device(const at::Tensor& result) {
  if (!result.defined() || !result.is_cpu()) {
    return result;
  }
  at::Tensor moved = empty_strided(result.sizes(), result.strides(), result.scalar_type(), std::nullopt,
                                   c10::Device(kDevice, current_device), std::nullopt);
  if (result.numel() > 0) {
    host_view(moved).copy_(result);
  }
  return moved;
}

void run_on_host(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const c10::FunctionSchema& schema = op.schema();
  const size_t argument_count = schema.arguments().size();
  const size_t first = stack->size() - argument_count;
  const bool mixing_allowed = copies_between_devices(op);

  std::vector<at::Tensor> device_arguments(argument_count);   // each tensor argument as the caller passed it
  std::vector<at::Tensor> host_arguments(argument_count);     // and as the CPU kernel sees it
  std::vector<std::pair<at::Generator, at::Generator>> lent;  // (device generator, CPU stand-in)
  for (size_t i = 0; i < argument_count; ++i) {
    c10::IValue& value = (*stack)[first + i];
    if (value.isTensor()) {
      device_arguments[i] = value.toTensor();
      host_arguments[i] = to_host(device_arguments[i], op, mixing_allowed);
      value = host_arguments[i];
    } else if (value.isTensorList()) {
      c10::List<at::Tensor> host;
      for (const at::Tensor& t : value.toTensorList()) {
        host.push_back(to_host(t, op, mixing_allowed));
      }
      value = host;
    } else if (value.isOptionalTensorList()) {
      c10::List<std::optional<at::Tensor>> host;
      for (const std::optional<at::Tensor>& t : value.toOptionalTensorList()) {
        host.push_back(t.has_value() ? std::optional<at::Tensor>(to_host(*t, op, mixing_allowed)) : std::nullopt);
      }
      value = host;
    } else if (value.isDevice() && value.toDevice().type() == kDevice) {
      value = c10::IValue(c10::Device(c10::kCPU));
    } else if (value.isGenerator() && value.toGenerator().device().type() == kDevice) {
      at::Generator device_generator = value.toGenerator();
      at::Generator stand_in = at::make_generator<at::CPUGeneratorImpl>();
      {
        std::lock_guard<std::mutex> lock(device_generator.mutex());
        stand_in.set_state(device_generator.get_state());
      }
      lent.emplace_back(device_generator, stand_in);
      value = c10::IValue(stand_in);
    }
  }

  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);

  for (auto& [device_generator, stand_in] : lent) {
    std::lock_guard<std::mutex> lock(device_generator.mutex());
    device_generator.set_state(stand_in.get_state());
  }
  // A mutated argument whose CPU kernel resized it into fresh CPU memory: the device tensor takes that shape and data.
  for (size_t i = 0; i < argument_count; ++i) {
    const auto& alias = schema.arguments()[i].alias_info();
    const at::Tensor& device_tensor = device_arguments[i];
    if (alias == nullptr || !alias->isWrite() || !device_tensor.defined() || device_tensor.is_cpu()) {
      continue;
    }
    const at::Tensor& host = host_arguments[i];
    if (host.storage().data() != device_tensor.storage().data() || !host.sizes().equals(device_tensor.sizes())) {
      resize_(device_tensor, host.sizes(), std::nullopt);
      device_tensor.unsafeGetTensorImpl()->set_sizes_and_strides(host.sizes(), host.strides(), device_tensor.storage_offset());
      host_view(device_tensor).copy_(host);
    }
  }

  const size_t return_count = schema.returns().size();
  const size_t results = stack->size() - return_count;
  for (size_t r = 0; r < return_count; ++r) {
    c10::IValue& value = (*stack)[results + r];
    const auto& alias = schema.returns()[r].alias_info();
    if (alias != nullptr && value.isTensor()) {
      // The result is (a view of) an argument: the same view of the device tensor.
      for (size_t i = 0; i < argument_count; ++i) {
        const auto& argument_alias = schema.arguments()[i].alias_info();
        if (argument_alias != nullptr && argument_alias->beforeSets() == alias->beforeSets() &&
            device_arguments[i].defined() && !device_arguments[i].is_cpu()) {
          const at::Tensor& result = value.toTensor();
          value = alias->isWrite() ? device_arguments[i]
                                   : device_arguments[i].as_strided(result.sizes(), result.strides(),
                                                                    result.storage_offset());
          break;
        }
      }
    } else if (value.isTensor()) {
      value = to_device(value.toTensor());
    } else if (value.isTensorList()) {
      c10::List<at::Tensor> moved;
      for (const at::Tensor& t : value.toTensorList()) {
        moved.push_back(to_device(t));
      }
      value = moved;
    }
  }
}

}  // namespace

REGISTER_ALLOCATOR(kDevice, &host_memory)

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("as_strided", at::native::as_strided_tensorimpl);
  m.impl("view", at::native::view);
  m.impl("_reshape_alias", at::native::_reshape_alias);
  m.impl("resize_", resize_);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("set_.source_Storage_storage_offset", set_storage);
  m.impl("set_.source_Tensor", set_source_tensor);
  m.impl("set_", set_empty);
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&run_on_host>());
}

extern "C" {
// Read from Python through ctypes: the device's allocated and peak bytes.
int64_t heteroserve_simulated_allocated_bytes() { return allocated_bytes.load(); }
int64_t heteroserve_simulated_peak_bytes() { return peak_bytes.load(); }
void heteroserve_simulated_register_hooks() { at::RegisterPrivateUse1HooksInterface(&hooks); }
int heteroserve_simulated_current_device() { return current_device; }
void heteroserve_simulated_set_device(int index) { SimulatedGuard().setDevice(c10::Device(kDevice, index)); }
int heteroserve_simulated_device_count() { return kDeviceCount; }
void heteroserve_simulated_manual_seed_all(uint64_t seed) {
  for (c10::DeviceIndex i = 0; i < kDeviceCount; ++i) {
    at::Generator generator = hooks.getDefaultGenerator(i);
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_current_seed(seed);
  }
}
}
