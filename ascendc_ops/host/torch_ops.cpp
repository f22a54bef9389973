/*
 * torch op registration of the fused kernels: the extension module
 * sglang_ascend_offload._C_ascend, ops under torch.ops.sglang_ascend_offload.
 *
 * ABI (docs/fused_ops.md has one table per op with every argument's dtype, shape and
 * direction; the Python wrappers are sglang_ascend_offload/ops/fused.py):
 *
 *   npu_fused_lightning_indexer_manage        LIM     (bf16 indexer + residency manage)
 *   npu_fused_quant_lightning_indexer_manage  LIM-C8  (int8 Hadamard-rotated indexer)
 *   npu_fused_scatter_copy_sparse_flash_attention     Copy-SFA
 *   npu_fused_copy_miss_rows                  the miss copy on its own (rows form)
 *   npu_fused_register_host_memory            maps a host pool for Copy-SFA and the miss copy
 *
 * Residency state is per row (docs/residency_contract.md): slot_token int32 [R, Hh],
 * slot_stamp int64 [R, Hh], row_req int64 [R], updated in place (annotated (a!) ...).
 * Every device-side branch (row reset / first fill / steady; rows of misses to copy) is
 * decided by the kernels from device data; nothing here reads device memory, so a call
 * can be captured in a graph once its shape has been seen (the tiling buffer of a shape
 * is uploaded on its first call and cached).
 *
 * Launches go through at_npu::native::OpCommand with a custom handler, so they are
 * ordered with the other torch_npu work of the current stream (task queue included).
 *
 * STATUS: compiled on CPU against stand-in CANN headers (tools/host_check_cpu.sh; tiling.cpp
 * also in the functional model of check-kernels); never run on an NPU. See ascendc_ops/README.md.
 */
#include <Python.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "acl/acl.h"
#include "torch_npu/csrc/core/npu/NPUStream.h"
#include "torch_npu/csrc/framework/OpCommand.h"

#include "aclrtlaunch_sao_lightning_indexer_manage.h"
#include "aclrtlaunch_sao_quant_lightning_indexer_manage.h"
#include "aclrtlaunch_sao_scatter_copy_sparse_flash_attention.h"
#include "aclrtlaunch_sao_copy_miss_rows.h"

#include "fused_tiling.h"
#include "tiling.h"

