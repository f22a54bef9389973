/*
 * Host tiling of the fused kernels (see tiling.h).
 *
 * STATUS: compiled on CPU against stand-in CANN headers (tools/host_check_cpu.sh; tiling.cpp
 * also in the functional model of check-kernels); never run on an NPU. See ascendc_ops/README.md.
 */
#include "tiling.h"

#include <algorithm>
#include <cstring>
#include <sstream>
#include <stdexcept>

#include "tiling/platform/platform_ascendc.h"
#include "tiling/tiling_api.h"

namespace sao {
namespace host {
namespace {

constexpr uint32_t kUbBudget = 184 * 1024;  // vector-core UB we allow ourselves (192 KiB on A2/A3)
constexpr uint32_t kScratchAlign = 512;

uint32_t A32(uint64_t bytes) { return static_cast<uint32_t>((bytes + 31) / 32 * 32); }
uint32_t AlignTo(uint64_t v, uint64_t a) { return static_cast<uint32_t>((v + a - 1) / a * a); }

uint32_t HashBits(uint32_t hot)
{
    uint32_t bits = 1;
    while ((1u << bits) < 2 * hot) {
        ++bits;
    }
    return bits;
}

platform_ascendc::PlatformAscendC *Platform()
{
    auto *platform = platform_ascendc::PlatformAscendCManager::GetInstance();
    if (platform == nullptr) {
        throw std::runtime_error("platform_ascendc: no Ascend SoC information (is the CANN environment set?)");
    }
    return platform;
}

// One Matmul API tiling (GM operands, ND), serialised at `dst`.
void CubeTiling(platform_ascendc::PlatformAscendC &platform, matmul_tiling::DataType in,
                matmul_tiling::DataType out, bool transposeB, int m, int n, int k, uint8_t *dst)
{
    matmul_tiling::MatmulApiTiling api(platform);
    api.SetAType(matmul_tiling::TPosition::GM, matmul_tiling::CubeFormat::ND, in, false);
    api.SetBType(matmul_tiling::TPosition::GM, matmul_tiling::CubeFormat::ND, in, transposeB);
    api.SetCType(matmul_tiling::TPosition::GM, matmul_tiling::CubeFormat::ND, out);
    api.SetShape(m, n, k);
    api.SetOrgShape(m, n, k);
    api.SetBias(false);
    api.SetBufferSpace(-1, -1, -1);
    optiling::TCubeTiling tiling;
    if (api.GetTiling(tiling) == -1) {
        std::ostringstream msg;
        msg << "Matmul tiling failed for [" << m << ", " << k << "] x [" << k << ", " << n << "]";
        throw std::runtime_error(msg.str());
    }
    if (tiling.GetDataSize() > kCubeTilingStride) {
        throw std::runtime_error("TCubeTiling larger than the space reserved for it (kCubeTilingStride)");
    }
    tiling.SaveToBuffer(dst, tiling.GetDataSize());
}

template <typename T>
void PutStruct(std::vector<uint8_t> &buffer, const T &value)
{
    std::memcpy(buffer.data(), &value, sizeof(T));
}

// Cube cores for `units` independent work items spread over vector cores (2 per cube core).
uint32_t BlockDim(platform_ascendc::PlatformAscendC &platform, uint32_t units)
{
    uint32_t aic = platform.GetCoreNumAic();
    uint32_t aiv = platform.GetCoreNumAiv();
    uint32_t ratio = std::max(1u, aiv / std::max(1u, aic));
    uint32_t want = (std::max(1u, units) + ratio - 1) / ratio;
    return std::max(1u, std::min(aic, want));
}

}  // namespace

// ------------------------------------------------------------------------ LIM
uint32_t LimIndexerUbBytes(const LimTiling &t)
{
    uint64_t hb = static_cast<uint64_t>(t.indexHeads) * t.blockSize;
    uint64_t mergedFloats = 2ull * (t.topK + t.chunk);
    uint32_t bytes = A32(hb * 4);                      // raw logits (fp32 | int32)
    bytes += t.quantized ? A32(hb * 4) : 0;            // fp32 logits of the C8 path
    bytes += hb * 4 >= mergedFloats * 4 ? 0 : A32(mergedFloats * 4);
    bytes += A32(t.indexHeads * 2) + A32(t.indexHeads * 4) + A32(t.indexHeads * 2) + A32(t.indexHeads * 4);
    bytes += A32(t.blockSize * 2) + A32(t.blockSize * 4);
    bytes += A32(t.chunk * 4) * 2 + A32(t.chunk * 8) * 2 + A32(t.topK * 8);
    return bytes;
}

uint32_t LimUnionWidth(const LimShape &s)
{
    uint64_t all = static_cast<uint64_t>(s.rowTokens) * s.topK;  // n x K: the union's bound
    return static_cast<uint32_t>(std::min<uint64_t>(all, s.hotTokens));
}

uint32_t LimResidencyUbBytes(const LimTiling &t)
{
    uint32_t w = t.unionWidth != 0 ? t.unionWidth : t.topK;  // entries per row step
    uint32_t hot = t.hotTokens;
    return A32(hot * 4) + A32(hot * 8) + A32((1u << t.hashBits) * 2) + A32(hot * 2) + 4 * A32(w * 4) +
           A32(A32(w)) + 2 * 32;
}

std::string CheckLim(const LimShape &s)
{
    std::ostringstream e;
    if (s.indexDim != kIndexDim) e << "index head dim must be " << kIndexDim << " (got " << s.indexDim << "); ";
    if (s.indexHeads == 0 || s.indexHeads > kMaxIndexHeads || s.indexHeads % kIndexHeadAlign != 0)
        e << "index heads must be a multiple of " << kIndexHeadAlign << " up to " << kMaxIndexHeads << " (got "
          << s.indexHeads << "); ";
    if (s.blockSize == 0 || s.blockSize % kBlockAlign != 0 || s.blockSize > kMaxBlockSize)
        e << "index-K block_size must be a multiple of " << kBlockAlign << " up to " << kMaxBlockSize << " (got "
          << s.blockSize << "); ";
    if (s.topK == 0 || s.topK % kSortGroup != 0 || s.topK > kMaxTopK)
        e << "sparse_count must be a multiple of " << kSortGroup << " up to " << kMaxTopK << " (got " << s.topK
          << "); ";
    if (s.hotTokens < s.topK || s.hotTokens % kSortGroup != 0 || s.hotTokens > kMaxHotTokens)
        e << "hot_tokens must be >= sparse_count, a multiple of " << kSortGroup << ", up to " << kMaxHotTokens
          << " (got " << s.hotTokens << "); ";
    if (s.rowTokens == 0 || s.rowTokens > kMaxRowTokens)
        e << "tokens_per_row must be 1.." << kMaxRowTokens << " (got " << s.rowTokens << "); ";
    if (static_cast<uint64_t>(s.maxBlocks) * s.blockSize > kMaxPosition)
        e << "block_table covers more than 2^24 positions; ";
    if (s.sparseMode != 0 && s.sparseMode != 3) e << "sparse_mode must be 0 or 3 (got " << s.sparseMode << "); ";
    if (e.str().empty()) {
        LimTiling t{};
        t.indexHeads = s.indexHeads;
        t.blockSize = s.blockSize;
        t.topK = s.topK;
        t.hotTokens = s.hotTokens;
        t.hashBits = HashBits(s.hotTokens);
        t.chunk = AlignTo(s.topK, s.blockSize);
        t.quantized = s.quantized ? 1 : 0;
        t.unionWidth = LimUnionWidth(s);
        uint32_t need = std::max(LimIndexerUbBytes(t), LimResidencyUbBytes(t));
        if (need > kLimPoolBytes) e << "UB pool too small for this shape (" << need << " bytes needed); ";
    }
    return e.str();
}

Launch TileLim(const LimShape &s)
{
    auto &platform = *Platform();
    LimTiling t{};
    t.numTokens = s.numTokens;
    t.numRequests = s.numRequests;
    t.indexHeads = s.indexHeads;
    t.indexDim = s.indexDim;
    t.blockSize = s.blockSize;
    t.maxBlocks = s.maxBlocks;
    t.rows = s.rows;
    t.hotTokens = s.hotTokens;
    t.hashBits = HashBits(s.hotTokens);
    t.topK = s.topK;
    t.sparseMode = s.sparseMode;
    t.quantized = s.quantized ? 1 : 0;
    t.chunk = AlignTo(s.topK, s.blockSize);
    t.rowTokens = s.rowTokens;
    t.unionWidth = LimUnionWidth(s);
    t.cubeTilings = 1;
    t.logitsBytes = AlignTo(static_cast<uint64_t>(s.indexHeads) * s.blockSize * 4, kScratchAlign);

    Launch launch;
    launch.blockDim = BlockDim(platform, std::max(s.numTokens, s.rows));
    t.vectorCores = launch.blockDim * std::max(1u, platform.GetCoreNumAiv() / std::max(1u, platform.GetCoreNumAic()));
    launch.tiling.assign(kTilingBytes, 0);
    PutStruct(launch.tiling, t);
    auto in = s.quantized ? matmul_tiling::DataType::DT_INT8 : matmul_tiling::DataType::DT_BF16;
    auto out = s.quantized ? matmul_tiling::DataType::DT_INT32 : matmul_tiling::DataType::DT_FLOAT;
    CubeTiling(platform, in, out, true, static_cast<int>(s.indexHeads), static_cast<int>(s.blockSize),
               static_cast<int>(s.indexDim), launch.tiling.data() + kCubeTilingOffset);
    launch.workspaceBytes = platform.GetLibApiWorkSpaceSize() + static_cast<uint64_t>(t.vectorCores) * t.logitsBytes;
    return launch;
}

// ------------------------------------------------------------------- Copy-SFA
std::string CheckCopySfa(const CopySfaShape &s)
{
    std::ostringstream e;
    if (s.latentDim != kLatentDim || s.ropeDim != kRopeDim)
        e << "Copy-SFA needs Dl=" << kLatentDim << ", Dr=" << kRopeDim << " (got " << s.latentDim << ", "
          << s.ropeDim << "); ";
    bool headsOk = false;
    for (uint32_t n = kMinHeads; n <= kMaxHeads; n *= 2) headsOk = headsOk || s.heads == n;
    if (!headsOk) e << "heads must be 8, 16, 32, 64 or 128 after padding (got " << s.heads << "); ";
    if (s.topK == 0 || s.topK % kKvTile != 0 || s.topK > kMaxTopK)
        e << "sparse_indices K must be a multiple of " << kKvTile << " up to " << kMaxTopK << " (got " << s.topK
          << "); ";
    if (static_cast<uint64_t>(s.rows) * s.hotTokens >= (1ull << 31)) e << "R * Hh must fit int32; ";
    uint32_t w = s.missWidth != 0 ? s.missWidth : s.topK;
    if (s.rowTokens == 0 || s.rowTokens > kMaxRowTokens)
        e << "tokens_per_row must be 1.." << kMaxRowTokens << " (got " << s.rowTokens << "); ";
    else if (s.topK != 0 && (w < s.topK || w > static_cast<uint64_t>(s.rowTokens) * s.topK))
        e << "miss lists must be K .. tokens_per_row x K wide (min(n x K, Hh)): got " << w << " for K " << s.topK
          << " and " << s.rowTokens << " tokens per row; ";
    return e.str();
}

Launch TileCopySfa(const CopySfaShape &s)
{
    auto &platform = *Platform();
    CopySfaTiling t{};
    t.numTokens = s.numTokens;
    t.heads = s.heads;
    t.headGroup = std::min(kHeadGroup, s.heads);
    t.latentDim = s.latentDim;
    t.ropeDim = s.ropeDim;
    t.rowDim = s.latentDim + s.ropeDim;
    t.rows = s.rows;
    t.hotTokens = s.hotTokens;
    t.topK = s.topK;
    t.maxCtx = s.maxCtx;
    t.missWidth = s.missWidth != 0 ? s.missWidth : s.topK;
    t.rowTokens = s.rowTokens;
    t.scaleValue = s.scaleValue;
    t.cubeTilings = 3;
    uint64_t g = t.headGroup;
    uint64_t scratch = static_cast<uint64_t>(s.topK) * (s.latentDim + s.ropeDim) * 2  // k_lat, k_rope
                       + g * kKvTile * 4 + g * s.latentDim * 4 + g * kKvTile * 2;     // S, P.k_lat, P
    t.scratchBytes = AlignTo(scratch, kScratchAlign);

    uint32_t ub = 2 * kMissBatch * t.rowDim * 2 + 2 * A32(g * s.latentDim * 4) + A32(g * kKvTile * 4) +
                  A32(g * kKvTile * 2) + 2 * A32(kKvTile * 4) + 4 * A32(g * 4) + A32(256 * 4) + A32(s.topK * 4) +
                  A32(s.latentDim * 2);
    if (ub > kUbBudget) {
        throw std::runtime_error("Copy-SFA: UB budget exceeded for this shape");
    }

    Launch launch;
    launch.blockDim = BlockDim(platform, s.numTokens);
    t.vectorCores = launch.blockDim * std::max(1u, platform.GetCoreNumAiv() / std::max(1u, platform.GetCoreNumAic()));
    launch.tiling.assign(kTilingBytes, 0);
    PutStruct(launch.tiling, t);
    uint8_t *cube = launch.tiling.data() + kCubeTilingOffset;
    int gi = static_cast<int>(g);
    CubeTiling(platform, matmul_tiling::DataType::DT_BF16, matmul_tiling::DataType::DT_FLOAT, true, gi,
               static_cast<int>(kKvTile), static_cast<int>(s.latentDim), cube);
    CubeTiling(platform, matmul_tiling::DataType::DT_BF16, matmul_tiling::DataType::DT_FLOAT, true, gi,
               static_cast<int>(kKvTile), static_cast<int>(s.ropeDim), cube + kCubeTilingStride);
    CubeTiling(platform, matmul_tiling::DataType::DT_BF16, matmul_tiling::DataType::DT_FLOAT, false, gi,
               static_cast<int>(s.latentDim), static_cast<int>(kKvTile), cube + 2 * kCubeTilingStride);
    launch.workspaceBytes = platform.GetLibApiWorkSpaceSize() + static_cast<uint64_t>(t.vectorCores) * t.scratchBytes;
    return launch;
}

// ------------------------------------------------------------------ miss copy
std::string CheckCopyRows(const CopyRowsShape &s)
{
    std::ostringstream e;
    if (s.rowDim == 0) e << "row width D must be >= 1; ";
    uint64_t ub = 2ull * kMissBatch * AlignTo(s.rowDim, kUbRowAlign) * 2;
    if (ub > kCopyRowsPoolBytes)
        e << "rows of " << s.rowDim << " bf16 columns exceed the copy's UB (" << kMissBatch << " x 2 rows, at most "
          << kCopyRowsPoolBytes / (4 * kMissBatch) << " columns); ";
    if (s.hotTokens == 0) e << "hot slots per row must be >= 1; ";
    if (s.missWidth == 0) e << "miss lists must have >= 1 column; ";
    if (s.maxCtx == 0) e << "token_table must have >= 1 column; ";
    return e.str();
}

Launch TileCopyRows(const CopyRowsShape &s)
{
    auto &platform = *Platform();
    CopyRowsTiling t{};
    t.entries = s.entries;
    t.rowDim = s.rowDim;
    t.ubRowDim = AlignTo(s.rowDim, kUbRowAlign);
    t.hotTokens = s.hotTokens;
    t.missWidth = s.missWidth;
    t.maxCtx = s.maxCtx;
    Launch launch;
    launch.blockDim = BlockDim(platform, s.entries);
    t.vectorCores = launch.blockDim * std::max(1u, platform.GetCoreNumAiv() / std::max(1u, platform.GetCoreNumAic()));
    launch.tiling.assign(kTilingBytes, 0);
    PutStruct(launch.tiling, t);
    launch.workspaceBytes = platform.GetLibApiWorkSpaceSize();  // the runtime's system workspace only
    return launch;
}

}  // namespace host
}  // namespace sao
