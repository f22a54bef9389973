/*
 * Copy-SFA: copy a row's miss rows host -> hot buffer, then sparse MLA (absorb) flash
 * attention of the row's query token over its K selected hot rows. MIX kernel, AIC:AIV 1:2.
 *
 * Work split: query tokens t = v, v + V, ... go to vector core v. For each token:
 *   1. copy the misses of row r = token_rows[t] (i < miss_count[r]):
 *        hot[r, miss_slots[r,i]] = host[token_table[r, miss_tokens[r,i]]]
 *      in rounds of kMissBatch rows through a double-buffered VECIN->VECOUT queue
 *      (DataCopyPad, byte-exact). `host` is registered host memory the AI core reads
 *      directly (host/torch_ops.cpp maps it). The number of rows comes from device
 *      memory: the same launch serves first fills (up to K rows) and steady steps.
 *      Every row with misses is owned by a token (ABI precondition), so every miss is
 *      copied by the core that then attends over that row: no cross-core barrier.
 *      With several tokens per row (tokens_per_row n > 1: a request's verify rows; the
 *      miss lists are then min(n * K, Hh) wide) the row goes to the core of its first
 *      token (lowest t), which copies the misses once and then attends for every token of
 *      the row; the other cores skip those tokens.
 *   2. gather the K selected rows into this core's GM scratch as two contiguous
 *      matrices, latent [K, Dl] and rope [K, Dr] (zero rows for -1): an index below
 *      R * Hh is a row of the hot buffer, one from R * Hh on a row of the overflow area
 *      (the positions a verify round's union could not keep in the hot buffer, copied
 *      there before this launch: sparse_decode/overflow.py);
 *   3. per group of heads and per tile of kKvTile rows (cube: Matmul API, GM operands):
 *        S  = q_lat . k_lat^T + q_rope . k_rope^T      [G, tile] fp32
 *        online softmax on the vector unit: m' = max(m, rowmax(scale*S)),
 *        P = exp(scale*S - m') * valid, l = l*exp(m - m') + rowsum(P),
 *        O = O*exp(m - m') + P . k_lat                  (cube for P . k_lat)
 *      then out = O / l (0 where l == 0: a token with no valid index), cast to bf16.
 * Masking multiplies by a 0/1 validity vector and replaces invalid logits with a large
 * negative finite value, so no inf - inf arises before the first valid entry.
 *
 * STATUS: compiled on CPU (syntax-only, asc-devkit 8.5.0 headers) and run on the functional
 * model (check-kernels); never run on an NPU. See ascendc_ops/README.md.
 */
#include "sao_kernel_common.h"
#include "lib/matmul_intf.h"

namespace sao {

constexpr float kMaskedLogit = -1.0e30f;

using BfGm = AscendC::MatmulType<AscendC::TPosition::GM, CubeFormat::ND, bfloat16_t>;
using BfGmT = AscendC::MatmulType<AscendC::TPosition::GM, CubeFormat::ND, bfloat16_t, true>;
using F32Gm = AscendC::MatmulType<AscendC::TPosition::GM, CubeFormat::ND, float>;
using QkMatmul = AscendC::Matmul<BfGm, BfGmT, F32Gm>;  // [G, D] x [tile, D]^T
using PvMatmul = AscendC::Matmul<BfGm, BfGm, F32Gm>;   // [G, tile] x [tile, Dl]

// One member per line: GM_ADDR is a macro (`__gm__ uint8_t *`), so `GM_ADDR a, b;` would
// declare only `a` as a pointer.
struct CopySfaArgs {
    GM_ADDR query;
    GM_ADDR queryRope;
    GM_ADDR host;
    GM_ADDR hot;
    GM_ADDR overflow;
    GM_ADDR sparseIndices;
    GM_ADDR tokenRows;
    GM_ADDR missTokens;
    GM_ADDR missSlots;
    GM_ADDR missCount;
    GM_ADDR tokenTable;
    GM_ADDR out;
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

class CopySfaKernel {
public:
    __aicore__ inline CopySfaKernel() {}

