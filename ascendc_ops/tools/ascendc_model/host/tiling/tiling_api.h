// Functional-model stand-in for CANN's Matmul tiling API (host tiling): records the shape
// given to SetShape and saves it in the leading fields of the toolkit's TCubeTiling layout
// (usedCoreNum, M, N, Ka, Kb), which is all the kernel-side Matmul model reads.
#pragma once
#include <cstdint>
#include <cstring>
#include "tiling/platform/platform_ascendc.h"
namespace optiling {
struct TCubeTiling {
    int32_t data[64] = {};
    uint32_t GetDataSize() const { return sizeof(data); }
    void SaveToBuffer(void *p, uint32_t n) const { std::memcpy(p, data, n); }
};
}  // namespace optiling
namespace matmul_tiling {
enum class TPosition { GM };
enum class CubeFormat { ND };
enum class DataType { DT_BF16, DT_INT8, DT_FLOAT, DT_INT32 };
class MatmulApiTiling {
public:
    explicit MatmulApiTiling(const platform_ascendc::PlatformAscendC &) {}
    int SetAType(TPosition, CubeFormat, DataType, bool = false) { return 0; }
    int SetBType(TPosition, CubeFormat, DataType, bool = false) { return 0; }
    int SetCType(TPosition, CubeFormat, DataType) { return 0; }
    int SetShape(int m, int n, int k)
    {
        m_ = m;
        n_ = n;
        k_ = k;
        return 0;
    }
    int SetOrgShape(int, int, int) { return 0; }
    int SetBias(bool) { return 0; }
    int SetBufferSpace(int, int, int) { return 0; }
    int64_t GetTiling(optiling::TCubeTiling &t)
    {
        if (m_ <= 0 || n_ <= 0 || k_ <= 0) return -1;
        t.data[0] = 1;
        t.data[1] = m_;
        t.data[2] = n_;
        t.data[3] = k_;
        t.data[4] = k_;
        return 0;
    }

private:
    int m_ = 0, n_ = 0, k_ = 0;
};
}  // namespace matmul_tiling
