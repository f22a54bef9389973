/*
 * Small helpers shared by the fused kernels: pipe synchronisation, tiling copy,
 * byte-exact stores of a few values, and the vector-core numbering of MIX kernels.
 *
 * Named sao_kernel_common.h, not kernel_common.h: the AscendC headers include their own
 * "kernel_common.h" (include/basic_api/) by a quoted name, and with this folder on the
 * include path a file of that name here would be picked up instead (check-kernels
 * rejects any kernel header whose name is also an AscendC header's).
 *
 * STATUS: compiled on CPU (syntax-only, asc-devkit 8.5.0 headers) and run on the functional
 * model (check-kernels); never run on an NPU. See ascendc_ops/README.md.
 */
#ifndef SAO_KERNEL_COMMON_H
#define SAO_KERNEL_COMMON_H

#include "kernel_operator.h"
#include "fused_tiling.h"

namespace sao {

// Wait until every instruction of the source pipe issued so far has finished before
// the destination pipe continues (e.g. MTE2 loads before scalar reads of UB).
template <AscendC::HardEvent EVENT>
__aicore__ inline void WaitPipe()
{
    event_t id = static_cast<event_t>(GetTPipePtr()->FetchEventID(EVENT));
    AscendC::SetFlag<EVENT>(id);
    AscendC::WaitFlag<EVENT>(id);
}

// Vector core numbering in a MIX (AIC:AIV = 1:2) kernel: blockDim counts cube cores,
// each paired with GetTaskRation() vector cores.
__aicore__ inline uint32_t VectorCoreIndex() { return AscendC::GetBlockIdx(); }
__aicore__ inline uint32_t VectorCoreCount() { return AscendC::GetBlockNum() * AscendC::GetTaskRation(); }

// Copy a POD struct from GM (the tiling buffer) word by word.
template <typename T>
__aicore__ inline void CopyStruct(T *dst, GM_ADDR src)
{
    static_assert(sizeof(T) % sizeof(uint32_t) == 0, "tiling structs are whole words");
    auto *out = reinterpret_cast<uint32_t *>(dst);
    auto *in = reinterpret_cast<__gm__ uint32_t *>(src);
    for (uint32_t i = 0; i < sizeof(T) / sizeof(uint32_t); ++i) {
        out[i] = in[i];
    }
}

// Store `count` elements of `src` (UB) to `dst` (GM) writing exactly count * sizeof(T)
// bytes. Rows of neighbouring cores may share a cache line, so per-row scalars are
// never written through the scalar data cache; DataCopyPad writes only its bytes.
template <typename T>
__aicore__ inline void StoreExact(const AscendC::GlobalTensor<T> &dst, const AscendC::LocalTensor<T> &src,
                                  uint32_t count)
{
    AscendC::DataCopyExtParams params{1, static_cast<uint32_t>(count * sizeof(T)), 0, 0, 0};
    AscendC::DataCopyPad(dst, src, params);
}

template <typename T>
__aicore__ inline void LoadExact(const AscendC::LocalTensor<T> &dst, const AscendC::GlobalTensor<T> &src,
                                 uint32_t count)
{
    AscendC::DataCopyExtParams params{1, static_cast<uint32_t>(count * sizeof(T)), 0, 0, 0};
    AscendC::DataCopyPadExtParams<T> pad{false, 0, 0, 0};
    AscendC::DataCopyPad(dst, src, params, pad);
}

__aicore__ inline uint32_t AlignUp(uint32_t value, uint32_t align) { return (value + align - 1) / align * align; }

// Which request a TND query token belongs to, and what it may see.
struct TokenPlace {
    int32_t request;   // -1: padding token (past the last cumulative length)
    int32_t position;  // the token's own position in its request
    int32_t visible;   // positions 0 .. visible-1 are visible
};

// actual_seq_lengths_query is cumulative (TND); actual_seq_lengths_key per request.
// Scalar scan over B entries (B is the decode batch: small).
__aicore__ inline TokenPlace PlaceToken(const AscendC::GlobalTensor<int32_t> &cuQuery,
                                        const AscendC::GlobalTensor<int32_t> &kvLen, uint32_t numRequests,
                                        uint32_t token, uint32_t sparseMode)
{
    TokenPlace place{-1, 0, 0};
    int32_t start = 0;
    for (uint32_t b = 0; b < numRequests; ++b) {
        int32_t end = cuQuery.GetValue(b);
        if (static_cast<int32_t>(token) < end) {
            int32_t qLen = end - start;
            int32_t kv = kvLen.GetValue(b);
            place.request = static_cast<int32_t>(b);
            place.position = kv - qLen + (static_cast<int32_t>(token) - start);
            place.visible = sparseMode == 3 ? place.position + 1 : kv;
            return place;
        }
        start = end;
    }
    return place;
}

}  // namespace sao

#endif  // SAO_KERNEL_COMMON_H