namespace sao {
namespace {

using LimOutputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// ------------------------------------------------------------------ checks
void CheckTensor(const at::Tensor &t, const char *name, at::ScalarType dtype, int64_t dim,
                 const at::Device &device)
{
    TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", c10::toString(dtype), ", got ",
                c10::toString(t.scalar_type()));
    TORCH_CHECK(t.dim() == dim, name, " must have ", dim, " dims, got shape ", t.sizes());
    TORCH_CHECK(t.device() == device, name, " must be on ", device, ", got ", t.device());
    TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

void CheckShape(const at::Tensor &t, const char *name, std::vector<int64_t> shape)
{
    TORCH_CHECK(t.sizes().vec() == shape, name, " must have shape ", at::IntArrayRef(shape), ", got ", t.sizes());
}

// ------------------------------------------------------------ tiling cache
// One device tiling buffer per shape signature: uploaded on first use, reused after
// (graph capture needs the upload to have happened before the capture).
at::Tensor DeviceTiling(const std::string &key, const std::vector<uint8_t> &bytes, const at::Device &device)
{
    static std::mutex mutex;
    static std::map<std::string, at::Tensor> cache;
    std::lock_guard<std::mutex> lock(mutex);
    std::string full = key + "@" + device.str();
    auto it = cache.find(full);
    if (it != cache.end()) {
        return it->second;
    }
    at::Tensor cpu = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
    std::memcpy(cpu.data_ptr(), bytes.data(), bytes.size());
    at::Tensor dev = cpu.to(device);
    cache.emplace(full, dev);
    return dev;
}

std::string LimKey(const host::LimShape &s)
{
    std::ostringstream k;
    k << (s.quantized ? "limc8:" : "lim:") << s.numTokens << ',' << s.numRequests << ',' << s.indexHeads << ','
      << s.indexDim << ',' << s.blockSize << ',' << s.maxBlocks << ',' << s.rows << ',' << s.hotTokens << ','
      << s.topK << ',' << s.sparseMode << ',' << s.rowTokens;
    return k.str();
}

std::string CopySfaKey(const host::CopySfaShape &s)
{
    std::ostringstream k;
    k << "copysfa:" << s.numTokens << ',' << s.heads << ',' << s.latentDim << ',' << s.ropeDim << ',' << s.rows
      << ',' << s.hotTokens << ',' << s.topK << ',' << s.maxCtx << ',' << s.scaleValue << ',' << s.missWidth << ','
      << s.rowTokens;
    return k.str();
}

// ---------------------------------------------------------- host memory map
struct HostRegion {
    uintptr_t base;
    uint64_t bytes;
    uintptr_t device;
};

std::mutex g_hostMutex;
std::vector<HostRegion> g_hostRegions;

int64_t RegisterHostMemory(const at::Tensor &host, int64_t deviceAddress)
{
    TORCH_CHECK(host.device().is_cpu(), "npu_fused_register_host_memory: host must be a CPU tensor");
    TORCH_CHECK(host.is_contiguous(), "npu_fused_register_host_memory: host must be contiguous");
    auto base = reinterpret_cast<uintptr_t>(host.data_ptr());
    uint64_t bytes = static_cast<uint64_t>(host.numel()) * host.element_size();
    std::lock_guard<std::mutex> lock(g_hostMutex);
    for (const HostRegion &r : g_hostRegions) {
        if (base >= r.base && base + bytes <= r.base + r.bytes) {
            return static_cast<int64_t>(r.device + (base - r.base));
        }
    }
    uintptr_t device = static_cast<uintptr_t>(deviceAddress);
    if (device == 0) {
        TORCH_CHECK(base % 4096 == 0, "npu_fused_register_host_memory: aclrtHostRegister needs 4 KiB-aligned host "
                    "memory; register the whole host pool (HostKVPool storage), not an unaligned view");
        void *mapped = nullptr;
        aclError rc = aclrtHostRegister(reinterpret_cast<void *>(base), bytes, ACL_HOST_REGISTER_MAPPED, &mapped);
        TORCH_CHECK(rc == ACL_SUCCESS, "aclrtHostRegister failed (error ", rc, ") for ", bytes,
                    " bytes: use pinned memory on kernels <= 5.10, or pass the MemFabric device address");
        device = reinterpret_cast<uintptr_t>(mapped);
    }
    g_hostRegions.push_back(HostRegion{base, bytes, device});
    return static_cast<int64_t>(device);
}

// Device-side address of a host tensor's data (a registered region) or a device tensor's.
void *DeviceAddress(const at::Tensor &host, const char *op = "Copy-SFA")
{
    if (!host.device().is_cpu()) {
        return host.data_ptr();
    }
    auto base = reinterpret_cast<uintptr_t>(host.data_ptr());
    uint64_t bytes = static_cast<uint64_t>(host.numel()) * host.element_size();
    std::lock_guard<std::mutex> lock(g_hostMutex);
    for (const HostRegion &r : g_hostRegions) {
        if (base >= r.base && base + bytes <= r.base + r.bytes) {
            return reinterpret_cast<void *>(r.device + (base - r.base));
        }
    }
    TORCH_CHECK(false, op, ": the host tensor is not in registered host memory; call "
                       "torch.ops.sglang_ascend_offload.npu_fused_register_host_memory(pool) first");
    return nullptr;
}

// ---------------------------------------------------------------- LIM, LIM-C8
struct LimTensors {
    at::Tensor query, key, weights, queryScale, keyScale;
    at::Tensor cuQuery, kvLen, blockTable, tokenRows, reqIds, stableLen, step;
    at::Tensor slotToken, slotStamp, rowReq;
};

LimOutputs RunLim(const LimTensors &in, c10::string_view layoutQuery, c10::string_view layoutKey,
                  int64_t sparseCount, int64_t sparseMode, bool quantized, int64_t tokensPerRow)
{
    const char *op = quantized ? "npu_fused_quant_lightning_indexer_manage" : "npu_fused_lightning_indexer_manage";
    TORCH_CHECK(layoutQuery == "TND" && layoutKey == "PA_BSND", op, ": layouts must be TND / PA_BSND");
    const at::Device dev = in.query.device();
    auto qType = quantized ? at::kChar : at::kBFloat16;
    CheckTensor(in.query, "query", qType, 3, dev);
    CheckTensor(in.key, "key", qType, 4, dev);
    CheckTensor(in.weights, "weights", at::kBFloat16, 2, dev);
    int64_t T = in.query.size(0), Hi = in.query.size(1), Di = in.query.size(2);
    int64_t blocks = in.key.size(0), bs = in.key.size(1);
    TORCH_CHECK(in.key.size(2) == 1 && in.key.size(3) == Di, "key must be [blocks, block_size, 1, ", Di, "]");
    CheckShape(in.weights, "weights", {T, Hi});
    if (quantized) {
        CheckTensor(in.queryScale, "query_dequant_scale", at::kHalf, 2, dev);
        CheckShape(in.queryScale, "query_dequant_scale", {T, Hi});
        CheckTensor(in.keyScale, "key_dequant_scale", at::kHalf, 3, dev);
        CheckShape(in.keyScale, "key_dequant_scale", {blocks, bs, 1});
    }
    CheckTensor(in.cuQuery, "actual_seq_lengths_query", at::kInt, 1, dev);
    int64_t B = in.cuQuery.size(0);
    CheckTensor(in.kvLen, "actual_seq_lengths_key", at::kInt, 1, dev);
    CheckShape(in.kvLen, "actual_seq_lengths_key", {B});
    CheckTensor(in.blockTable, "block_table", at::kInt, 2, dev);
    TORCH_CHECK(in.blockTable.size(0) == B, "block_table must have one row per request");
    CheckTensor(in.tokenRows, "token_rows", at::kInt, 1, dev);
    CheckShape(in.tokenRows, "token_rows", {T});
    CheckTensor(in.slotToken, "slot_token", at::kInt, 2, dev);
    int64_t R = in.slotToken.size(0), Hh = in.slotToken.size(1);
    CheckTensor(in.slotStamp, "slot_stamp", at::kLong, 2, dev);
    CheckShape(in.slotStamp, "slot_stamp", {R, Hh});
    CheckTensor(in.rowReq, "row_req", at::kLong, 1, dev);
    CheckShape(in.rowReq, "row_req", {R});
    CheckTensor(in.reqIds, "req_ids", at::kLong, 1, dev);
    CheckShape(in.reqIds, "req_ids", {R});
    CheckTensor(in.stableLen, "stable_len", at::kInt, 1, dev);
    CheckShape(in.stableLen, "stable_len", {R});
    CheckTensor(in.step, "step", at::kLong, 1, dev);
    CheckShape(in.step, "step", {1});

    host::LimShape shape{static_cast<uint32_t>(T), static_cast<uint32_t>(B), static_cast<uint32_t>(Hi),
                         static_cast<uint32_t>(Di), static_cast<uint32_t>(bs),
                         static_cast<uint32_t>(in.blockTable.size(1)), static_cast<uint32_t>(R),
                         static_cast<uint32_t>(Hh), static_cast<uint32_t>(sparseCount),
                         static_cast<uint32_t>(sparseMode), quantized, static_cast<uint32_t>(tokensPerRow)};
    std::string problem = host::CheckLim(shape);
    TORCH_CHECK(problem.empty(), op, ": shape not supported by the fused kernel: ", problem,
                "use ops=reference (or npu) for this shape");

    TORCH_CHECK(tokensPerRow >= 1, op, ": tokens_per_row must be >= 1");
    const int64_t K = sparseCount;
    const int64_t W = host::LimUnionWidth(shape);  // entries of a row's residency step: min(n x K, Hh)
    auto i32 = in.query.options().dtype(at::kInt);
    at::Tensor topk = at::empty({T, 1, K}, i32);
    at::Tensor sparse = at::empty({T, 1, K}, i32);
    at::Tensor hitMask = at::empty({R, W}, in.query.options().dtype(at::kBool));
    at::Tensor slots = at::empty({R, W}, i32);
    at::Tensor missCount = at::empty({R}, i32);
    at::Tensor missTokens = at::empty({R, W}, i32);
    at::Tensor missSlots = at::empty({R, W}, i32);
    if (T == 0 && R == 0) {
        return {topk, sparse, hitMask, slots, missCount, missTokens, missSlots};
    }

    host::Launch launch = host::TileLim(shape);
    at::Tensor tiling = DeviceTiling(LimKey(shape), launch.tiling, dev);
    at::Tensor workspace = at::empty({static_cast<int64_t>(launch.workspaceBytes)}, in.query.options().dtype(at::kByte));
    uint32_t blockDim = launch.blockDim;
    LimTensors keep = in;  // the handler runs later (task queue): keep every tensor alive
    at_npu::native::OpCommand cmd;
    cmd.Name(quantized ? "SaoQuantLightningIndexerManage" : "SaoLightningIndexerManage");
    cmd.SetCustomHandler([=]() -> int {
        aclrtStream stream = c10_npu::getCurrentNPUStream().stream(false);
        if (quantized) {
            return static_cast<int>(ACLRT_LAUNCH_KERNEL(sao_quant_lightning_indexer_manage)(
                blockDim, stream, keep.query.data_ptr(), keep.key.data_ptr(), keep.weights.data_ptr(),
                keep.queryScale.data_ptr(), keep.keyScale.data_ptr(), keep.cuQuery.data_ptr(), keep.kvLen.data_ptr(),
                keep.blockTable.data_ptr(), keep.tokenRows.data_ptr(), keep.reqIds.data_ptr(),
                keep.stableLen.data_ptr(), keep.step.data_ptr(), keep.slotToken.data_ptr(),
                keep.slotStamp.data_ptr(), keep.rowReq.data_ptr(), topk.data_ptr(), sparse.data_ptr(),
                hitMask.data_ptr(), slots.data_ptr(), missCount.data_ptr(), missTokens.data_ptr(),
                missSlots.data_ptr(), workspace.data_ptr(), tiling.data_ptr()));
        }
        return static_cast<int>(ACLRT_LAUNCH_KERNEL(sao_lightning_indexer_manage)(
            blockDim, stream, keep.query.data_ptr(), keep.key.data_ptr(), keep.weights.data_ptr(),
            keep.cuQuery.data_ptr(), keep.kvLen.data_ptr(), keep.blockTable.data_ptr(), keep.tokenRows.data_ptr(),
            keep.reqIds.data_ptr(), keep.stableLen.data_ptr(), keep.step.data_ptr(), keep.slotToken.data_ptr(),
            keep.slotStamp.data_ptr(), keep.rowReq.data_ptr(), topk.data_ptr(), sparse.data_ptr(),
            hitMask.data_ptr(), slots.data_ptr(), missCount.data_ptr(), missTokens.data_ptr(),
            missSlots.data_ptr(), workspace.data_ptr(), tiling.data_ptr()));
    });
    cmd.Run();
    return {topk, sparse, hitMask, slots, missCount, missTokens, missSlots};
}

LimOutputs LightningIndexerManage(const at::Tensor &query, const at::Tensor &key, const at::Tensor &weights,
                                  const at::Tensor &actual_seq_lengths_query,
                                  const at::Tensor &actual_seq_lengths_key, const at::Tensor &block_table,
                                  const at::Tensor &token_rows, const at::Tensor &req_ids,
                                  const at::Tensor &stable_len, const at::Tensor &step, at::Tensor &slot_token,
                                  at::Tensor &slot_stamp, at::Tensor &row_req, c10::string_view layout_query,
                                  c10::string_view layout_key, int64_t sparse_count, int64_t sparse_mode,
                                  int64_t tokens_per_row)
{
    LimTensors in{query, key, weights, at::Tensor(), at::Tensor(), actual_seq_lengths_query,
                  actual_seq_lengths_key, block_table, token_rows, req_ids, stable_len, step,
                  slot_token, slot_stamp, row_req};
    return RunLim(in, layout_query, layout_key, sparse_count, sparse_mode, false, tokens_per_row);
}

LimOutputs QuantLightningIndexerManage(const at::Tensor &query, const at::Tensor &key, const at::Tensor &weights,
                                       const at::Tensor &query_dequant_scale, const at::Tensor &key_dequant_scale,
                                       const at::Tensor &actual_seq_lengths_query,
                                       const at::Tensor &actual_seq_lengths_key, const at::Tensor &block_table,
                                       const at::Tensor &token_rows, const at::Tensor &req_ids,
                                       const at::Tensor &stable_len, const at::Tensor &step,
                                       at::Tensor &slot_token, at::Tensor &slot_stamp, at::Tensor &row_req,
                                       int64_t query_quant_mode, int64_t key_quant_mode,
                                       c10::string_view layout_query, c10::string_view layout_key,
                                       int64_t sparse_count, int64_t sparse_mode, int64_t tokens_per_row)
{
    TORCH_CHECK(query_quant_mode == 0 && key_quant_mode == 0,
                "npu_fused_quant_lightning_indexer_manage: only per-token quantisation (quant mode 0)");
    LimTensors in{query, key, weights, query_dequant_scale, key_dequant_scale, actual_seq_lengths_query,
                  actual_seq_lengths_key, block_table, token_rows, req_ids, stable_len, step,
                  slot_token, slot_stamp, row_req};
    return RunLim(in, layout_query, layout_key, sparse_count, sparse_mode, true, tokens_per_row);
}

// ------------------------------------------------------------------ Copy-SFA
at::Tensor ScatterCopySparseFlashAttention(const at::Tensor &query, const at::Tensor &query_rope,
                                           const at::Tensor &host, at::Tensor &hot,
                                           const at::Tensor &sparse_indices, const at::Tensor &token_rows,
                                           const at::Tensor &miss_tokens, const at::Tensor &miss_slots,
                                           const at::Tensor &miss_count, const at::Tensor &token_table,
                                           double scale_value, const c10::optional<at::Tensor> &overflow,
                                           int64_t tokens_per_row)
{
    const at::Device dev = query.device();
    CheckTensor(query, "query", at::kBFloat16, 3, dev);
    CheckTensor(query_rope, "query_rope", at::kBFloat16, 3, dev);
    int64_t T = query.size(0), N = query.size(1), Dl = query.size(2), Dr = query_rope.size(2);
    TORCH_CHECK(query_rope.size(0) == T && query_rope.size(1) == N, "query_rope must be [T, N, Dr]");
    CheckTensor(hot, "hot", at::kBFloat16, 3, dev);
    int64_t R = hot.size(0), Hh = hot.size(1), D = hot.size(2);
    TORCH_CHECK(D == Dl + Dr, "hot must be [R, Hh, Dl + Dr]");
    TORCH_CHECK(host.scalar_type() == at::kBFloat16 && host.dim() == 2 && host.size(1) == D && host.is_contiguous(),
                "host must be a contiguous bf16 [S, ", D, "] tensor");
    CheckTensor(sparse_indices, "sparse_indices", at::kInt, 3, dev);
    int64_t K = sparse_indices.size(2);
    CheckShape(sparse_indices, "sparse_indices", {T, 1, K});
    CheckTensor(token_rows, "token_rows", at::kInt, 1, dev);
    CheckShape(token_rows, "token_rows", {T});
    CheckTensor(miss_tokens, "miss_tokens", at::kInt, 2, dev);
    int64_t W = miss_tokens.size(1);  // K, or min(n x K, Hh) with n tokens per row
    CheckShape(miss_tokens, "miss_tokens", {R, W});
    CheckTensor(miss_slots, "miss_slots", at::kInt, 2, dev);
    CheckShape(miss_slots, "miss_slots", {R, W});
    CheckTensor(miss_count, "miss_count", at::kInt, 1, dev);
    CheckShape(miss_count, "miss_count", {R});
    CheckTensor(token_table, "token_table", at::kInt, 2, dev);
    TORCH_CHECK(token_table.size(0) == R, "token_table must be [R, max_ctx]");
    at::Tensor over;  // the overflow area: sparse_indices >= R * Hh are its rows
    if (overflow.has_value() && overflow->defined()) {
        over = *overflow;
        CheckTensor(over, "overflow", at::kBFloat16, 2, dev);
        TORCH_CHECK(over.size(1) == D, "overflow must be [O, ", D, "]");
    }

    // fewer than 8 heads: zero-pad the queries, attend, drop the padded heads
    int64_t Np = N < kMinHeads ? static_cast<int64_t>(kMinHeads) : N;
    at::Tensor q = query, qr = query_rope;
    if (Np != N) {
        q = at::cat({query, at::zeros({T, Np - N, Dl}, query.options())}, 1).contiguous();
        qr = at::cat({query_rope, at::zeros({T, Np - N, Dr}, query_rope.options())}, 1).contiguous();
    }
    host::CopySfaShape shape{static_cast<uint32_t>(T), static_cast<uint32_t>(Np), static_cast<uint32_t>(Dl),
                             static_cast<uint32_t>(Dr), static_cast<uint32_t>(R), static_cast<uint32_t>(Hh),
                             static_cast<uint32_t>(K), static_cast<uint32_t>(token_table.size(1)),
                             static_cast<float>(scale_value), static_cast<uint32_t>(W),
                             static_cast<uint32_t>(tokens_per_row)};
    std::string problem = host::CheckCopySfa(shape);
    TORCH_CHECK(problem.empty(), "npu_fused_scatter_copy_sparse_flash_attention: shape not supported by the fused "
                "kernel: ", problem, "use ops=reference (or npu) for this shape");
    at::Tensor out = at::empty({T, Np, Dl}, query.options());
    if (T == 0) {
        return out.narrow(1, 0, N);
    }
    void *hostAddress = DeviceAddress(host);
    host::Launch launch = host::TileCopySfa(shape);
    at::Tensor tiling = DeviceTiling(CopySfaKey(shape), launch.tiling, dev);
    at::Tensor workspace = at::empty({static_cast<int64_t>(launch.workspaceBytes)}, query.options().dtype(at::kByte));
    uint32_t blockDim = launch.blockDim;
    at::Tensor keepHost = host, keepHot = hot, keepIdx = sparse_indices, keepRows = token_rows;
    at::Tensor keepMissTok = miss_tokens, keepMissSlot = miss_slots, keepMissCount = miss_count;
    at::Tensor keepTable = token_table, keepOver = over;
    at_npu::native::OpCommand cmd;
    cmd.Name("SaoScatterCopySparseFlashAttention");
    cmd.SetCustomHandler([=]() -> int {
        aclrtStream stream = c10_npu::getCurrentNPUStream().stream(false);
        (void)keepHost;  // keeps the host view alive until the launch
        return static_cast<int>(ACLRT_LAUNCH_KERNEL(sao_scatter_copy_sparse_flash_attention)(
            blockDim, stream, q.data_ptr(), qr.data_ptr(), hostAddress, keepHot.data_ptr(),
            keepOver.defined() ? keepOver.data_ptr() : nullptr, keepIdx.data_ptr(), keepRows.data_ptr(), keepMissTok.data_ptr(), keepMissSlot.data_ptr(), keepMissCount.data_ptr(),
            keepTable.data_ptr(), out.data_ptr(), workspace.data_ptr(), tiling.data_ptr()));
    });
    cmd.Run();
    return Np == N ? out : out.narrow(1, 0, N).contiguous();
}

// ------------------------------------------------------------------ miss copy
void CopyMissRows(const at::Tensor &host, at::Tensor &hot, const at::Tensor &rows, const at::Tensor &miss_tokens,
                  const at::Tensor &miss_slots, const at::Tensor &miss_count, const at::Tensor &token_table)
{
    const at::Device dev = hot.device();
    CheckTensor(hot, "hot", at::kBFloat16, 3, dev);
    int64_t Hh = hot.size(1), D = hot.size(2);
    TORCH_CHECK(host.scalar_type() == at::kBFloat16 && host.dim() == 2 && host.size(1) == D && host.is_contiguous(),
                "host must be a contiguous bf16 [S, ", D, "] tensor");
    CheckTensor(rows, "rows", at::kInt, 1, dev);
    int64_t B = rows.size(0);
    CheckTensor(miss_tokens, "miss_tokens", at::kInt, 2, dev);
    int64_t W = miss_tokens.size(1);
    CheckShape(miss_tokens, "miss_tokens", {B, W});
    CheckTensor(miss_slots, "miss_slots", at::kInt, 2, dev);
    CheckShape(miss_slots, "miss_slots", {B, W});
    CheckTensor(miss_count, "miss_count", at::kInt, 1, dev);
    CheckShape(miss_count, "miss_count", {B});
    CheckTensor(token_table, "token_table", at::kInt, 2, dev);
    host::CopyRowsShape shape{static_cast<uint32_t>(B), static_cast<uint32_t>(D), static_cast<uint32_t>(Hh),
                              static_cast<uint32_t>(W), static_cast<uint32_t>(token_table.size(1))};
    std::string problem = host::CheckCopyRows(shape);
    TORCH_CHECK(problem.empty(), "npu_fused_copy_miss_rows: shape not supported by the fused kernel: ", problem,
                "use ops=npu for this shape");
    if (B == 0) {
        return;
    }
    void *hostAddress = DeviceAddress(host, "npu_fused_copy_miss_rows");
    host::Launch launch = host::TileCopyRows(shape);
    std::ostringstream key;
    key << "copyrows:" << B << ',' << D << ',' << Hh << ',' << W << ',' << token_table.size(1);
    at::Tensor tiling = DeviceTiling(key.str(), launch.tiling, dev);
    at::Tensor workspace = at::empty({static_cast<int64_t>(launch.workspaceBytes)}, hot.options().dtype(at::kByte));
    uint32_t blockDim = launch.blockDim;
    at::Tensor keepHost = host, keepHot = hot, keepRows = rows, keepTok = miss_tokens, keepSlot = miss_slots;
    at::Tensor keepCount = miss_count, keepTable = token_table;
    at_npu::native::OpCommand cmd;
    cmd.Name("SaoCopyMissRows");
    cmd.SetCustomHandler([=]() -> int {
        aclrtStream stream = c10_npu::getCurrentNPUStream().stream(false);
        (void)keepHost;  // keeps the host view alive until the launch
        return static_cast<int>(ACLRT_LAUNCH_KERNEL(sao_copy_miss_rows)(
            blockDim, stream, hostAddress, keepHot.data_ptr(), keepRows.data_ptr(), keepTok.data_ptr(),
            keepSlot.data_ptr(), keepCount.data_ptr(), keepTable.data_ptr(), workspace.data_ptr(), tiling.data_ptr()));
    });
    cmd.Run();
}

}  // namespace
}  // namespace sao