    __aicore__ inline void Run(const CopySfaArgs &a)
    {
        AscendC::SetSysWorkspace(a.workspace);
        if (GetSysWorkSpacePtr() == nullptr) {
            return;
        }
        CopyStruct(&t_, a.tiling);
        CopyStruct(&qkLatTiling_, a.tiling + kCubeTilingOffset);
        CopyStruct(&qkRopeTiling_, a.tiling + kCubeTilingOffset + kCubeTilingStride);
        CopyStruct(&pvTiling_, a.tiling + kCubeTilingOffset + 2 * kCubeTilingStride);
        REGIST_MATMUL_OBJ(&pipe_, GetSysWorkSpacePtr(), qkLat_, &qkLatTiling_, qkRope_, &qkRopeTiling_, pv_,
                          &pvTiling_);
        if ASCEND_IS_AIC {
            return;
        }
        InitBuffers();  // vector-core UB
        BindGm(a);
        uint32_t cores = VectorCoreCount();
        bool shared = t_.rowTokens > 1;  // rows served by several tokens
        for (uint32_t token = VectorCoreIndex(); token < t_.numTokens; token += cores) {
            int32_t row = tokenRows_.GetValue(token);
            if (row >= 0) {
                if (shared && FirstToken(row) != token) {
                    continue;  // the row's first token's core copies and attends for it
                }
                CopyMisses(static_cast<uint32_t>(row));
                AscendC::PipeBarrier<PIPE_ALL>();  // the misses have landed before the gather reads them
            }
            Attend(token);
            for (uint32_t t = token + 1; shared && row >= 0 && t < t_.numTokens; ++t) {
                if (tokenRows_.GetValue(t) == row) {
                    Attend(t);
                }
            }
        }
        qkLat_.End();
        qkRope_.End();
        pv_.End();
    }

private:
    __aicore__ inline void Attend(uint32_t token)
    {
        Gather(token);
        AscendC::PipeBarrier<PIPE_ALL>();
        for (uint32_t h0 = 0; h0 < t_.heads; h0 += t_.headGroup) {
            AttendHeads(token, h0);
        }
        AscendC::PipeBarrier<PIPE_ALL>();  // the next token's gather reuses the scratch
    }

    __aicore__ inline uint32_t FirstToken(int32_t row) const
    {
        for (uint32_t t = 0; t < t_.numTokens; ++t) {
            if (tokenRows_.GetValue(t) == row) {
                return t;
            }
        }
        return t_.numTokens;
    }

    // ------------------------------------------------------------------ set-up
    __aicore__ inline void InitBuffers()
    {
        uint32_t g = t_.headGroup;
        pipe_.InitBuffer(rowQueue_, 2, kMissBatch * t_.rowDim * sizeof(bfloat16_t));
        pipe_.InitBuffer(acc_, g * t_.latentDim * sizeof(float));       // O
        pipe_.InitBuffer(tileOut_, g * t_.latentDim * sizeof(float));   // P . k_lat of one tile
        pipe_.InitBuffer(logits_, g * kKvTile * sizeof(float));         // S, then P
        pipe_.InitBuffer(probs_, g * kKvTile * sizeof(bfloat16_t));     // P as the cube's A operand
        pipe_.InitBuffer(valid_, kKvTile * sizeof(float));              // 1 valid / 0 padding
        pipe_.InitBuffer(bias_, kKvTile * sizeof(float));               // 0 valid / kMaskedLogit padding
        pipe_.InitBuffer(stats_, 4 * AlignUp(g * sizeof(float), 32));    // m, m', correction, l
        pipe_.InitBuffer(work_, 256 * sizeof(float));                   // reduce scratch
        pipe_.InitBuffer(indices_, AlignUp(t_.topK * sizeof(int32_t), 32));
        pipe_.InitBuffer(outRow_, t_.latentDim * sizeof(bfloat16_t));
    }

