/*
 * The indexer half of LIM / LIM-C8: logical top-K positions of one query token.
 *
 *   score[s] = sum_h w[t,h] * relu(logit[t,h,s])          (float32)
 *   logit    = q[t,h] . k[s]                               (bf16 indexer)
 *            = (sq[t,h] * sk[s]) * (q_i8[t,h] . k_i8[s])   (C8 indexer, integer dot exact)
 *
 * Per token (one vector core), walking the request's index-K blocks in order:
 *   1. cube: logits [Hi, blockSize] = q_t [Hi, Di] x key_block [blockSize, Di]^T through
 *      the Matmul high-level API (bf16 -> fp32, or int8 -> int32), into this core's GM
 *      scratch;
 *   2. vector: (C8: cast, scale rows by sq, columns by sk), ReLU, weighted head sum
 *      written straight into the chunk of scores; positions past `visible` get kNegScore;
 *   3. every `chunk` positions: Sort the chunk's (score, position) pairs descending and
 *      MrgSort them with the running top-K; keep the first K.
 * Finally Extract the positions; entries with kNegScore become -1 (fewer visible
 * positions than K).
 *
 * Ties: the reference orders equal scores by lower position. Sort/MrgSort order equal
 * scores by their input order (lower index / earlier list first) as far as the CANN
 * documentation says; this is not verified on hardware, so the NPU tests compare
 * top-k sets by score with a tolerance, as for torch_npu's own indexers.
 *
 * STATUS: compiled on CPU (syntax-only, asc-devkit 8.5.0 headers) and run on the functional
 * model (check-kernels); never run on an NPU. See ascendc_ops/README.md.
 */
#ifndef SAO_INDEXER_TOPK_H
#define SAO_INDEXER_TOPK_H

#include "sao_kernel_common.h"
#include "lib/matmul_intf.h"

namespace sao {

template <bool QUANT>
struct IndexerTypes {
    using Q = bfloat16_t;
    using Logit = float;
};
template <>
struct IndexerTypes<true> {
    using Q = int8_t;
    using Logit = int32_t;
};

template <bool QUANT>
using IndexerMatmul = AscendC::Matmul<
    AscendC::MatmulType<AscendC::TPosition::GM, CubeFormat::ND, typename IndexerTypes<QUANT>::Q>,
    AscendC::MatmulType<AscendC::TPosition::GM, CubeFormat::ND, typename IndexerTypes<QUANT>::Q, true>,
    AscendC::MatmulType<AscendC::TPosition::GM, CubeFormat::ND, typename IndexerTypes<QUANT>::Logit>>;

// GM views the indexer reads.
struct IndexerGm {
    GM_ADDR query;      // [T, Hi, Di]               bf16 | int8
    GM_ADDR key;        // [blocks, blockSize, 1, Di] bf16 | int8
    AscendC::GlobalTensor<bfloat16_t> weights;   // [T, Hi]
    AscendC::GlobalTensor<half> queryScale;      // [T, Hi]             (C8 only)
    AscendC::GlobalTensor<half> keyScale;        // [blocks, blockSize] (C8 only)
    AscendC::GlobalTensor<int32_t> cuQuery;      // [B] cumulative
    AscendC::GlobalTensor<int32_t> kvLen;        // [B]
    AscendC::GlobalTensor<int32_t> blockTable;   // [B, maxBlocks]
    AscendC::GlobalTensor<int32_t> topkOut;      // [T, K] (topk_indices)
    GM_ADDR logitsScratch;                       // this core's [Hi, blockSize] Logit scratch
};

template <bool QUANT>
class IndexerTopK {
public:
    using Q = typename IndexerTypes<QUANT>::Q;
    using Logit = typename IndexerTypes<QUANT>::Logit;

    __aicore__ inline IndexerTopK() {}

