// CPU stand-in for a CANN / torch_npu header: only what ascendc_ops/host uses, so the host code
// compiles and registers on a machine without CANN (tools/host_check_cpu.sh). Launches do nothing.
#pragma once
#include <cstdint>
#include "acl/acl.h"
#ifndef ACLRT_LAUNCH_KERNEL
#define ACLRT_LAUNCH_KERNEL(name) aclrtlaunch_##name
#endif
template <typename... A> inline uint32_t aclrtlaunch_sao_copy_miss_rows(uint32_t, aclrtStream, A...) { return 0; }