// ----------------------------------------------------------------- registration
// Schemas: one string literal per op (tests/ops/test_fused_abi.py parses them and checks
// the Python wrappers against them). T query tokens, B requests, R rows, Hh hot slots per
// row, K = sparse_count, Hi/Di index heads/dim, N heads, Dl/Dr latent/rope dims,
// D = Dl + Dr, S host rows.
//
// npu_fused_lightning_indexer_manage (LIM)
//   in      query                     bf16  [T, Hi, Di]                 index queries, TND
//   in      key                       bf16  [blocks, block_size, 1, Di] index-K cache, PA_BSND
//   in      weights                   bf16  [T, Hi]
//   in      actual_seq_lengths_query  int32 [B]        cumulative query tokens
//   in      actual_seq_lengths_key    int32 [B]        KV length per request
//   in      block_table               int32 [B, max_blocks]
//   in      token_rows                int32 [T]        row owned by each token, -1 none
//   in      req_ids                   int64 [R]        request in each row, -1 idle
//   in      stable_len                int32 [R]        positions >= stable_len never hit
//   in      step                      int64 [1]        step counter (device: graph-capturable)
//   in/out  slot_token                int32 [R, Hh]    position per slot, -1 empty
//   in/out  slot_stamp                int64 [R, Hh]    recency, 0 empty
//   in/out  row_req                   int64 [R]        request owning the row's content
//   attr    layout_query "TND", layout_key "PA_BSND", sparse_count K, sparse_mode 0|3,
//           tokens_per_row n (1: a row is one token; n > 1: up to n tokens share a row, the
//           row steps on the union of their top-k, W = min(n * K, Hh) entries, n <= 14: a
//           union beyond Hh keeps its first Hh positions by priority, the rest get no slot,
//           -1 in sparse_indices; they are the overflow area's, sparse_decode/overflow.py)
//   out     topk_indices int32 [T, 1, K]  logical top-k (indexer output, -1 padding)
//   out     sparse_indices int32 [T, 1, K] rows of hot.view(R*Hh, D): row*Hh + slot, -1
//   out     hit_mask bool [R, W]; slots int32 [R, W]; miss_count int32 [R];
//           miss_tokens int32 [R, W]; miss_slots int32 [R, W]   (W = K for n = 1;
//           docs/residency_contract.md)
//
// npu_fused_quant_lightning_indexer_manage (LIM-C8): as LIM with
//   in      query int8 [T, Hi, Di], key int8 [blocks, block_size, 1, Di] (Hadamard-rotated)
//   in      query_dequant_scale fp16 [T, Hi], key_dequant_scale fp16 [blocks, block_size, 1]
//   attr    query_quant_mode 0, key_quant_mode 0
//
// npu_fused_scatter_copy_sparse_flash_attention (Copy-SFA)
//   in      query          bf16  [T, N, Dl]     absorbed queries, TND
//   in      query_rope     bf16  [T, N, Dr]
//   in      host           bf16  [S, D]         this layer's host rows (registered host memory)
//   in/out  hot            bf16  [R, Hh, D]     this layer's hot buffer; the misses land in it
//   in      sparse_indices int32 [T, 1, K]      LIM's sparse_indices
//   in      token_rows     int32 [T]
//   in      miss_tokens    int32 [R, W], miss_slots int32 [R, W], miss_count int32 [R] (LIM's;
//                          W = min(n * K, Hh): a row with misses may serve up to n tokens)
//   in      token_table    int32 [R, max_ctx]   logical position -> host row, per row
//   attr    scale_value    float
//   in      overflow       bf16  [O, D] or None the overflow area: sparse_indices R * Hh + i read its row i
//                          (copied before the launch; sparse_decode/overflow.py)
//   attr    tokens_per_row int   n: tokens a row may serve (1; a request's verify rows, <= 14)
//   out     attention out  bf16  [T, N, Dl]
//
// npu_fused_copy_miss_rows (the miss copy on its own: the copy_miss_rows op's rows form)
//   in      host           bf16  [S, D]         this layer's host rows (registered host memory)
//   in/out  hot            bf16  [R, Hh, D]     the target rows (a hot buffer, or the overflow area
//                                               as [R, X, D]); hot[rows[b], miss_slots[b, i]] =
//                                               host[token_table[rows[b], miss_tokens[b, i]]] for
//                                               i < miss_count[b]; nothing else is written
//   in      rows           int32 [B]            the target row of each batch entry (distinct for
//                                               entries with misses)
//   in      miss_tokens    int32 [B, W], miss_slots int32 [B, W], miss_count int32 [B]
//   in      token_table    int32 [T, max_ctx]   logical position -> host row, by row (read only
//                                               for entries with misses)
//
// npu_fused_register_host_memory
//   in      host           any dtype, CPU, contiguous (the whole host pool, 4 KiB aligned)
//   attr    device_address int: 0 = map with aclrtHostRegister, else an existing mapping
//   out     int            device address of host.data_ptr()
TORCH_LIBRARY(sglang_ascend_offload, m)
{
    m.def("npu_fused_lightning_indexer_manage(Tensor query, Tensor key, Tensor weights, Tensor actual_seq_lengths_query, Tensor actual_seq_lengths_key, Tensor block_table, Tensor token_rows, Tensor req_ids, Tensor stable_len, Tensor step, Tensor(a!) slot_token, Tensor(b!) slot_stamp, Tensor(c!) row_req, str layout_query=\"TND\", str layout_key=\"PA_BSND\", int sparse_count=2048, int sparse_mode=3, int tokens_per_row=1) -> (Tensor topk_indices, Tensor sparse_indices, Tensor hit_mask, Tensor slots, Tensor miss_count, Tensor miss_tokens, Tensor miss_slots)");
    m.def("npu_fused_quant_lightning_indexer_manage(Tensor query, Tensor key, Tensor weights, Tensor query_dequant_scale, Tensor key_dequant_scale, Tensor actual_seq_lengths_query, Tensor actual_seq_lengths_key, Tensor block_table, Tensor token_rows, Tensor req_ids, Tensor stable_len, Tensor step, Tensor(a!) slot_token, Tensor(b!) slot_stamp, Tensor(c!) row_req, int query_quant_mode=0, int key_quant_mode=0, str layout_query=\"TND\", str layout_key=\"PA_BSND\", int sparse_count=2048, int sparse_mode=3, int tokens_per_row=1) -> (Tensor topk_indices, Tensor sparse_indices, Tensor hit_mask, Tensor slots, Tensor miss_count, Tensor miss_tokens, Tensor miss_slots)");
    m.def("npu_fused_scatter_copy_sparse_flash_attention(Tensor query, Tensor query_rope, Tensor host, Tensor(a!) hot, Tensor sparse_indices, Tensor token_rows, Tensor miss_tokens, Tensor miss_slots, Tensor miss_count, Tensor token_table, float scale_value, Tensor? overflow=None, int tokens_per_row=1) -> Tensor");
    m.def("npu_fused_copy_miss_rows(Tensor host, Tensor(a!) hot, Tensor rows, Tensor miss_tokens, Tensor miss_slots, Tensor miss_count, Tensor token_table) -> ()");
    m.def("npu_fused_register_host_memory(Tensor host, int device_address=0) -> int");
}