    __aicore__ inline void Init(const IndexerGm &gm, const LimTiling &t, const AscendC::LocalTensor<uint8_t> &pool,
                                IndexerMatmul<QUANT> *mm)
    {
        gm_ = gm;
        t_ = t;
        mm_ = mm;
        logitsGm_.SetGlobalBuffer(reinterpret_cast<__gm__ Logit *>(gm.logitsScratch), t.indexHeads * t.blockSize);
        uint32_t hb = t.indexHeads * t.blockSize;
        uint32_t off = 0;
        rawLogits_ = Carve<Logit>(pool, off, hb);
        logits_ = QUANT ? Carve<float>(pool, off, hb) : rawLogits_.template ReinterpretCast<float>();
        // The merge runs after a chunk's logits are consumed: reuse their space when it is
        // large enough (host/tiling.cpp mirrors this layout to check the UB budget).
        uint32_t mergedFloats = 2 * (t.topK + t.chunk);
        merged_ = hb * sizeof(Logit) >= mergedFloats * sizeof(float) ? rawLogits_.template ReinterpretCast<float>()
                                                                     : Carve<float>(pool, off, mergedFloats);
        weightsIn_ = Carve<bfloat16_t>(pool, off, t.indexHeads);
        weightsF_ = Carve<float>(pool, off, t.indexHeads);
        qScaleIn_ = Carve<half>(pool, off, t.indexHeads);
        qScaleF_ = Carve<float>(pool, off, t.indexHeads);
        kScaleIn_ = Carve<half>(pool, off, t.blockSize);
        kScaleF_ = Carve<float>(pool, off, t.blockSize);
        chunkScores_ = Carve<float>(pool, off, t.chunk);
        chunkPos_ = Carve<int32_t>(pool, off, t.chunk);
        chunkSorted_ = Carve<float>(pool, off, 2 * t.chunk);
        sortTmp_ = Carve<float>(pool, off, 2 * t.chunk);
        running_ = Carve<float>(pool, off, 2 * t.topK);
    }

    // Top-K positions of `token` into `out` (UB int32 [K]) and topk_indices[token].
    __aicore__ inline void Run(uint32_t token, const AscendC::LocalTensor<int32_t> &out)
    {
        TokenPlace place = PlaceToken(gm_.cuQuery, gm_.kvLen, t_.numRequests, token, t_.sparseMode);
        if (place.request < 0 || place.visible <= 0) {
            AscendC::Duplicate(out, static_cast<int32_t>(-1), t_.topK);
            WaitPipe<AscendC::HardEvent::V_MTE3>();
            StoreExact(gm_.topkOut[token * t_.topK], out, t_.topK);
            WaitPipe<AscendC::HardEvent::MTE3_V>();
            return;
        }
        LoadTokenScalars(token);
        uint32_t blocks = (static_cast<uint32_t>(place.visible) + t_.blockSize - 1) / t_.blockSize;
        uint32_t fill = 0;       // positions in the current chunk
        uint32_t chunkBase = 0;  // position of the chunk's first entry
        bool haveRunning = false;
        for (uint32_t blk = 0; blk < blocks; ++blk) {
            int32_t physical = gm_.blockTable.GetValue(place.request * t_.maxBlocks + blk);
            ScoreBlock(token, physical, chunkScores_[fill]);
            uint32_t base = blk * t_.blockSize;
            if (base + t_.blockSize > static_cast<uint32_t>(place.visible)) {
                MaskTail(chunkScores_[fill], static_cast<uint32_t>(place.visible) - base);
            }
            fill += t_.blockSize;
            if (fill == t_.chunk || blk + 1 == blocks) {
                MergeChunk(fill, chunkBase, haveRunning);
                haveRunning = true;
                chunkBase += fill;
                fill = 0;
            }
        }
        Finish(token, out);
    }

private:
    template <typename T>
    __aicore__ inline AscendC::LocalTensor<T> Carve(const AscendC::LocalTensor<uint8_t> &pool, uint32_t &off,
                                                    uint32_t count)
    {
        AscendC::LocalTensor<T> t = pool[off].template ReinterpretCast<T>();
        off += AlignUp(count * sizeof(T), 32);
        return t;
    }

