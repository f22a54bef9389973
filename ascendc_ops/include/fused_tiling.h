/*
 * Tiling structs and limits shared by the host code (host/) and the AscendC kernels
 * (kernels/). Plain C++: no AscendC, torch or CANN headers, so both compilers see the
 * same layout.
 *
 * Layout of the tiling buffer handed to a kernel (one device buffer, uploaded once per
 * shape signature and cached by the host code):
 *
 *     [0, sizeof(XxxTiling))                         our scalar fields
 *     [kCubeTilingOffset + i * kCubeTilingStride, +)  i-th TCubeTiling (Matmul API), as
 *                                                    written by optiling::TCubeTiling::SaveToBuffer
 *
 * STATUS: compiled on CPU (syntax-only, asc-devkit 8.5.0 headers) and run on the functional
 * model (check-kernels); never run on an NPU. See ascendc_ops/README.md.
 */
#ifndef SAO_FUSED_TILING_H
#define SAO_FUSED_TILING_H

#include <cstdint>

namespace sao {

// ---------------------------------------------------------------- kernel limits
// Checked by the host code before a launch (with an error naming the limit); the
// reference rung has none of them.
constexpr uint32_t kIndexDim = 128;          // Di of the lightning indexer
constexpr uint32_t kMaxIndexHeads = 64;      // Hi
constexpr uint32_t kIndexHeadAlign = 8;      // Hi multiple of 8
constexpr uint32_t kBlockAlign = 32;         // index-K block_size multiple of 32 (sort groups)
constexpr uint32_t kMaxBlockSize = 128;      // chunks of AlignUp(K, block_size) stay < 4096 pairs
constexpr uint32_t kSortGroup = 32;          // Sort works on groups of 32 (score, index) pairs
constexpr uint32_t kMaxTopK = 2048;          // K (MrgSort lists are < 4096 long)
constexpr uint32_t kMaxHotTokens = 4096;     // Hh (UB budget of the residency step)
constexpr uint32_t kMaxRowTokens = 14;       // query tokens sharing one row (speculative verify rows)
constexpr uint32_t kMaxPosition = 1u << 24;  // logical positions stay exact as float sort payload
constexpr uint32_t kLatentDim = 512;         // Dl of Copy-SFA
constexpr uint32_t kRopeDim = 64;            // Dr of Copy-SFA
constexpr uint32_t kMinHeads = 8;            // fewer attention heads are zero-padded to 8
constexpr uint32_t kMaxHeads = 128;
constexpr uint32_t kHeadGroup = 16;          // heads attended together (UB holds two [16, 512] fp32)
constexpr uint32_t kKvTile = 128;            // key rows per attention tile
constexpr uint32_t kMissBatch = 16;          // rows per copy round (miss copies, attention gathers)
constexpr uint32_t kLimPoolBytes = 144 * 1024;     // UB pool of one LIM vector core
constexpr uint32_t kCopySfaPoolBytes = 120 * 1024; // UB pool of one Copy-SFA vector core
constexpr uint32_t kCopyRowsPoolBytes = 64 * 1024;  // UB pool of one miss-copy vector core (two row batches)
constexpr uint32_t kUbRowAlign = 16;                // bf16 elements per 32 B: a UB row starts 32 B-aligned

constexpr uint32_t kCubeTilingOffset = 256;  // bytes; our structs stay below this
constexpr uint32_t kCubeTilingStride = 512;  // bytes reserved per TCubeTiling
constexpr uint32_t kTilingBytes = kCubeTilingOffset + 3 * kCubeTilingStride;

// Sentinel score of invisible / padding positions (below every real indexer score).
constexpr float kNegScore = -3.0e38f;

// ------------------------------------------------------------------- LIM, LIM-C8
struct LimTiling {
    uint32_t numTokens;      // T
    uint32_t numRequests;    // B (entries of actual_seq_lengths_*)
    uint32_t indexHeads;     // Hi
    uint32_t indexDim;       // Di
    uint32_t blockSize;      // index-K block size
    uint32_t maxBlocks;      // block_table columns
    uint32_t rows;           // R
    uint32_t hotTokens;      // Hh
    uint32_t hashBits;       // log2 of the residency lookup table size (>= 2 * Hh)
    uint32_t topK;           // K (= sparse_count, multiple of kSortGroup)
    uint32_t sparseMode;     // 0 or 3
    uint32_t quantized;      // 0: bf16 indexer, 1: C8 indexer
    uint32_t vectorCores;    // AIV cores taking part (tokens and rows are strided over them)
    uint32_t logitsBytes;    // GM scratch per vector core for one block's [Hi, blockSize] logits
    uint32_t cubeTilings;    // 1: the [Hi, Di] x [blockSize, Di]^T matmul
    uint32_t chunk;          // positions merged into the running top-K at once: AlignUp(K, blockSize)
    uint32_t rowTokens;      // n: query tokens a row may serve (1, or the verify rows of a request)
    uint32_t unionWidth;     // W = min(n * K, Hh): entries of a row's residency step (the union of its tokens' top-K)
};

// --------------------------------------------------------------------- Copy-SFA
struct CopySfaTiling {
    uint32_t numTokens;      // T
    uint32_t heads;          // N after padding to >= kMinHeads
    uint32_t headGroup;      // heads per pass (<= kHeadGroup, divides heads)
    uint32_t latentDim;      // Dl
    uint32_t ropeDim;        // Dr
    uint32_t rowDim;         // D = Dl + Dr (host and hot rows)
    uint32_t rows;           // R
    uint32_t hotTokens;      // Hh
    uint32_t topK;           // K
    uint32_t maxCtx;         // token_table columns
    uint32_t vectorCores;
    uint32_t scratchBytes;   // GM scratch per vector core (key tiles, logits, probabilities)
    float scaleValue;
    uint32_t cubeTilings;    // 3: q_lat.k_lat^T, q_rope.k_rope^T, p.v
    uint32_t missWidth;      // columns of miss_tokens / miss_slots (K, or min(n * K, Hh) with n tokens per row)
    uint32_t rowTokens;      // n: query tokens a row may serve (1, or the verify rows of a request)
};

// ------------------------------------------------------------ miss copy (rows form)
struct CopyRowsTiling {
    uint32_t entries;        // B: batch entries (rows of the miss lists)
    uint32_t rowDim;         // D: bf16 columns of a host / hot row
    uint32_t ubRowDim;       // D rounded up to kUbRowAlign (a row's stride in UB)
    uint32_t hotTokens;      // Hh: slots per hot-buffer row
    uint32_t missWidth;      // W: columns of miss_tokens / miss_slots
    uint32_t maxCtx;         // token_table columns
    uint32_t vectorCores;    // AIV cores taking part (entries are strided over them)
};

static_assert(sizeof(LimTiling) <= kCubeTilingOffset, "LimTiling overlaps the cube tiling");
static_assert(sizeof(CopySfaTiling) <= kCubeTilingOffset, "CopySfaTiling overlaps the cube tiling");
static_assert(sizeof(CopyRowsTiling) <= kCubeTilingOffset, "CopyRowsTiling overlaps the cube tiling");

}  // namespace sao

#endif  // SAO_FUSED_TILING_H
