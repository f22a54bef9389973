// CPU stand-in for a CANN / torch_npu header: only what ascendc_ops/host uses, so the host code
// compiles and registers on a machine without CANN (tools/host_check_cpu.sh). Launches do nothing.
#pragma once
#include <cstdint>
namespace platform_ascendc {
class PlatformAscendC { public: uint32_t GetCoreNumAic() const { return 24; } uint32_t GetCoreNumAiv() const { return 48; } uint32_t GetLibApiWorkSpaceSize() const { return 16u << 20; } };
class PlatformAscendCManager { public: static PlatformAscendC *GetInstance() { static PlatformAscendC p; return &p; } };
}