    // Per-token weights (and C8 query scales) as scalars.
    __aicore__ inline void LoadTokenScalars(uint32_t token)
    {
        uint32_t hi = t_.indexHeads;
        LoadExact(weightsIn_, gm_.weights[token * hi], hi);
        if (QUANT) {
            LoadExact(qScaleIn_, gm_.queryScale[token * hi], hi);
        }
        WaitPipe<AscendC::HardEvent::MTE2_V>();
        AscendC::Cast(weightsF_, weightsIn_, AscendC::RoundMode::CAST_NONE, hi);
        if (QUANT) {
            AscendC::Cast(qScaleF_, qScaleIn_, AscendC::RoundMode::CAST_NONE, hi);
        }
        WaitPipe<AscendC::HardEvent::V_S>();
        for (uint32_t h = 0; h < hi; ++h) {
            weight_[h] = weightsF_.GetValue(h);
            qScale_[h] = QUANT ? qScaleF_.GetValue(h) : 1.0f;
        }
    }

    // dst[0..blockSize) = weighted head sum of relu(logits) of one key block.
    __aicore__ inline void ScoreBlock(uint32_t token, int32_t physical, const AscendC::LocalTensor<float> &dst)
    {
        uint32_t hi = t_.indexHeads;
        uint32_t bs = t_.blockSize;
        uint32_t di = t_.indexDim;
        AscendC::PipeBarrier<PIPE_ALL>();  // the previous block's vector work is done with these buffers
        AscendC::GlobalTensor<Q> q;
        AscendC::GlobalTensor<Q> k;
        q.SetGlobalBuffer(reinterpret_cast<__gm__ Q *>(gm_.query) + static_cast<uint64_t>(token) * hi * di, hi * di);
        k.SetGlobalBuffer(reinterpret_cast<__gm__ Q *>(gm_.key) + static_cast<uint64_t>(physical) * bs * di, bs * di);
        mm_->SetTensorA(q);
        mm_->SetTensorB(k, true);
        mm_->IterateAll(logitsGm_);  // synchronous: the logits are in GM when it returns
        AscendC::DataCopy(rawLogits_, logitsGm_, hi * bs);
        if (QUANT) {
            LoadExact(kScaleIn_, gm_.keyScale[static_cast<uint64_t>(physical) * bs], bs);
        }
        WaitPipe<AscendC::HardEvent::MTE2_V>();
        if (QUANT) {
            AscendC::Cast(logits_, rawLogits_, AscendC::RoundMode::CAST_NONE, hi * bs);  // exact: |dot| < 2^24
            AscendC::Cast(kScaleF_, kScaleIn_, AscendC::RoundMode::CAST_NONE, bs);
            AscendC::PipeBarrier<PIPE_V>();
            for (uint32_t h = 0; h < hi; ++h) {
                AscendC::Muls(logits_[h * bs], logits_[h * bs], qScale_[h], bs);
                AscendC::Mul(logits_[h * bs], logits_[h * bs], kScaleF_, bs);
            }
            AscendC::PipeBarrier<PIPE_V>();
        }
        AscendC::Relu(logits_, logits_, hi * bs);
        AscendC::PipeBarrier<PIPE_V>();
        AscendC::Muls(dst, logits_, weight_[0], bs);
        for (uint32_t h = 1; h < hi; ++h) {
            AscendC::PipeBarrier<PIPE_V>();
            AscendC::Axpy(dst, logits_[h * bs], weight_[h], bs);
        }
        AscendC::PipeBarrier<PIPE_V>();
    }

    // Positions valid..blockSize-1 of a block are not visible.
    __aicore__ inline void MaskTail(const AscendC::LocalTensor<float> &scores, uint32_t valid)
    {
        WaitPipe<AscendC::HardEvent::V_S>();
        for (uint32_t i = valid; i < t_.blockSize; ++i) {
            scores.SetValue(i, kNegScore);
        }
        WaitPipe<AscendC::HardEvent::S_V>();
    }

