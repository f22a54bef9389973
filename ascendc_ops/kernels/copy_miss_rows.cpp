/*
 * Miss copy: the residency step's misses host -> hot buffer, on its own (the separate
 * miss-copy stage of a decode layer step where the fused Copy-SFA does not run it: the
 * ``copy_miss_rows`` op's rows form, and the overflow area's copy beside Copy-SFA).
 * MIX kernel, AIC:AIV 1:2 like the other fused kernels; the cube cores have nothing to
 * do and return at once.
 *
 * For every batch entry b (entries b = v, v + V, ... go to vector core v) and every
 * i < miss_count[b]:
 *     hot[rows[b], miss_slots[b, i]] = host[token_table[rows[b], miss_tokens[b, i]]]
 * in rounds of kMissBatch rows through a double-buffered VECIN->VECOUT queue (DataCopyPad,
 * byte-exact), as Copy-SFA's copy phase does. `host` is registered host memory the AI
 * core reads directly (host/torch_ops.cpp maps it): the rows never pass through the host
 * CPU, and the number of rows comes from device memory, so a launch needs no host read
 * and a graph can capture it. Entries of one launch own distinct hot-buffer rows (padding
 * entries, which may share the sink row, have no misses): no core writes another's rows,
 * so the cores need no ordering. Nothing else is written.
 *
 * STATUS: compiled on CPU (syntax-only, asc-devkit 8.5.0 headers) and run on the functional
 * model (check-kernels); never run on an NPU. See ascendc_ops/README.md.
 */
#include "sao_kernel_common.h"

namespace sao {

// One member per line: GM_ADDR is a macro (`__gm__ uint8_t *`).
struct CopyRowsArgs {
    GM_ADDR host;
    GM_ADDR hot;
    GM_ADDR rows;
    GM_ADDR missTokens;
    GM_ADDR missSlots;
    GM_ADDR missCount;
    GM_ADDR tokenTable;
    GM_ADDR workspace;
    GM_ADDR tiling;
};

class CopyRowsKernel {
public:
    __aicore__ inline CopyRowsKernel() {}

    __aicore__ inline void Run(const CopyRowsArgs &a)
    {
        if ASCEND_IS_AIC {
            return;
        }
        CopyStruct(&t_, a.tiling);
        pipe_.InitBuffer(rowQueue_, 2, kMissBatch * t_.ubRowDim * sizeof(bfloat16_t));
        host_.SetGlobalBuffer(reinterpret_cast<__gm__ bfloat16_t *>(a.host));
        hot_.SetGlobalBuffer(reinterpret_cast<__gm__ bfloat16_t *>(a.hot));
        rows_.SetGlobalBuffer(reinterpret_cast<__gm__ int32_t *>(a.rows));
        missTokens_.SetGlobalBuffer(reinterpret_cast<__gm__ int32_t *>(a.missTokens));
        missSlots_.SetGlobalBuffer(reinterpret_cast<__gm__ int32_t *>(a.missSlots));
        missCount_.SetGlobalBuffer(reinterpret_cast<__gm__ int32_t *>(a.missCount));
        tokenTable_.SetGlobalBuffer(reinterpret_cast<__gm__ int32_t *>(a.tokenTable));
        uint32_t cores = VectorCoreCount();
        for (uint32_t entry = VectorCoreIndex(); entry < t_.entries; entry += cores) {
            CopyEntry(entry);
        }
    }

private:
    __aicore__ inline void CopyEntry(uint32_t entry)
    {
        uint32_t n = static_cast<uint32_t>(missCount_.GetValue(entry));
        if (n == 0) {
            return;  // a padding entry's row (the sink) may be any; it is never read
        }
        int64_t row = rows_.GetValue(entry);
        uint32_t rowBytes = t_.rowDim * sizeof(bfloat16_t);
        AscendC::DataCopyExtParams one{1, rowBytes, 0, 0, 0};
        AscendC::DataCopyPadExtParams<bfloat16_t> noPad{false, 0, 0, 0};
        uint64_t list = static_cast<uint64_t>(entry) * t_.missWidth;
        for (uint32_t i0 = 0; i0 < n; i0 += kMissBatch) {
            uint32_t batch = n - i0 < kMissBatch ? n - i0 : kMissBatch;
            AscendC::LocalTensor<bfloat16_t> buf = rowQueue_.AllocTensor<bfloat16_t>();
            for (uint32_t b = 0; b < batch; ++b) {
                int32_t pos = missTokens_.GetValue(list + i0 + b);
                int64_t src = tokenTable_.GetValue(static_cast<uint64_t>(row) * t_.maxCtx + pos);
                AscendC::DataCopyPad(buf[b * t_.ubRowDim], host_[src * t_.rowDim], one, noPad);
            }
            rowQueue_.EnQue(buf);
            buf = rowQueue_.DeQue<bfloat16_t>();
            for (uint32_t b = 0; b < batch; ++b) {
                int64_t dst = row * t_.hotTokens + missSlots_.GetValue(list + i0 + b);
                AscendC::DataCopyPad(hot_[dst * t_.rowDim], buf[b * t_.ubRowDim], one);
            }
            rowQueue_.FreeTensor(buf);
        }
    }

    CopyRowsTiling t_;
    AscendC::TPipe pipe_;
    AscendC::TQueBind<AscendC::TPosition::VECIN, AscendC::TPosition::VECOUT, 2> rowQueue_;
    AscendC::GlobalTensor<bfloat16_t> host_, hot_;
    AscendC::GlobalTensor<int32_t> rows_, missTokens_, missSlots_, missCount_, tokenTable_;
};

}  // namespace sao

extern "C" __global__ __aicore__ void sao_copy_miss_rows(GM_ADDR host, GM_ADDR hot, GM_ADDR rows, GM_ADDR missTokens,
                                                         GM_ADDR missSlots, GM_ADDR missCount, GM_ADDR tokenTable,
                                                         GM_ADDR workspace, GM_ADDR tiling)
{
    KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIC_1_2);
    sao::CopyRowsArgs a{host, hot, rows, missTokens, missSlots, missCount, tokenTable, workspace, tiling};
    sao::CopyRowsKernel kernel;
    kernel.Run(a);
}