    __aicore__ inline void BindGm(const CopySfaArgs &a)
    {
        query_ = Gm<bfloat16_t>(a.query);
        queryRope_ = Gm<bfloat16_t>(a.queryRope);
        host_ = Gm<bfloat16_t>(a.host);
        hot_ = Gm<bfloat16_t>(a.hot);
        overflow_ = Gm<bfloat16_t>(a.overflow);  // unused (nullptr) without overflow rows
        sparse_ = Gm<int32_t>(a.sparseIndices);
        tokenRows_ = Gm<int32_t>(a.tokenRows);
        missTokens_ = Gm<int32_t>(a.missTokens);
        missSlots_ = Gm<int32_t>(a.missSlots);
        missCount_ = Gm<int32_t>(a.missCount);
        tokenTable_ = Gm<int32_t>(a.tokenTable);
        out_ = Gm<bfloat16_t>(a.out);
        // this core's scratch: k_lat [K, Dl], k_rope [K, Dr] (bf16), S [G, tile] and
        // P.k_lat [G, Dl] (fp32), P [G, tile] (bf16)
        GM_ADDR base = AscendC::GetUserWorkspace(a.workspace) +
                       static_cast<uint64_t>(VectorCoreIndex()) * t_.scratchBytes;
        uint64_t off = 0;
        kLat_ = Gm<bfloat16_t>(base + off);
        off += static_cast<uint64_t>(t_.topK) * t_.latentDim * sizeof(bfloat16_t);
        kRope_ = Gm<bfloat16_t>(base + off);
        off += static_cast<uint64_t>(t_.topK) * t_.ropeDim * sizeof(bfloat16_t);
        sGm_ = Gm<float>(base + off);
        off += static_cast<uint64_t>(t_.headGroup) * kKvTile * sizeof(float);
        oGm_ = Gm<float>(base + off);
        off += static_cast<uint64_t>(t_.headGroup) * t_.latentDim * sizeof(float);
        pGm_ = Gm<bfloat16_t>(base + off);
    }

    // ------------------------------------------------------------ 1. miss copy
    __aicore__ inline void CopyMisses(uint32_t row)
    {
        uint32_t n = static_cast<uint32_t>(missCount_.GetValue(row));
        uint32_t rowBytes = t_.rowDim * sizeof(bfloat16_t);
        AscendC::DataCopyExtParams one{1, rowBytes, 0, 0, 0};
        AscendC::DataCopyPadExtParams<bfloat16_t> noPad{false, 0, 0, 0};
        for (uint32_t i0 = 0; i0 < n; i0 += kMissBatch) {
            uint32_t batch = n - i0 < kMissBatch ? n - i0 : kMissBatch;
            AscendC::LocalTensor<bfloat16_t> buf = rowQueue_.AllocTensor<bfloat16_t>();
            for (uint32_t b = 0; b < batch; ++b) {
                int32_t pos = missTokens_.GetValue(row * t_.missWidth + i0 + b);
                int64_t src = tokenTable_.GetValue(static_cast<uint64_t>(row) * t_.maxCtx + pos);
                AscendC::DataCopyPad(buf[b * t_.rowDim], host_[src * t_.rowDim], one, noPad);
            }
            rowQueue_.EnQue(buf);
            buf = rowQueue_.DeQue<bfloat16_t>();
            for (uint32_t b = 0; b < batch; ++b) {
                int64_t dst = static_cast<int64_t>(row) * t_.hotTokens + missSlots_.GetValue(row * t_.missWidth + i0 + b);
                AscendC::DataCopyPad(hot_[dst * t_.rowDim], buf[b * t_.rowDim], one);
            }
            rowQueue_.FreeTensor(buf);
        }
    }

