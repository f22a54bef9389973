/*
 * Driver of the functional model (kernel_operator.h beside this file): runs the project's
 * kernels, compiled unchanged against the model, on simulated cores, and the host tiling
 * (host/tiling.cpp, against the model's platform / Matmul-tiling stand-ins). Called from
 * Python through ctypes (sglang_ascend_offload/kernel_check/functional.py).
 *
 * A launch of blockDim cube cores runs every cube core first (each returns right after
 * REGIST_MATMUL_OBJ, as on hardware where the cube core then serves the vector cores'
 * matmuls; here the Matmul model computes synchronously on the calling vector core), then
 * every vector core 0 .. blockDim * ratio - 1 in the order the caller gives, one after the
 * other, each with a UB poisoned with 0xCD. Running the cores in several orders and getting
 * the same result is the model's check that the kernels need no cross-core ordering.
 */
#include <cstdio>
#include <cstring>
#include <string>

#include "kernel_operator.h"
#include "tiling.h"

namespace sao_model {
CoreState &Core()
{
    static CoreState core;
    return core;
}
std::vector<std::pair<const uint8_t *, const uint8_t *>> &GmRanges()
{
    static std::vector<std::pair<const uint8_t *, const uint8_t *>> ranges;
    return ranges;
}
std::map<std::pair<int, int>, int> &Flags()
{
    static std::map<std::pair<int, int>, int> flags;
    return flags;
}
AscendC::TPipe *&CurrentPipe()
{
    static AscendC::TPipe *pipe = nullptr;
    return pipe;
}
}  // namespace sao_model

namespace sao_model_host {
uint32_t g_aicCores = 24;
uint32_t g_aivCores = 48;
}  // namespace sao_model_host

extern "C" void sao_lightning_indexer_manage(GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR,
                                             GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR,
                                             GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR);
extern "C" void sao_quant_lightning_indexer_manage(GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR,
                                                   GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR,
                                                   GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR,
                                                   GM_ADDR, GM_ADDR, GM_ADDR);
extern "C" void sao_scatter_copy_sparse_flash_attention(GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR,
                                                        GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR,
                                                        GM_ADDR, GM_ADDR);
extern "C" void sao_copy_miss_rows(GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR);

namespace {
void Error(char *err, int len, const std::string &msg)
{
    if (err != nullptr && len > 0) {
        std::snprintf(err, static_cast<size_t>(len), "%s", msg.c_str());
    }
}

void Finish(sao::host::Launch &launch, uint8_t *tiling, uint64_t *workspace, uint32_t *blockDim)
{
    std::memcpy(tiling, launch.tiling.data(), launch.tiling.size());
    *workspace = launch.workspaceBytes;
    *blockDim = launch.blockDim;
}
}  // namespace

