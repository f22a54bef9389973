/*
 * LIM and LIM-C8: lightning indexer + residency manage in one MIX kernel (AIC:AIV = 1:2).
 *
 * Work split (no cross-core synchronisation):
 *   - query tokens t = v, v + V, v + 2V, ... go to vector core v (V vector cores): the
 *     core computes the token's top-K (indexer_topk.h) and then, if the token owns a row
 *     (token_rows[t] >= 0), runs that row's residency step (residency_manage.h) and
 *     writes the token's flat hot-buffer indices;
 *   - rows r = v, v + V, ... that no token owns are stepped by core v with an all-padding
 *     top-K (reset when the request changed, speculative drop; no hits, no misses).
 * A row is owned by at most one token (ABI precondition), so every row is written by
 * exactly one core.
 *
 * Kernel arguments are GM addresses in the order of the torch op (host/torch_ops.cpp),
 * followed by the workspace and the tiling buffer (include/fused_tiling.h).
 *
 * STATUS: compiled on CPU (syntax-only, asc-devkit 8.5.0 headers) and run on the functional
 * model (check-kernels); never run on an NPU. See ascendc_ops/README.md.
 */
#include "sao_kernel_common.h"
#include "indexer_topk.h"
#include "residency_manage.h"

namespace sao {

// One member per line: GM_ADDR is a macro (`__gm__ uint8_t *`), so `GM_ADDR a, b;` would
// declare only `a` as a pointer.
struct LimArgs {
    GM_ADDR query;
    GM_ADDR key;
    GM_ADDR weights;
    GM_ADDR queryScale;
    GM_ADDR keyScale;
    GM_ADDR cuQuery;
    GM_ADDR kvLen;
    GM_ADDR blockTable;
    GM_ADDR tokenRows;
    GM_ADDR reqIds;
    GM_ADDR stableLen;
    GM_ADDR step;
    GM_ADDR slotToken;
    GM_ADDR slotStamp;
    GM_ADDR rowReq;
    GM_ADDR topkOut;
    GM_ADDR sparseOut;
    GM_ADDR hitMask;
    GM_ADDR slots;
    GM_ADDR missCount;
    GM_ADDR missTokens;
    GM_ADDR missSlots;
    GM_ADDR workspace;
    GM_ADDR tiling;
};

template <typename T>
__aicore__ inline AscendC::GlobalTensor<T> Gm(GM_ADDR addr)
{
    AscendC::GlobalTensor<T> g;
    g.SetGlobalBuffer(reinterpret_cast<__gm__ T *>(addr));
    return g;
}

template <bool QUANT>
class LimKernel {
public:
    __aicore__ inline LimKernel() {}

    __aicore__ inline void Run(const LimArgs &a)
    {
        AscendC::SetSysWorkspace(a.workspace);
        if (GetSysWorkSpacePtr() == nullptr) {
            return;
        }
        CopyStruct(&t_, a.tiling);
        CopyStruct(&cube_, a.tiling + kCubeTilingOffset);
        REGIST_MATMUL_OBJ(&pipe_, GetSysWorkSpacePtr(), mm_, &cube_);  // the cube core serves matmuls from here on
        if ASCEND_IS_AIC {
            return;
        }
        pipe_.InitBuffer(pool_, kLimPoolBytes);  // vector-core UB
        pipe_.InitBuffer(topkBuf_, AlignUp(t_.topK * sizeof(int32_t), 32));
        uint32_t v = VectorCoreIndex();
        uint32_t cores = VectorCoreCount();
        GM_ADDR user = AscendC::GetUserWorkspace(a.workspace);

        IndexerGm ig;
        ig.query = a.query;
        ig.key = a.key;
        ig.weights = Gm<bfloat16_t>(a.weights);
        ig.queryScale = Gm<half>(a.queryScale);
        ig.keyScale = Gm<half>(a.keyScale);
        ig.cuQuery = Gm<int32_t>(a.cuQuery);
        ig.kvLen = Gm<int32_t>(a.kvLen);
        ig.blockTable = Gm<int32_t>(a.blockTable);
        ig.topkOut = Gm<int32_t>(a.topkOut);
        ig.logitsScratch = user + static_cast<uint64_t>(v) * t_.logitsBytes;

        ResidencyGm rg;
        rg.slotToken = Gm<int32_t>(a.slotToken);
        rg.stampWords = Gm<uint32_t>(a.slotStamp);
        rg.rowReq = Gm<int64_t>(a.rowReq);
        rg.reqIds = Gm<int64_t>(a.reqIds);
        rg.stableLen = Gm<int32_t>(a.stableLen);
        rg.hitMask = Gm<uint8_t>(a.hitMask);
        rg.slots = Gm<int32_t>(a.slots);
        rg.missCount = Gm<int32_t>(a.missCount);
        rg.missTokens = Gm<int32_t>(a.missTokens);
        rg.missSlots = Gm<int32_t>(a.missSlots);

        AscendC::LocalTensor<uint8_t> pool = pool_.Get<uint8_t>();
        AscendC::LocalTensor<int32_t> topk = topkBuf_.Get<int32_t>();
        int64_t step = Gm<int64_t>(a.step).GetValue(0);
        tokenRows_ = Gm<int32_t>(a.tokenRows);
        sparseOut_ = Gm<int32_t>(a.sparseOut);

        IndexerTopK<QUANT> indexer;
        RowResidency residency;
        indexer.Init(ig, t_, pool, &mm_);
        residency.Init(rg, pool, t_.hotTokens, t_.topK, t_.hashBits, step);  // same pool: used after the indexer

        for (uint32_t token = v; token < t_.numTokens; token += cores) {
            indexer.Run(token, topk);
            AscendC::PipeBarrier<PIPE_ALL>();  // the pool changes hands: indexer -> residency
            int32_t row = tokenRows_.GetValue(token);
            if (row >= 0) {
                residency.Step(static_cast<uint32_t>(row), topk);
            }
            WriteSparseIndices(token, row, residency, topk);
            AscendC::PipeBarrier<PIPE_ALL>();
        }
        AscendC::Duplicate(topk, static_cast<int32_t>(-1), t_.topK);
        AscendC::PipeBarrier<PIPE_ALL>();
        for (uint32_t row = v; row < t_.rows; row += cores) {
            if (!OwnedByToken(row)) {
                residency.Step(row, topk);
                AscendC::PipeBarrier<PIPE_ALL>();
            }
        }
        mm_.End();
    }

private:
    __aicore__ inline bool OwnedByToken(uint32_t row) const
    {
        for (uint32_t t = 0; t < t_.numTokens; ++t) {
            if (tokenRows_.GetValue(t) == static_cast<int32_t>(row)) {
                return true;
            }
        }
        return false;
    }