    // Sort the chunk (padded to `chunk` with kNegScore) and merge it into the running top-K.
    __aicore__ inline void MergeChunk(uint32_t fill, uint32_t chunkBase, bool haveRunning)
    {
        uint32_t c = t_.chunk;
        uint32_t k = t_.topK;
        if (fill < c) {
            AscendC::Duplicate(chunkScores_[fill], kNegScore, c - fill);
        }
        AscendC::CreateVecIndex(chunkPos_, static_cast<int32_t>(chunkBase), c);
        AscendC::PipeBarrier<PIPE_V>();
        AscendC::Sort<float, true>(chunkSorted_, chunkScores_, chunkPos_.ReinterpretCast<uint32_t>(), sortTmp_,
                                   static_cast<int32_t>(c / kSortGroup));
        AscendC::PipeBarrier<PIPE_V>();
        if (!haveRunning) {
            // first chunk: its best K pairs (c >= K) start the running list
            AscendC::DataCopy(running_, chunkSorted_, 2 * k);
            AscendC::PipeBarrier<PIPE_V>();
            return;
        }
        AscendC::MrgSortSrcList<float> lists(running_, chunkSorted_, running_, running_);
        uint16_t counts[4] = {static_cast<uint16_t>(k), static_cast<uint16_t>(c), 0, 0};
        uint32_t sorted[4] = {0, 0, 0, 0};
        AscendC::MrgSort<float, false>(merged_, lists, counts, sorted, 0b0011, 1);
        AscendC::PipeBarrier<PIPE_V>();
        AscendC::DataCopy(running_, merged_, 2 * k);
        AscendC::PipeBarrier<PIPE_V>();
    }

    __aicore__ inline void Finish(uint32_t token, const AscendC::LocalTensor<int32_t> &out)
    {
        uint32_t k = t_.topK;
        AscendC::LocalTensor<float> values = chunkScores_;
        AscendC::LocalTensor<uint32_t> positions = chunkPos_.ReinterpretCast<uint32_t>();
        AscendC::Extract(values, positions, running_, static_cast<int32_t>(k / kSortGroup));
        WaitPipe<AscendC::HardEvent::V_S>();
        for (uint32_t j = 0; j < k; ++j) {
            bool real = values.GetValue(j) > 0.5f * kNegScore;
            out.SetValue(j, real ? static_cast<int32_t>(positions.GetValue(j)) : -1);
        }
        WaitPipe<AscendC::HardEvent::S_MTE3>();
        StoreExact(gm_.topkOut[token * k], out, k);
        WaitPipe<AscendC::HardEvent::MTE3_S>();
    }

    IndexerGm gm_;
    LimTiling t_;
    IndexerMatmul<QUANT> *mm_ = nullptr;
    AscendC::GlobalTensor<Logit> logitsGm_;
    AscendC::LocalTensor<Logit> rawLogits_;
    AscendC::LocalTensor<float> logits_;
    AscendC::LocalTensor<float> merged_;
    AscendC::LocalTensor<bfloat16_t> weightsIn_;
    AscendC::LocalTensor<float> weightsF_;
    AscendC::LocalTensor<half> qScaleIn_;
    AscendC::LocalTensor<float> qScaleF_;
    AscendC::LocalTensor<half> kScaleIn_;
    AscendC::LocalTensor<float> kScaleF_;
    AscendC::LocalTensor<float> chunkScores_;
    AscendC::LocalTensor<int32_t> chunkPos_;
    AscendC::LocalTensor<float> chunkSorted_;
    AscendC::LocalTensor<float> sortTmp_;
    AscendC::LocalTensor<float> running_;
    float weight_[kMaxIndexHeads];
    float qScale_[kMaxIndexHeads];
};

}  // namespace sao

#endif  // SAO_INDEXER_TOPK_H
