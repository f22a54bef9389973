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
 * With one token per row (tokens_per_row = 1) a row is owned by at most one token (ABI
 * precondition), so every row is written by exactly one core.
 *
 * With n = tokens_per_row > 1 (a request's speculative verify rows sharing its hot
 * buffer) up to n tokens own a row, and the row's step runs on the entries of the union
 * of their top-K (distinct positions ascending, W = min(n * K, Hh) wide). The row belongs
 * to the core of its first token (lowest t): that core computes the top-K of every token
 * of the row (each lands in topk_indices), builds the union from them, steps the row once
 * and then writes each token's flat indices (the slot now holding each of its positions).
 * Tokens of a row whose first token is elsewhere are skipped; no row is written twice.
 * A union of more than Hh positions keeps its first W = Hh by priority (each position's
 * best column over the row's tokens, then the position: ops/request_union.py): the
 * positions past them get no slot (-1 in sparse_indices) and are served beside the
 * kernel from the overflow area (sparse_decode/overflow.py).
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
        // a token's top-K; with shared rows also the row's tokens' column chunks (StepUnion)
        pipe_.InitBuffer(topkBuf_, AlignUp(StagingEntries() * sizeof(int32_t), 32));
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
        topkOut_ = Gm<int32_t>(a.topkOut);
        reqIds_ = Gm<int64_t>(a.reqIds);

        IndexerTopK<QUANT> indexer;
        RowResidency residency;
        indexer.Init(ig, t_, pool, &mm_);
        // same pool: used after the indexer; steps of W entries (K with one token per row)
        residency.Init(rg, pool, t_.hotTokens, t_.unionWidth, t_.hashBits, step);
        if (t_.rowTokens > 1) {
            RunSharedRows(indexer, residency, topk, v, cores);
            mm_.End();
            return;
        }

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
    // Rows served by up to n tokens each (see the file comment).
    __aicore__ inline void RunSharedRows(IndexerTopK<QUANT> &indexer, RowResidency &residency,
                                         const AscendC::LocalTensor<int32_t> &topk, uint32_t v, uint32_t cores)
    {
        for (uint32_t token = v; token < t_.numTokens; token += cores) {
            int32_t row = tokenRows_.GetValue(token);
            if (row < 0) {  // unmanaged: its top-K only, no flat indices
                indexer.Run(token, topk);
                AscendC::PipeBarrier<PIPE_ALL>();
                WriteSparseIndices(token, row, residency, topk);
                AscendC::PipeBarrier<PIPE_ALL>();
                continue;
            }
            if (FirstToken(static_cast<uint32_t>(row)) != token) {
                continue;  // the row's first token's core serves it
            }
            for (uint32_t t = token; t < t_.numTokens; ++t) {  // every token of the row: top-K to GM
                if (tokenRows_.GetValue(t) == row) {
                    indexer.Run(t, topk);
                    AscendC::PipeBarrier<PIPE_ALL>();
                }
            }
            StepUnion(static_cast<uint32_t>(row), token, residency, topk);
        }
        for (uint32_t row = v; row < t_.rows; row += cores) {
            if (!OwnedByToken(row)) {
                StepUnion(row, t_.numTokens, residency, topk);  // no token: an all-padding union
            }
        }
    }

    // Staging entries: a token's top-K, and at least 8 columns for each of a row's tokens.
    __aicore__ inline uint32_t StagingEntries() const
    {
        uint32_t columns = 8 * kMaxRowTokens;
        return t_.topK > columns ? t_.topK : columns;
    }

    // The row's step over the union of the top-K of its tokens (those from `first` on),
    // then each token's flat indices. The top-K are read back from topk_indices in GM.
    __aicore__ inline void StepUnion(uint32_t row, uint32_t first, RowResidency &residency,
                                     const AscendC::LocalTensor<int32_t> &staging)
    {
        residency.BeginUnion();
        BuildUnion(row, first, residency, staging);
        residency.FinishUnion();
        residency.Step(row, residency.UnionEntries());
        AscendC::PipeBarrier<PIPE_ALL>();
        if (first >= t_.numTokens) {
            return;
        }
        residency.RebuildTable();
        bool idle = reqIds_.GetValue(row) == -1;  // an idle row resolves nothing
        int32_t base = static_cast<int32_t>(row) * static_cast<int32_t>(t_.hotTokens);
        for (uint32_t t = first; t < t_.numTokens; ++t) {
            if (tokenRows_.GetValue(t) != static_cast<int32_t>(row)) {
                continue;
            }
            LoadTopK(t, staging);
            for (uint32_t j = 0; j < t_.topK; ++j) {
                int32_t slot = idle ? -1 : residency.SlotOf(staging.GetValue(j));
                staging.SetValue(j, slot >= 0 ? base + slot : -1);
            }
            WaitPipe<AscendC::HardEvent::S_MTE3>();
            StoreExact(sparseOut_[t * t_.topK], staging, t_.topK);
            WaitPipe<AscendC::HardEvent::MTE3_MTE2>();
            WaitPipe<AscendC::HardEvent::MTE3_S>();
        }
    }

    // The union in priority order: column by column (a position's first column is its best
    // over the row's tokens), the column's positions ascending; AddPosition keeps the first
    // W distinct ones. The tokens' top-K come through `staging` in column chunks, one
    // DataCopy per token and chunk (a chunk is a multiple of 8 int32: 32-byte copies).
    __aicore__ inline void BuildUnion(uint32_t row, uint32_t first, RowResidency &residency,
                                      const AscendC::LocalTensor<int32_t> &staging)
    {
        uint32_t tokens[kMaxRowTokens];
        uint32_t m = 0;
        for (uint32_t t = first; t < t_.numTokens && m < kMaxRowTokens; ++t) {
            if (tokenRows_.GetValue(t) == static_cast<int32_t>(row)) {
                tokens[m++] = t;
            }
        }
        if (m == 0) {
            return;  // no token: an all-padding union
        }
        uint32_t chunk = StagingEntries() / m / 8 * 8;
        for (uint32_t j0 = 0; j0 < t_.topK; j0 += chunk) {
            uint32_t cols = t_.topK - j0 < chunk ? t_.topK - j0 : chunk;
            for (uint32_t i = 0; i < m; ++i) {
                AscendC::DataCopy(staging[i * chunk], topkOut_[tokens[i] * t_.topK + j0], cols);
            }
            WaitPipe<AscendC::HardEvent::MTE2_S>();
            for (uint32_t j = 0; j < cols; ++j) {
                int32_t column[kMaxRowTokens];
                for (uint32_t i = 0; i < m; ++i) {  // insertion sort: the column's positions ascending
                    int32_t pos = staging.GetValue(i * chunk + j);
                    uint32_t at = i;
                    for (; at > 0 && column[at - 1] > pos; --at) {
                        column[at] = column[at - 1];
                    }
                    column[at] = pos;
                }
                for (uint32_t i = 0; i < m; ++i) {
                    residency.AddPosition(column[i]);
                }
            }
        }
    }

    // topk_indices[t] (written by this core's indexer runs) into UB.
    __aicore__ inline void LoadTopK(uint32_t token, const AscendC::LocalTensor<int32_t> &dst)
    {
        AscendC::DataCopy(dst, topkOut_[token * t_.topK], t_.topK);  // K is a multiple of 8 int32
        WaitPipe<AscendC::HardEvent::MTE2_S>();
    }

    __aicore__ inline uint32_t FirstToken(uint32_t row) const
    {
        for (uint32_t t = 0; t < t_.numTokens; ++t) {
            if (tokenRows_.GetValue(t) == static_cast<int32_t>(row)) {
                return t;
            }
        }
        return t_.numTokens;
    }

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
    AscendC::GlobalTensor<int32_t> topkOut_;
    AscendC::GlobalTensor<int64_t> reqIds_;
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
