// CPU stand-in for a CANN / torch_npu header: only what ascendc_ops/host uses, so the host code
// compiles and registers on a machine without CANN (tools/host_check_cpu.sh). Launches do nothing.
#pragma once
#include <cstdint>
#include <cstddef>
typedef int aclError;
typedef void *aclrtStream;
#define ACL_SUCCESS 0
typedef enum { ACL_HOST_REGISTER_MAPPED = 0 } aclrtHostRegisterType;
inline aclError aclrtHostRegister(void *ptr, uint64_t, aclrtHostRegisterType, void **dev) { *dev = ptr; return 0; }
