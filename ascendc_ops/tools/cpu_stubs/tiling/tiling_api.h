// CPU stand-in for a CANN / torch_npu header: only what ascendc_ops/host uses, so the host code
// compiles and registers on a machine without CANN (tools/host_check_cpu.sh). Launches do nothing.
#pragma once
#include <cstdint>
#include <cstring>
#include "tiling/platform/platform_ascendc.h"
namespace optiling { struct TCubeTiling { int32_t data[64] = {}; uint32_t GetDataSize() const { return sizeof(data); } void SaveToBuffer(void *p, uint32_t n) const { std::memcpy(p, data, n); } }; }
namespace matmul_tiling {
enum class TPosition { GM }; enum class CubeFormat { ND }; enum class DataType { DT_BF16, DT_INT8, DT_FLOAT, DT_INT32 };
class MatmulApiTiling { public: explicit MatmulApiTiling(const platform_ascendc::PlatformAscendC &) {}
  int SetAType(TPosition, CubeFormat, DataType, bool = false) { return 0; }
  int SetBType(TPosition, CubeFormat, DataType, bool = false) { return 0; }
  int SetCType(TPosition, CubeFormat, DataType) { return 0; }
  int SetShape(int, int, int) { return 0; } int SetOrgShape(int, int, int) { return 0; }
  int SetBias(bool) { return 0; } int SetBufferSpace(int, int, int) { return 0; }
  int64_t GetTiling(optiling::TCubeTiling &) { return 0; } };
}
