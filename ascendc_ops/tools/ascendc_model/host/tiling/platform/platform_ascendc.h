// Functional-model stand-in for CANN's platform_ascendc (host tiling): core counts come
// from the model driver (sao_model_set_cores), the system workspace is the model's.
#pragma once
#include <cstdint>
namespace sao_model_host {
extern uint32_t g_aicCores;
extern uint32_t g_aivCores;
constexpr uint32_t kSysWorkspaceBytes = 64 * 1024;  // = sao_model::kSysWorkspaceBytes
}  // namespace sao_model_host
namespace platform_ascendc {
class PlatformAscendC {
public:
    uint32_t GetCoreNumAic() const { return sao_model_host::g_aicCores; }
    uint32_t GetCoreNumAiv() const { return sao_model_host::g_aivCores; }
    uint32_t GetLibApiWorkSpaceSize() const { return sao_model_host::kSysWorkspaceBytes; }
};
class PlatformAscendCManager {
public:
    static PlatformAscendC *GetInstance()
    {
        static PlatformAscendC p;
        return &p;
    }
};
}  // namespace platform_ascendc