TORCH_LIBRARY_IMPL(sglang_ascend_offload, PrivateUse1, m)
{
    m.impl("npu_fused_lightning_indexer_manage", TORCH_FN(sao::LightningIndexerManage));
    m.impl("npu_fused_quant_lightning_indexer_manage", TORCH_FN(sao::QuantLightningIndexerManage));
    m.impl("npu_fused_scatter_copy_sparse_flash_attention", TORCH_FN(sao::ScatterCopySparseFlashAttention));
    m.impl("npu_fused_copy_miss_rows", TORCH_FN(sao::CopyMissRows));
}

TORCH_LIBRARY_IMPL(sglang_ascend_offload, CPU, m)
{
    // the host pool is a CPU tensor: registration dispatches on CPU
    m.impl("npu_fused_register_host_memory", TORCH_FN(sao::RegisterHostMemory));
#ifdef SAO_HOST_CHECK_ON_CPU
    // Only in tools/host_check_cpu.sh builds (stub CANN headers, launches do nothing): the
    // host-side checks, tiling and output allocation run on CPU tensors.
    m.impl("npu_fused_lightning_indexer_manage", TORCH_FN(sao::LightningIndexerManage));
    m.impl("npu_fused_quant_lightning_indexer_manage", TORCH_FN(sao::QuantLightningIndexerManage));
    m.impl("npu_fused_scatter_copy_sparse_flash_attention", TORCH_FN(sao::ScatterCopySparseFlashAttention));
    m.impl("npu_fused_copy_miss_rows", TORCH_FN(sao::CopyMissRows));
#endif
}

// ------------------------------------------------------------- Python module
// Importing sglang_ascend_offload._C_ascend loads this library, which runs the static
// registrations above; the module itself has no attributes.
static PyModuleDef g_module = {PyModuleDef_HEAD_INIT, "_C_ascend",
                               "AscendC fused operators (LIM, LIM-C8, Copy-SFA, miss copy) of sglang_ascend_offload; "
                               "ops under torch.ops.sglang_ascend_offload",
                               -1, nullptr, nullptr, nullptr, nullptr, nullptr};

PyMODINIT_FUNC PyInit__C_ascend(void) { return PyModule_Create(&g_module); }