    // ---------------------------------------------------------------- 2. gather
    __aicore__ inline void Gather(uint32_t token)
    {
        AscendC::LocalTensor<int32_t> idx = indices_.Get<int32_t>();
        LoadExact(idx, sparse_[token * t_.topK], t_.topK);
        WaitPipe<AscendC::HardEvent::MTE2_S>();
        uint32_t latBytes = t_.latentDim * sizeof(bfloat16_t);
        uint32_t ropeBytes = t_.ropeDim * sizeof(bfloat16_t);
        AscendC::DataCopyExtParams whole{1, t_.rowDim * static_cast<uint32_t>(sizeof(bfloat16_t)), 0, 0, 0};
        AscendC::DataCopyExtParams lat{1, latBytes, 0, 0, 0};
        AscendC::DataCopyExtParams rope{1, ropeBytes, 0, 0, 0};
        AscendC::DataCopyPadExtParams<bfloat16_t> noPad{false, 0, 0, 0};
        for (uint32_t j0 = 0; j0 < t_.topK; j0 += kMissBatch) {
            uint32_t batch = t_.topK - j0 < kMissBatch ? t_.topK - j0 : kMissBatch;
            AscendC::LocalTensor<bfloat16_t> buf = rowQueue_.AllocTensor<bfloat16_t>();
            // padding entries become zero rows (finite: 0 * garbage would not be)
            AscendC::Duplicate(buf.ReinterpretCast<uint16_t>(), static_cast<uint16_t>(0), batch * t_.rowDim);
            WaitPipe<AscendC::HardEvent::V_MTE2>();
            for (uint32_t b = 0; b < batch; ++b) {
                int64_t r = idx.GetValue(j0 + b);
                int64_t hotRows = static_cast<int64_t>(t_.rows) * t_.hotTokens;
                if (r >= hotRows) {  // a row of the overflow area
                    AscendC::DataCopyPad(buf[b * t_.rowDim], overflow_[(r - hotRows) * t_.rowDim], whole, noPad);
                } else if (r >= 0) {
                    AscendC::DataCopyPad(buf[b * t_.rowDim], hot_[r * t_.rowDim], whole, noPad);
                }
            }
            rowQueue_.EnQue(buf);
            buf = rowQueue_.DeQue<bfloat16_t>();
            for (uint32_t b = 0; b < batch; ++b) {
                uint64_t j = j0 + b;
                AscendC::DataCopyPad(kLat_[j * t_.latentDim], buf[b * t_.rowDim], lat);
                AscendC::DataCopyPad(kRope_[j * t_.ropeDim], buf[b * t_.rowDim + t_.latentDim], rope);
            }
            rowQueue_.FreeTensor(buf);
        }
    }

    // ------------------------------------------------------------- 3. attention
    __aicore__ inline void AttendHeads(uint32_t token, uint32_t h0)
    {
        uint32_t g = t_.headGroup;
        uint32_t dl = t_.latentDim;
        AscendC::LocalTensor<float> acc = acc_.Get<float>();
        AscendC::LocalTensor<float> stats = stats_.Get<float>();
        uint32_t statStride = AlignUp(g * sizeof(float), 32) / sizeof(float);
        AscendC::LocalTensor<float> mOld = stats;
        AscendC::LocalTensor<float> mNew = stats[statStride];
        AscendC::LocalTensor<float> corr = stats[2 * statStride];
        AscendC::LocalTensor<float> l = stats[3 * statStride];
        AscendC::Duplicate(acc, 0.0f, g * dl);
        AscendC::Duplicate(mOld, kMaskedLogit, g);
        AscendC::Duplicate(l, 0.0f, g);
        AscendC::PipeBarrier<PIPE_V>();

        AscendC::GlobalTensor<bfloat16_t> qLat = query_[(static_cast<uint64_t>(token) * t_.heads + h0) * dl];
        AscendC::GlobalTensor<bfloat16_t> qRope =
            queryRope_[(static_cast<uint64_t>(token) * t_.heads + h0) * t_.ropeDim];
        for (uint32_t j0 = 0; j0 < t_.topK; j0 += kKvTile) {  // K is a multiple of kKvTile
            if (!TileValidity(j0)) {
                continue;  // no valid entry in this tile: contributes nothing
            }
            Logits(qLat, qRope, j0);
            Softmax(g, mOld, mNew, corr, l, acc);
            Values(j0, acc);
        }
        Finish(token, h0, l, acc);
    }

    // valid_/bias_ for entries j0..j0+kKvTile; false when none is valid
    __aicore__ inline bool TileValidity(uint32_t j0)
    {
        AscendC::LocalTensor<int32_t> idx = indices_.Get<int32_t>();
        AscendC::LocalTensor<float> valid = valid_.Get<float>();
        AscendC::LocalTensor<float> bias = bias_.Get<float>();
        WaitPipe<AscendC::HardEvent::V_S>();
        bool any = false;
        for (uint32_t j = 0; j < kKvTile; ++j) {
            bool ok = idx.GetValue(j0 + j) >= 0;
            any = any || ok;
            valid.SetValue(j, ok ? 1.0f : 0.0f);
            bias.SetValue(j, ok ? 0.0f : kMaskedLogit);
        }
        WaitPipe<AscendC::HardEvent::S_V>();
        return any;
    }

