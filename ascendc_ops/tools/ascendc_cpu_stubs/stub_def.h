/*
 * Stand-in for what the bisheng compiler (and the toolkit's tikicpulib `stub_def.h`) provide,
 * for a SYNTAX-ONLY compile of the AscendC kernels with g++ against the open asc-devkit
 * headers. Force-included (-include) in every compile of the check, NPU path
 * (-D__DAV_C220_VEC__ / -D__DAV_C220_CUBE__, no ASCENDC_CPU_DEBUG) as in the real build.
 * Declares what the bisheng compiler or tikicpulib would provide: address-space qualifiers
 * and function attributes (empty), half / bfloat16_t, the pipe / event enums and the
 * per-core globals. The hardware intrinsics are declared as do-nothing templates in
 * stub_fun.h (generated). Nothing here runs: g++ only type-checks the kernels.
 * Written for this project; see sglang_ascend_offload/kernel_check/compile_check.py.
 */
#ifndef SAO_ASCENDC_STUB_DEF_H
#define SAO_ASCENDC_STUB_DEF_H

#include <cstdint>
#include <cstddef>
#include <cassert>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>
#include <tuple>
#include <type_traits>

#define __aicore__
#define __global__
#define __gm__
#define __ubuf__
#define __cbuf__
#define __ca__
#define __cb__
#define __cc__
#define __fbuf__
#define __ssbuf__
#define __sync_alias__
#define __check_sync_alias__
#define __sync_out__
#define __sync_in__
#define __BLOCK_LOCAL__
#define __simd_callee__
#define __simd_vf__
#define __in_pipe__(...)
#define __out_pipe__(...)
#define __inout_pipe__(...)
#define ASCENDC_HOST_AICORE

enum pipe_t { PIPE_S, PIPE_V, PIPE_M, PIPE_MTE1, PIPE_MTE2, PIPE_MTE3, PIPE_ALL, PIPE_MTE4, PIPE_MTE5, PIPE_V2,
              PIPE_FIX };
enum event_t { EVENT_ID0, EVENT_ID1, EVENT_ID2, EVENT_ID3, EVENT_ID4, EVENT_ID5, EVENT_ID6, EVENT_ID7 };

// 16-bit float types: storage plus float conversions (enough for type checking).
struct half {
    uint16_t bits = 0;
    half() = default;
    half(float) {}
    operator float() const { return 0.0f; }
    float ToFloat() const { return 0.0f; }
};
struct bfloat16_t {
    uint16_t bits = 0;
    bfloat16_t() = default;
    bfloat16_t(float) {}
    operator float() const { return 0.0f; }
    float ToFloat() const { return 0.0f; }
};

// Value returned by the generated intrinsic stand-ins: converts to whatever the caller wants.
struct SaoStubValue {
    template <typename T>
    operator T() const { return T(); }
};
#define SAO_STUB_BINOP(op)                                                                              \
    template <typename T, typename = std::enable_if_t<std::is_arithmetic_v<T>>>                        \
    inline T operator op(SaoStubValue, T) { return T(); }                                               \
    template <typename T, typename = std::enable_if_t<std::is_arithmetic_v<T>>>                        \
    inline T operator op(T, SaoStubValue) { return T(); }
SAO_STUB_BINOP(+)
SAO_STUB_BINOP(-)
SAO_STUB_BINOP(*)
SAO_STUB_BINOP(/)
SAO_STUB_BINOP(&)
SAO_STUB_BINOP(|)
SAO_STUB_BINOP(^)
SAO_STUB_BINOP(<<)
SAO_STUB_BINOP(>>)
#undef SAO_STUB_BINOP

extern int64_t block_idx;
extern int64_t block_num;
extern int64_t sub_block_idx;
extern int64_t g_taskRation;

// the compiler's own namespace (used by a few utilities of the headers)
namespace bisheng {
namespace cce {
template <typename T> inline T sqrt(T v) { return v; }
template <typename T> inline T abs(T v) { return v; }
inline void metrics_prof_start() {}
inline void metrics_prof_stop() {}
template <pipe_t P, uint16_t I> inline void mark_stamp() {}
}  // namespace cce
}  // namespace bisheng

namespace AscendC {
constexpr int32_t AIC_TYPE = 1;  // tikicpulib's core-type tags (kernel_log.h prints them)
constexpr int32_t AIV_TYPE = 2;
extern bool g_isVdeq;
}  // namespace AscendC

#include "stub_generated.h"

#endif  // SAO_ASCENDC_STUB_DEF_H
