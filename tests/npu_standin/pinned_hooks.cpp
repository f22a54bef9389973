// Accelerator hooks of the stand-in `npu` device (tests/npu_standin): the one piece
// Python cannot provide. torch's Python PrivateUse1 hooks bind isAvailable / isBuilt /
// hasPrimaryContext only, so `torch.empty(..., pin_memory=True)`, `t.pin_memory()` and
// `t.is_pinned()` fail with them. These hooks answer the same three questions and add a
// pinned-host allocator: ordinary CPU memory whose blocks are remembered, so
// `is_pinned()` is true exactly for memory allocated as pinned (what a real device's
// page-locked allocator answers) and a host->device copy can say whether its source was.
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <torch/extension.h>

#include <map>
#include <mutex>

namespace {

std::mutex g_mutex;
std::map<const char *, size_t> g_blocks;  // pinned block start -> bytes

void Release(void *ptr)
{
    {
        std::lock_guard<std::mutex> lock(g_mutex);
        g_blocks.erase(static_cast<const char *>(ptr));
    }
    c10::free_cpu(ptr);
}

struct PinnedAllocator final : c10::Allocator {
    c10::DataPtr allocate(size_t bytes) override
    {
        void *ptr = bytes ? c10::alloc_cpu(bytes) : nullptr;
        if (ptr != nullptr) {
            std::lock_guard<std::mutex> lock(g_mutex);
            g_blocks[static_cast<const char *>(ptr)] = bytes;
        }
        return {ptr, ptr, &Release, c10::Device(c10::DeviceType::CPU)};
    }
    c10::DeleterFnPtr raw_deleter() const override { return &Release; }
    void copy_data(void *dest, const void *src, std::size_t count) const override
    {
        default_copy_data(dest, src, count);
    }
};

PinnedAllocator g_allocator;

bool InPinnedBlock(const void *ptr)
{
    auto p = static_cast<const char *>(ptr);
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_blocks.upper_bound(p);
    if (it == g_blocks.begin()) {
        return false;
    }
    --it;
    return p < it->first + it->second;
}

struct Hooks final : at::PrivateUse1HooksInterface {
    bool isBuilt() const override { return true; }
    bool isAvailable() const override { return true; }
    bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
    c10::Allocator *getPinnedMemoryAllocator() const override { return &g_allocator; }
    bool isPinnedPtr(const void *data) const override { return InPinnedBlock(data); }
};

}  // namespace

void install() { at::RegisterPrivateUse1HooksInterface(new Hooks()); }

bool is_pinned_address(int64_t address) { return InPinnedBlock(reinterpret_cast<const void *>(address)); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)
{
    m.def("install", &install, "register the stand-in npu device's accelerator hooks");
    m.def("is_pinned_address", &is_pinned_address, "whether an address lies in a pinned block");
}
