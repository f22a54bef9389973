// CPU stand-in for a CANN / torch_npu header: only what ascendc_ops/host uses, so the host code
// compiles and registers on a machine without CANN (tools/host_check_cpu.sh). Launches do nothing.
#pragma once
#include "acl/acl.h"
namespace c10_npu { struct NPUStream { aclrtStream stream(bool = true) const { return nullptr; } }; inline NPUStream getCurrentNPUStream() { return {}; } }