extern "C" {

uint32_t sao_model_tiling_bytes() { return sao::kTilingBytes; }

// shape: numTokens, numRequests, indexHeads, indexDim, blockSize, maxBlocks, rows, hotTokens,
// topK, sparseMode, quantized, rowTokens. Returns 0, 1 (shape unsupported: err says why) or 2 (error).
int sao_model_tile_lim(const uint32_t *shape, uint32_t aic, uint32_t aiv, uint8_t *tiling, uint64_t *workspace,
                       uint32_t *blockDim, char *err, int errLen)
{
    try {
        sao_model_host::g_aicCores = aic;
        sao_model_host::g_aivCores = aiv;
        sao::host::LimShape s{shape[0], shape[1], shape[2], shape[3], shape[4], shape[5],
                              shape[6], shape[7], shape[8], shape[9], shape[10] != 0, shape[11]};
        std::string problem = sao::host::CheckLim(s);
        if (!problem.empty()) {
            Error(err, errLen, problem);
            return 1;
        }
        sao::host::Launch launch = sao::host::TileLim(s);
        Finish(launch, tiling, workspace, blockDim);
        return 0;
    } catch (const std::exception &e) {
        Error(err, errLen, e.what());
        return 2;
    }
}

// shape: numTokens, heads, latentDim, ropeDim, rows, hotTokens, topK, maxCtx, missWidth, rowTokens; scale
// separately.
int sao_model_tile_copy_sfa(const uint32_t *shape, float scale, uint32_t aic, uint32_t aiv, uint8_t *tiling,
                            uint64_t *workspace, uint32_t *blockDim, char *err, int errLen)
{
    try {
        sao_model_host::g_aicCores = aic;
        sao_model_host::g_aivCores = aiv;
        sao::host::CopySfaShape s{shape[0], shape[1], shape[2], shape[3], shape[4], shape[5], shape[6], shape[7], scale,
                                  shape[8], shape[9]};
        std::string problem = sao::host::CheckCopySfa(s);
        if (!problem.empty()) {
            Error(err, errLen, problem);
            return 1;
        }
        sao::host::Launch launch = sao::host::TileCopySfa(s);
        Finish(launch, tiling, workspace, blockDim);
        return 0;
    } catch (const std::exception &e) {
        Error(err, errLen, e.what());
        return 2;
    }
}

// shape: entries, rowDim, hotTokens, missWidth, maxCtx.
int sao_model_tile_copy_rows(const uint32_t *shape, uint32_t aic, uint32_t aiv, uint8_t *tiling,
                             uint64_t *workspace, uint32_t *blockDim, char *err, int errLen)
{
    try {
        sao_model_host::g_aicCores = aic;
        sao_model_host::g_aivCores = aiv;
        sao::host::CopyRowsShape s{shape[0], shape[1], shape[2], shape[3], shape[4]};
        std::string problem = sao::host::CheckCopyRows(s);
        if (!problem.empty()) {
            Error(err, errLen, problem);
            return 1;
        }
        sao::host::Launch launch = sao::host::TileCopyRows(s);
        Finish(launch, tiling, workspace, blockDim);
        return 0;
    } catch (const std::exception &e) {
        Error(err, errLen, e.what());
        return 2;
    }
}

// kernel: 0 LIM (22 args), 1 LIM-C8 (24 args), 2 Copy-SFA (14 args), 3 miss copy (9 args). ranges: (address, bytes)
// pairs of every GM buffer of the launch. order: the vector cores, a permutation of
// 0 .. blockDim * ratio - 1. Returns 0, or 1 with the model's fault in err.
int sao_model_run(int kernel, void **a, int nargs, uint32_t blockDim, uint32_t ratio, const uint32_t *order,
                  int norder, const uint64_t *ranges, int nranges, char *err, int errLen)
{
    static const int kArgs[4] = {22, 24, 14, 9};
    if (kernel < 0 || kernel > 3 || nargs != kArgs[kernel]) {
        Error(err, errLen, "sao_model_run: bad kernel id or argument count");
        return 1;
    }
    if (norder != static_cast<int>(blockDim * ratio)) {
        Error(err, errLen, "sao_model_run: the core order must list blockDim * ratio vector cores");
        return 1;
    }
    auto &gm = sao_model::GmRanges();
    gm.clear();
    for (int i = 0; i < nranges; ++i) {
        auto *p = reinterpret_cast<const uint8_t *>(ranges[2 * i]);
        gm.emplace_back(p, p + ranges[2 * i + 1]);
    }
    auto g = [&](int i) { return static_cast<GM_ADDR>(a[i]); };
    auto launch = [&]() {
        if (kernel == 0) {
            sao_lightning_indexer_manage(g(0), g(1), g(2), g(3), g(4), g(5), g(6), g(7), g(8), g(9), g(10), g(11),
                                         g(12), g(13), g(14), g(15), g(16), g(17), g(18), g(19), g(20), g(21));
        } else if (kernel == 1) {
            sao_quant_lightning_indexer_manage(g(0), g(1), g(2), g(3), g(4), g(5), g(6), g(7), g(8), g(9), g(10),
                                               g(11), g(12), g(13), g(14), g(15), g(16), g(17), g(18), g(19), g(20),
                                               g(21), g(22), g(23));
        } else if (kernel == 2) {
            sao_scatter_copy_sparse_flash_attention(g(0), g(1), g(2), g(3), g(4), g(5), g(6), g(7), g(8), g(9),
                                                    g(10), g(11), g(12), g(13));
        } else {
            sao_copy_miss_rows(g(0), g(1), g(2), g(3), g(4), g(5), g(6), g(7), g(8));
        }
    };
    auto &core = sao_model::Core();
    std::string where;
    try {
        core.blockNum = blockDim;
        core.taskRation = ratio;
        for (uint32_t c = 0; c < blockDim; ++c) {
            where = "cube core " + std::to_string(c);
            core.coreType = AscendC::AIC;
            core.blockIdx = c;
            sao_model::Flags().clear();
            launch();
        }
        for (int i = 0; i < norder; ++i) {
            where = "vector core " + std::to_string(order[i]);
            core.coreType = AscendC::AIV;
            core.blockIdx = order[i];
            std::memset(core.ubBase(), 0xCD, sao_model::kUbBytes);
            sao_model::Flags().clear();
            launch();
            for (auto &f : sao_model::Flags()) {
                if (f.second != 0) throw sao_model::Fault("a SetFlag was never waited for");
            }
        }
    } catch (const std::exception &e) {
        Error(err, errLen, where + ": " + e.what());
        return 1;
    }
    return 0;
}

}  // extern "C"