    // S = q_lat . k_lat^T + q_rope . k_rope^T into logits_ (UB), masked and scaled
    __aicore__ inline void Logits(const AscendC::GlobalTensor<bfloat16_t> &qLat,
                                  const AscendC::GlobalTensor<bfloat16_t> &qRope, uint32_t j0)
    {
        uint32_t g = t_.headGroup;
        AscendC::PipeBarrier<PIPE_ALL>();  // the previous tile's vector work is done with logits_
        qkLat_.SetTensorA(qLat);
        qkLat_.SetTensorB(kLat_[static_cast<uint64_t>(j0) * t_.latentDim], true);
        qkLat_.IterateAll(sGm_);
        qkRope_.SetTensorA(qRope);
        qkRope_.SetTensorB(kRope_[static_cast<uint64_t>(j0) * t_.ropeDim], true);
        qkRope_.IterateAll(sGm_, 1);  // atomic add onto the latent part
        AscendC::LocalTensor<float> s = logits_.Get<float>();
        AscendC::LocalTensor<float> valid = valid_.Get<float>();
        AscendC::LocalTensor<float> bias = bias_.Get<float>();
        AscendC::DataCopy(s, sGm_, g * kKvTile);
        WaitPipe<AscendC::HardEvent::MTE2_V>();
        for (uint32_t h = 0; h < g; ++h) {
            AscendC::Muls(s[h * kKvTile], s[h * kKvTile], t_.scaleValue, kKvTile);
            AscendC::Mul(s[h * kKvTile], s[h * kKvTile], valid, kKvTile);
            AscendC::Add(s[h * kKvTile], s[h * kKvTile], bias, kKvTile);
        }
        AscendC::PipeBarrier<PIPE_V>();
    }

    // online softmax update: P in logits_ (fp32) and probs_ (bf16), O and l rescaled
    __aicore__ inline void Softmax(uint32_t g, const AscendC::LocalTensor<float> &mOld,
                                   const AscendC::LocalTensor<float> &mNew, const AscendC::LocalTensor<float> &corr,
                                   const AscendC::LocalTensor<float> &l, const AscendC::LocalTensor<float> &acc)
    {
        AscendC::LocalTensor<float> s = logits_.Get<float>();
        AscendC::LocalTensor<float> valid = valid_.Get<float>();
        AscendC::LocalTensor<float> work = work_.Get<float>();
        for (uint32_t h = 0; h < g; ++h) {
            AscendC::ReduceMax(work, s[h * kKvTile], work[64], kKvTile);
            WaitPipe<AscendC::HardEvent::V_S>();
            float rowMax = work.GetValue(0);
            float old = mOld.GetValue(h);
            mNew.SetValue(h, rowMax > old ? rowMax : old);
            WaitPipe<AscendC::HardEvent::S_V>();
        }
        AscendC::Sub(corr, mOld, mNew, g);
        AscendC::PipeBarrier<PIPE_V>();
        AscendC::Exp(corr, corr, g);  // exp(m - m'), 1 while nothing valid was seen
        AscendC::PipeBarrier<PIPE_V>();
        WaitPipe<AscendC::HardEvent::V_S>();
        for (uint32_t h = 0; h < g; ++h) {
            float m = mNew.GetValue(h);
            float c = corr.GetValue(h);
            WaitPipe<AscendC::HardEvent::S_V>();
            AscendC::Adds(s[h * kKvTile], s[h * kKvTile], -m, kKvTile);
            AscendC::PipeBarrier<PIPE_V>();
            AscendC::Exp(s[h * kKvTile], s[h * kKvTile], kKvTile);
            AscendC::PipeBarrier<PIPE_V>();
            AscendC::Mul(s[h * kKvTile], s[h * kKvTile], valid, kKvTile);
            AscendC::Muls(acc[h * t_.latentDim], acc[h * t_.latentDim], c, t_.latentDim);
            AscendC::PipeBarrier<PIPE_V>();
            AscendC::ReduceSum(work, s[h * kKvTile], work[64], kKvTile);
            WaitPipe<AscendC::HardEvent::V_S>();
            l.SetValue(h, l.GetValue(h) * c + work.GetValue(0));
        }
        WaitPipe<AscendC::HardEvent::S_V>();
        AscendC::DataCopy(mOld, mNew, AlignUp(g, 8));
        AscendC::LocalTensor<bfloat16_t> p = probs_.Get<bfloat16_t>();
        AscendC::Cast(p, s, AscendC::RoundMode::CAST_RINT, g * kKvTile);
        WaitPipe<AscendC::HardEvent::V_MTE3>();
        AscendC::DataCopy(pGm_, p, g * kKvTile);  // [G, kKvTile]
        WaitPipe<AscendC::HardEvent::MTE3_MTE2>();
        AscendC::PipeBarrier<PIPE_ALL>();  // P is in GM before the cube reads it
    }