    // sparse_indices[token, j] = row * Hh + slots[j] (or -1); reuses `scratch` (the top-K).
    __aicore__ inline void WriteSparseIndices(uint32_t token, int32_t row, const RowResidency &residency,
                                              const AscendC::LocalTensor<int32_t> &scratch)
    {
        const AscendC::LocalTensor<int32_t> &slots = residency.Slots();
        for (uint32_t j = 0; j < t_.topK; ++j) {
            int32_t slot = row >= 0 ? slots.GetValue(j) : -1;
            scratch.SetValue(j, slot >= 0 ? row * static_cast<int32_t>(t_.hotTokens) + slot : -1);
        }
        WaitPipe<AscendC::HardEvent::S_MTE3>();
        StoreExact(sparseOut_[token * t_.topK], scratch, t_.topK);
        WaitPipe<AscendC::HardEvent::MTE3_S>();
    }

    LimTiling t_;
    TCubeTiling cube_;
    AscendC::TPipe pipe_;
    AscendC::TBuf<AscendC::TPosition::VECCALC> pool_;
    AscendC::TBuf<AscendC::TPosition::VECCALC> topkBuf_;
    IndexerMatmul<QUANT> mm_;
    AscendC::GlobalTensor<int32_t> tokenRows_;
    AscendC::GlobalTensor<int32_t> sparseOut_;
};

}  // namespace sao

// bf16 indexer. query_scale / key_scale are unused (nullptr).
extern "C" __global__ __aicore__ void sao_lightning_indexer_manage(
    GM_ADDR query, GM_ADDR key, GM_ADDR weights, GM_ADDR cuQuery, GM_ADDR kvLen, GM_ADDR blockTable,
    GM_ADDR tokenRows, GM_ADDR reqIds, GM_ADDR stableLen, GM_ADDR step, GM_ADDR slotToken, GM_ADDR slotStamp,
    GM_ADDR rowReq, GM_ADDR topkOut, GM_ADDR sparseOut, GM_ADDR hitMask, GM_ADDR slots, GM_ADDR missCount,
    GM_ADDR missTokens, GM_ADDR missSlots, GM_ADDR workspace, GM_ADDR tiling)
{
    KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIC_1_2);
    sao::LimArgs a{query, key, weights, nullptr, nullptr, cuQuery, kvLen, blockTable, tokenRows, reqIds,
                   stableLen, step, slotToken, slotStamp, rowReq, topkOut, sparseOut, hitMask, slots,
                   missCount, missTokens, missSlots, workspace, tiling};
    sao::LimKernel<false> kernel;
    kernel.Run(a);
}

// C8 indexer: int8 query/key, fp16 dequant scales.
extern "C" __global__ __aicore__ void sao_quant_lightning_indexer_manage(
    GM_ADDR query, GM_ADDR key, GM_ADDR weights, GM_ADDR queryScale, GM_ADDR keyScale, GM_ADDR cuQuery,
    GM_ADDR kvLen, GM_ADDR blockTable, GM_ADDR tokenRows, GM_ADDR reqIds, GM_ADDR stableLen, GM_ADDR step,
    GM_ADDR slotToken, GM_ADDR slotStamp, GM_ADDR rowReq, GM_ADDR topkOut, GM_ADDR sparseOut, GM_ADDR hitMask,
    GM_ADDR slots, GM_ADDR missCount, GM_ADDR missTokens, GM_ADDR missSlots, GM_ADDR workspace, GM_ADDR tiling)
{
    KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIC_1_2);
    sao::LimArgs a{query, key, weights, queryScale, keyScale, cuQuery, kvLen, blockTable, tokenRows, reqIds,
                   stableLen, step, slotToken, slotStamp, rowReq, topkOut, sparseOut, hitMask, slots,
                   missCount, missTokens, missSlots, workspace, tiling};
    sao::LimKernel<true> kernel;
    kernel.Run(a);
}
