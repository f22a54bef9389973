/*
 * Host tiling of the fused kernels: launch geometry, tiling buffer bytes, workspace size,
 * and the checks of the kernels' limits. No torch here (host/torch_ops.cpp adapts).
 *
 * STATUS: compiled on CPU against stand-in CANN headers (tools/host_check_cpu.sh; tiling.cpp
 * also in the functional model of check-kernels); never run on an NPU. See ascendc_ops/README.md.
 */
#ifndef SAO_HOST_TILING_H
#define SAO_HOST_TILING_H

#include <cstdint>
#include <string>
#include <vector>

#include "fused_tiling.h"

namespace sao {
namespace host {

// What a launch needs besides the tensors.
struct Launch {
    uint32_t blockDim = 0;            // cube cores (MIX 1:2: twice as many vector cores)
    std::vector<uint8_t> tiling;      // kTilingBytes: struct + cube tilings
    uint64_t workspaceBytes = 0;      // system (Matmul API) + user scratch
};

// Shapes and attributes of one LIM / LIM-C8 call.
struct LimShape {
    uint32_t numTokens, numRequests, indexHeads, indexDim, blockSize, maxBlocks;
    uint32_t rows, hotTokens, topK, sparseMode;
    bool quantized;
    uint32_t rowTokens = 1;  // query tokens per row: 1, or a request's verify rows (<= kMaxRowTokens)
};

// Shapes and attributes of one Copy-SFA call (heads already padded to >= kMinHeads).
struct CopySfaShape {
    uint32_t numTokens, heads, latentDim, ropeDim, rows, hotTokens, topK, maxCtx;
    float scaleValue;
    uint32_t missWidth = 0;  // miss_tokens / miss_slots columns; 0 means topK
    uint32_t rowTokens = 1;  // query tokens a row may serve (a request's verify rows, <= kMaxRowTokens)
};

// Shapes of one miss copy (rows form): batch entries, row width, hot slots per row, miss
// list columns, token-table columns.
struct CopyRowsShape {
    uint32_t entries, rowDim, hotTokens, missWidth, maxCtx;
};

// Empty string when the kernel supports the shape, else the violated limit.
std::string CheckLim(const LimShape &s);
std::string CheckCopySfa(const CopySfaShape &s);
std::string CheckCopyRows(const CopyRowsShape &s);

// Tiling for a supported shape (call the check first). Queries the SoC through
// platform_ascendc (core counts, Matmul API workspace) and the Matmul tiling API.
Launch TileLim(const LimShape &s);
Launch TileCopySfa(const CopySfaShape &s);
Launch TileCopyRows(const CopyRowsShape &s);

// Entries of a LIM row step: min(tokens_per_row x K, Hh) (the union's positions past Hh
// overflow: the step keeps the first Hh by priority).
uint32_t LimUnionWidth(const LimShape &s);

// Bytes of UB the kernels carve out of their pools (mirror of the kernel layout).
uint32_t LimIndexerUbBytes(const LimTiling &t);
uint32_t LimResidencyUbBytes(const LimTiling &t);

}  // namespace host
}  // namespace sao

#endif  // SAO_HOST_TILING_H