    // O += P . k_lat over the tile
    __aicore__ inline void Values(uint32_t j0, const AscendC::LocalTensor<float> &acc)
    {
        uint32_t g = t_.headGroup;
        AscendC::PipeBarrier<PIPE_ALL>();  // P is in GM; tileOut_ is free again
        pv_.SetTensorA(pGm_);
        pv_.SetTensorB(kLat_[static_cast<uint64_t>(j0) * t_.latentDim]);
        pv_.IterateAll(oGm_);
        AscendC::LocalTensor<float> part = tileOut_.Get<float>();
        AscendC::DataCopy(part, oGm_, g * t_.latentDim);
        WaitPipe<AscendC::HardEvent::MTE2_V>();
        AscendC::Add(acc, acc, part, g * t_.latentDim);
        AscendC::PipeBarrier<PIPE_V>();
    }

    __aicore__ inline void Finish(uint32_t token, uint32_t h0, const AscendC::LocalTensor<float> &l,
                                  const AscendC::LocalTensor<float> &acc)
    {
        AscendC::LocalTensor<bfloat16_t> row = outRow_.Get<bfloat16_t>();
        for (uint32_t h = 0; h < t_.headGroup; ++h) {
            WaitPipe<AscendC::HardEvent::V_S>();
            float sum = l.GetValue(h);
            float inv = sum > 0.0f ? 1.0f / sum : 0.0f;  // no valid index: zeros
            WaitPipe<AscendC::HardEvent::S_V>();
            AscendC::Muls(acc[h * t_.latentDim], acc[h * t_.latentDim], inv, t_.latentDim);
            AscendC::PipeBarrier<PIPE_V>();
            AscendC::Cast(row, acc[h * t_.latentDim], AscendC::RoundMode::CAST_RINT, t_.latentDim);
            WaitPipe<AscendC::HardEvent::V_MTE3>();
            uint64_t dst = (static_cast<uint64_t>(token) * t_.heads + h0 + h) * t_.latentDim;
            AscendC::DataCopy(out_[dst], row, t_.latentDim);
            WaitPipe<AscendC::HardEvent::MTE3_V>();
        }
    }

    CopySfaTiling t_;
    TCubeTiling qkLatTiling_;
    TCubeTiling qkRopeTiling_;
    TCubeTiling pvTiling_;
    AscendC::TPipe pipe_;
    AscendC::TQueBind<AscendC::TPosition::VECIN, AscendC::TPosition::VECOUT, 2> rowQueue_;
    AscendC::TBuf<AscendC::TPosition::VECCALC> acc_, tileOut_, logits_, probs_, valid_, bias_, stats_, work_,
        indices_, outRow_;
    QkMatmul qkLat_;
    QkMatmul qkRope_;
    PvMatmul pv_;
    AscendC::GlobalTensor<bfloat16_t> query_, queryRope_, host_, hot_, overflow_, out_, kLat_, kRope_, pGm_;
    AscendC::GlobalTensor<int32_t> sparse_, tokenRows_, missTokens_, missSlots_, missCount_, tokenTable_;
    AscendC::GlobalTensor<float> sGm_, oGm_;
};

}  // namespace sao

extern "C" __global__ __aicore__ void sao_scatter_copy_sparse_flash_attention(
    GM_ADDR query, GM_ADDR queryRope, GM_ADDR host, GM_ADDR hot, GM_ADDR overflow, GM_ADDR sparseIndices,
    GM_ADDR tokenRows, GM_ADDR missTokens, GM_ADDR missSlots, GM_ADDR missCount, GM_ADDR tokenTable, GM_ADDR out,
    GM_ADDR workspace, GM_ADDR tiling)
{
    KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIC_1_2);
    sao::CopySfaArgs a{query,    queryRope, host,     hot,       overflow, sparseIndices, tokenRows,
                       missTokens, missSlots, missCount, tokenTable, out,     workspace,     tiling};
    sao::CopySfaKernel kernel;
    kernel.Run(a);
}
