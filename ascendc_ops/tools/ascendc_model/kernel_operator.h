/*
 * A small FUNCTIONAL model of the AscendC API, only the parts this project's kernels
 * (ascendc_ops/kernels/) call, so their C++ runs unchanged on a CPU: one simulated core at
 * a time, global memory = host memory, the unified buffer (UB) = one 192 KiB byte array
 * per core, queues and buffers = plain carving of that array, every instruction executed
 * at once and in program order. Written for this project from the AscendC documentation
 * (signatures as in asc-devkit 8.5.0, semantics as documented); it is not CANN code.
 *
 * What it checks while running (a violation throws sao_model::Fault, which the driver
 * reports): UB accesses stay inside the core's UB and InitBuffer inside 192 KiB; GM
 * accesses stay inside the buffers the driver registered; DataCopy moves whole 32-byte
 * blocks from/to 32-byte-aligned UB addresses; vector operands are 32-byte aligned;
 * every WaitFlag has a SetFlag; queue buffers are allocated / enqueued / dequeued / freed
 * in a valid order; Sort / Extract repeat counts are whole groups of 32.
 *
 * What it does NOT model: pipeline concurrency (each instruction completes before the next
 * starts, so a missing barrier is invisible), hardware rounding and summation order of the
 * cube and vector units (float math here is IEEE float in program order), bank conflicts,
 * cache behaviour, timing. See docs/fused_ops.md, "What is checked on CPU".
 */
#ifndef SAO_ASCENDC_MODEL_KERNEL_OPERATOR_H
#define SAO_ASCENDC_MODEL_KERNEL_OPERATOR_H

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#define __aicore__
#define __global__
#define __gm__
#define GM_ADDR uint8_t *
#define KERNEL_TASK_TYPE_DEFAULT(x)

namespace sao_model {

struct Fault : std::runtime_error {
    explicit Fault(const std::string &what) : std::runtime_error(what) {}
};

constexpr uint32_t kUbBytes = 192 * 1024;          // vector-core unified buffer on A2/A3
constexpr uint64_t kSysWorkspaceBytes = 64 * 1024;  // the model's "Matmul API" system workspace

struct CoreState {
    int32_t coreType = 2;  // 1 = AIC, 2 = AIV
    uint32_t blockIdx = 0;
    uint32_t blockNum = 1;
    uint32_t taskRation = 2;
    uint8_t *sysWorkspace = nullptr;
    std::vector<uint8_t> ub = std::vector<uint8_t>(kUbBytes + 64);
    uint8_t *ubBase() { return reinterpret_cast<uint8_t *>((reinterpret_cast<uintptr_t>(ub.data()) + 31) & ~uintptr_t(31)); }
};
CoreState &Core();

// GM ranges the driver registered: [begin, end)
std::vector<std::pair<const uint8_t *, const uint8_t *>> &GmRanges();
inline void CheckGm(const void *p, uint64_t bytes, const char *what)
{
    auto *b = static_cast<const uint8_t *>(p);
    for (auto &r : GmRanges()) {
        if (b >= r.first && b + bytes <= r.second) return;
    }
    char msg[200];
    std::snprintf(msg, sizeof(msg), "%s: GM access of %llu bytes at %p is outside every registered buffer", what,
                  static_cast<unsigned long long>(bytes), p);
    throw Fault(msg);
}
inline void CheckUb(const void *p, uint64_t bytes, const char *what)
{
    auto *b = static_cast<const uint8_t *>(p);
    uint8_t *base = Core().ubBase();
    if (b < base || b + bytes > base + kUbBytes) {
        char msg[200];
        std::snprintf(msg, sizeof(msg), "%s: UB access of %llu bytes at offset %lld is outside the 192 KiB UB", what,
                      static_cast<unsigned long long>(bytes), static_cast<long long>(b - base));
        throw Fault(msg);
    }
}
inline void CheckAligned(const void *p, const char *what)
{
    if ((reinterpret_cast<uintptr_t>(p) - reinterpret_cast<uintptr_t>(Core().ubBase())) % 32 != 0) {
        throw Fault(std::string(what) + ": UB operand not 32-byte aligned");
    }
}

// pending SetFlag events: (event kind, id) -> count
std::map<std::pair<int, int>, int> &Flags();

}  // namespace sao_model

// ------------------------------------------------------------------ 16-bit floats
struct bfloat16_t {
    uint16_t bits = 0;
    bfloat16_t() = default;
    bfloat16_t(float f) { bits = FromFloat(f); }
    operator float() const
    {
        uint32_t u = static_cast<uint32_t>(bits) << 16;
        float f;
        std::memcpy(&f, &u, 4);
        return f;
    }
    static uint16_t FromFloat(float f)  // round to nearest even
    {
        uint32_t u;
        std::memcpy(&u, &f, 4);
        if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN stays NaN
        uint32_t lsb = (u >> 16) & 1u;
        return static_cast<uint16_t>((u + 0x7fffu + lsb) >> 16);
    }
};

struct half {
    uint16_t bits = 0;
    half() = default;
    half(float f) { bits = FromFloat(f); }
    operator float() const
    {
        uint32_t sign = (bits & 0x8000u) << 16, exp = (bits >> 10) & 0x1f, man = bits & 0x3ffu, u;
        if (exp == 0) {
            if (man == 0) {
                u = sign;
            } else {  // subnormal
                float f = std::ldexp(static_cast<float>(man), -24);
                return sign ? -f : f;
            }
        } else if (exp == 31) {
            u = sign | 0x7f800000u | (man << 13);
        } else {
            u = sign | ((exp + 112) << 23) | (man << 13);
        }
        float f;
        std::memcpy(&f, &u, 4);
        return f;
    }
    static uint16_t FromFloat(float f)
    {
        // exact for the values the checks use; round-to-nearest-even otherwise (normal range)
        uint32_t u;
        std::memcpy(&u, &f, 4);
        uint32_t sign = (u >> 16) & 0x8000u;
        int32_t exp = static_cast<int32_t>((u >> 23) & 0xff) - 127 + 15;
        uint32_t man = u & 0x7fffffu;
        if (((u >> 23) & 0xff) == 0xff) return static_cast<uint16_t>(sign | 0x7c00u | (man ? 0x200u : 0));
        if (exp >= 31) return static_cast<uint16_t>(sign | 0x7c00u);
        if (exp <= 0) {  // subnormal / zero
            float a = std::fabs(f);
            uint32_t m = static_cast<uint32_t>(std::nearbyint(std::ldexp(a, 24)));
            return static_cast<uint16_t>(sign | m);
        }
        uint32_t r = man >> 13, rest = man & 0x1fffu;
        if (rest > 0x1000u || (rest == 0x1000u && (r & 1u))) ++r;
        uint32_t h = (static_cast<uint32_t>(exp) << 10) + r;
        return static_cast<uint16_t>(sign | h);
    }
};

enum pipe_t { PIPE_S, PIPE_V, PIPE_M, PIPE_MTE1, PIPE_MTE2, PIPE_MTE3, PIPE_ALL, PIPE_FIX };
enum event_t { EVENT_ID0, EVENT_ID1, EVENT_ID2, EVENT_ID3, EVENT_ID4, EVENT_ID5, EVENT_ID6, EVENT_ID7 };

enum class CubeFormat { ND, NZ };

// The Matmul API tiling: only the shape fields are read by the model (same leading layout
// as the toolkit's TCubeTiling: usedCoreNum, M, N, Ka, Kb, ...).
struct TCubeTiling {
    int32_t usedCoreNum;
    int32_t M;
    int32_t N;
    int32_t Ka;
    int32_t Kb;
    int32_t rest[59];
};

namespace AscendC {

enum class TPosition { GM, VECIN, VECOUT, VECCALC, A1, A2, B1, B2, CO1, CO2 };
enum class HardEvent { MTE2_V, V_MTE2, MTE3_V, V_MTE3, MTE2_S, S_MTE2, MTE3_S, S_MTE3, V_S, S_V, MTE2_MTE3,
                       MTE3_MTE2, MTE2_MTE1, M_V, V_M };
enum class RoundMode { CAST_NONE, CAST_RINT, CAST_FLOOR, CAST_CEIL, CAST_ROUND, CAST_TRUNC, CAST_ODD };

constexpr int32_t AIC = 1;
constexpr int32_t AIV = 2;

inline int64_t GetBlockIdx() { return sao_model::Core().blockIdx; }
inline int64_t GetBlockNum() { return sao_model::Core().blockNum; }
inline int64_t GetTaskRation() { return sao_model::Core().taskRation; }

inline void SetSysWorkspace(GM_ADDR ws) { sao_model::Core().sysWorkspace = ws; }
inline GM_ADDR GetUserWorkspace(GM_ADDR ws) { return ws == nullptr ? nullptr : ws + sao_model::kSysWorkspaceBytes; }

// ------------------------------------------------------------------- tensors
template <typename T>
class GlobalTensor {
public:
    using PrimType = T;
    void SetGlobalBuffer(__gm__ T *p, uint64_t size = 0)
    {
        ptr_ = p;
        size_ = size;
    }
    GlobalTensor operator[](uint64_t offset) const
    {
        GlobalTensor g;
        g.ptr_ = ptr_ + offset;
        g.size_ = size_ > offset ? size_ - offset : 0;
        return g;
    }
    T GetValue(uint64_t i) const
    {
        sao_model::CheckGm(ptr_ + i, sizeof(T), "GlobalTensor::GetValue");
        return ptr_[i];
    }
    void SetValue(uint64_t i, T v) const
    {
        sao_model::CheckGm(ptr_ + i, sizeof(T), "GlobalTensor::SetValue");
        ptr_[i] = v;
    }
    T *GetPhyAddr() const { return ptr_; }
    uint64_t GetSize() const { return size_; }

private:
    T *ptr_ = nullptr;
    uint64_t size_ = 0;
};

template <typename T>
class LocalTensor {
public:
    using PrimType = T;
    LocalTensor() = default;
    explicit LocalTensor(T *p, uint32_t count) : ptr_(p), count_(count) {}
    LocalTensor operator[](uint32_t offset) const { return LocalTensor(ptr_ + offset, count_ > offset ? count_ - offset : 0); }
    template <typename U>
    LocalTensor<U> ReinterpretCast() const
    {
        return LocalTensor<U>(reinterpret_cast<U *>(ptr_), static_cast<uint32_t>(count_ * sizeof(T) / sizeof(U)));
    }
    T GetValue(uint32_t i) const
    {
        Check(i, "LocalTensor::GetValue");
        return ptr_[i];
    }
    void SetValue(uint32_t i, T v) const
    {
        Check(i, "LocalTensor::SetValue");
        ptr_[i] = v;
    }
    // index i must lie inside the buffer (TBuf / queue buffer) this tensor was cut from
    void Check(uint32_t i, const char *what) const
    {
        if (i >= count_) {
            throw sao_model::Fault(std::string(what) + ": index " + std::to_string(i) +
                                   " past the end of its buffer (" + std::to_string(count_) + " elements left)");
        }
        sao_model::CheckUb(ptr_ + i, sizeof(T), what);
    }
    T *GetPhyAddr() const { return ptr_; }
    uint32_t GetSize() const { return count_; }

private:
    T *ptr_ = nullptr;
    uint32_t count_ = 0;
};

// ---------------------------------------------------------- pipe and buffers
template <TPosition POS>
class TBuf {
public:
    template <typename T>
    LocalTensor<T> Get() const { return LocalTensor<T>(reinterpret_cast<T *>(base_), bytes_ / sizeof(T)); }
    template <typename T>
    LocalTensor<T> Get(uint32_t count) const { return LocalTensor<T>(reinterpret_cast<T *>(base_), count); }
    uint8_t *base_ = nullptr;
    uint32_t bytes_ = 0;
};

template <TPosition SRC, TPosition DST, int32_t DEPTH>
class TQueBind {
public:
    template <typename T>
    LocalTensor<T> AllocTensor()
    {
        for (int i = 0; i < num_; ++i) {
            if (state_[i] == 0) {
                state_[i] = 1;
                return LocalTensor<T>(reinterpret_cast<T *>(base_ + i * bytes_), bytes_ / sizeof(T));
            }
        }
        throw sao_model::Fault("TQueBind::AllocTensor: every buffer of the queue is in use");
    }
    template <typename T>
    void EnQue(const LocalTensor<T> &t)
    {
        int i = Index(t.GetPhyAddr());
        if (state_[i] != 1) throw sao_model::Fault("TQueBind::EnQue of a buffer that was not allocated");
        state_[i] = 2;
        fifo_.push_back(i);
    }
    template <typename T>
    LocalTensor<T> DeQue()
    {
        if (fifo_.empty()) throw sao_model::Fault("TQueBind::DeQue on an empty queue");
        int i = fifo_.front();
        fifo_.erase(fifo_.begin());
        state_[i] = 3;
        return LocalTensor<T>(reinterpret_cast<T *>(base_ + i * bytes_), bytes_ / sizeof(T));
    }
    template <typename T>
    void FreeTensor(const LocalTensor<T> &t)
    {
        int i = Index(t.GetPhyAddr());
        if (state_[i] == 0) throw sao_model::Fault("TQueBind::FreeTensor of a free buffer");
        state_[i] = 0;
    }
    uint8_t *base_ = nullptr;
    uint32_t bytes_ = 0;
    int num_ = 0;
    int state_[8] = {};  // 0 free, 1 allocated, 2 queued, 3 dequeued
    std::vector<int> fifo_;

private:
    int Index(const void *p) const
    {
        auto off = static_cast<const uint8_t *>(p) - base_;
        if (off < 0 || bytes_ == 0 || off % bytes_ != 0 || off / bytes_ >= num_) {
            throw sao_model::Fault("TQueBind: tensor does not belong to this queue");
        }
        return static_cast<int>(off / bytes_);
    }
};

class TPipe;
}  // namespace AscendC

namespace sao_model {
AscendC::TPipe *&CurrentPipe();
}

namespace AscendC {
class TPipe {
public:
    TPipe() { sao_model::CurrentPipe() = this; }
    ~TPipe()
    {
        if (sao_model::CurrentPipe() == this) sao_model::CurrentPipe() = nullptr;
    }
    template <TPosition POS>
    void InitBuffer(TBuf<POS> &buf, uint32_t bytes)
    {
        buf.base_ = Carve(bytes);
        buf.bytes_ = bytes;
    }
    template <TPosition S, TPosition D, int32_t DEPTH>
    void InitBuffer(TQueBind<S, D, DEPTH> &que, uint8_t num, uint32_t bytes)
    {
        if (num > 8) throw sao_model::Fault("InitBuffer: more than 8 queue buffers");
        uint32_t each = (bytes + 31) / 32 * 32;
        que.base_ = Carve(each * num);
        que.bytes_ = each;
        que.num_ = num;
    }
    int32_t FetchEventID(HardEvent) { return 0; }

private:
    uint8_t *Carve(uint32_t bytes)
    {
        uint32_t aligned = (bytes + 31) / 32 * 32;
        if (used_ + aligned > sao_model::kUbBytes) {
            throw sao_model::Fault("TPipe::InitBuffer: UB exhausted (" + std::to_string(used_ + aligned) +
                                   " bytes > 192 KiB)");
        }
        uint8_t *p = sao_model::Core().ubBase() + used_;
        used_ += aligned;
        return p;
    }
    uint32_t used_ = 0;
};

// ------------------------------------------------------------------ sync
template <HardEvent E>
inline void SetFlag(int32_t id) { ++sao_model::Flags()[{static_cast<int>(E), id}]; }
template <HardEvent E>
inline void WaitFlag(int32_t id)
{
    auto &n = sao_model::Flags()[{static_cast<int>(E), id}];
    if (n <= 0) throw sao_model::Fault("WaitFlag without a matching SetFlag");
    --n;
}
template <pipe_t P>
inline void PipeBarrier() {}

namespace detail {
template <typename T>
inline T *Vec(const LocalTensor<T> &t, uint32_t count, const char *what)
{
    if (count > t.GetSize()) {
        throw sao_model::Fault(std::string(what) + ": " + std::to_string(count) + " elements but only " +
                               std::to_string(t.GetSize()) + " left in the operand's buffer");
    }
    sao_model::CheckAligned(t.GetPhyAddr(), what);
    sao_model::CheckUb(t.GetPhyAddr(), uint64_t(count) * sizeof(T), what);
    return t.GetPhyAddr();
}
}  // namespace detail

// ------------------------------------------------------------------ data copy
struct DataCopyExtParams {
    uint16_t blockCount = 1;
    uint32_t blockLen = 0;  // bytes
    uint32_t srcStride = 0;
    uint32_t dstStride = 0;
    uint32_t rsv = 0;
};
template <typename T>
struct DataCopyPadExtParams {
    bool isPad = false;
    uint8_t leftPadding = 0;
    uint8_t rightPadding = 0;
    T paddingValue = T();
};

template <typename T>
inline void DataCopy(const LocalTensor<T> &dst, const GlobalTensor<T> &src, uint32_t count)
{
    uint64_t bytes = uint64_t(count) * sizeof(T);
    if (bytes % 32 != 0) throw sao_model::Fault("DataCopy GM->UB: length not a multiple of 32 bytes (use DataCopyPad)");
    detail::Vec(dst, count, "DataCopy GM->UB");
    sao_model::CheckGm(src.GetPhyAddr(), bytes, "DataCopy GM->UB");
    std::memmove(dst.GetPhyAddr(), src.GetPhyAddr(), bytes);
}
template <typename T>
inline void DataCopy(const GlobalTensor<T> &dst, const LocalTensor<T> &src, uint32_t count)
{
    uint64_t bytes = uint64_t(count) * sizeof(T);
    if (bytes % 32 != 0) throw sao_model::Fault("DataCopy UB->GM: length not a multiple of 32 bytes (use DataCopyPad)");
    detail::Vec(src, count, "DataCopy UB->GM");
    sao_model::CheckGm(dst.GetPhyAddr(), bytes, "DataCopy UB->GM");
    std::memmove(dst.GetPhyAddr(), src.GetPhyAddr(), bytes);
}
template <typename T>
inline void DataCopy(const LocalTensor<T> &dst, const LocalTensor<T> &src, uint32_t count)
{
    uint64_t bytes = uint64_t(count) * sizeof(T);
    if (bytes % 32 != 0) throw sao_model::Fault("DataCopy UB->UB: length not a multiple of 32 bytes");
    detail::Vec(dst, count, "DataCopy UB->UB");
    detail::Vec(src, count, "DataCopy UB->UB");
    std::memmove(dst.GetPhyAddr(), src.GetPhyAddr(), bytes);
}

// GM -> UB of blockLen bytes; the rest of the last 32-byte UB block is left undefined
// (the model writes 0xA5 there so that code relying on it shows).
template <typename T>
inline void DataCopyPad(const LocalTensor<T> &dst, const GlobalTensor<T> &src, const DataCopyExtParams &p,
                        const DataCopyPadExtParams<T> &pad)
{
    if (p.blockCount != 1 || pad.isPad) throw sao_model::Fault("DataCopyPad: only blockCount 1 without padding is modelled");
    uint64_t padded = (uint64_t(p.blockLen) + 31) / 32 * 32;
    detail::Vec(dst.template ReinterpretCast<uint8_t>(), static_cast<uint32_t>(padded), "DataCopyPad GM->UB");
    sao_model::CheckGm(src.GetPhyAddr(), p.blockLen, "DataCopyPad GM->UB");
    auto *d = reinterpret_cast<uint8_t *>(dst.GetPhyAddr());
    std::memmove(d, src.GetPhyAddr(), p.blockLen);
    std::memset(d + p.blockLen, 0xA5, padded - p.blockLen);
}
// UB -> GM: exactly blockLen bytes are written.
template <typename T>
inline void DataCopyPad(const GlobalTensor<T> &dst, const LocalTensor<T> &src, const DataCopyExtParams &p)
{
    if (p.blockCount != 1) throw sao_model::Fault("DataCopyPad: only blockCount 1 is modelled");
    detail::Vec(src.template ReinterpretCast<uint8_t>(), p.blockLen, "DataCopyPad UB->GM");
    sao_model::CheckGm(dst.GetPhyAddr(), p.blockLen, "DataCopyPad UB->GM");
    std::memmove(dst.GetPhyAddr(), src.GetPhyAddr(), p.blockLen);
}

// ------------------------------------------------------------------ vector


template <typename T>
inline void Duplicate(const LocalTensor<T> &dst, const T &value, const int32_t &count)
{
    T *d = detail::Vec(dst, count, "Duplicate");
    for (int32_t i = 0; i < count; ++i) d[i] = value;
}

#define SAO_MODEL_BINARY(NAME, EXPR)                                                                     \
    template <typename T>                                                                                \
    inline void NAME(const LocalTensor<T> &dst, const LocalTensor<T> &a, const LocalTensor<T> &b,       \
                     const int32_t &count)                                                               \
    {                                                                                                    \
        T *d = detail::Vec(dst, count, #NAME);                                                           \
        const T *x = detail::Vec(a, count, #NAME);                                                       \
        const T *y = detail::Vec(b, count, #NAME);                                                       \
        for (int32_t i = 0; i < count; ++i) d[i] = (EXPR);                                               \
    }
SAO_MODEL_BINARY(Add, x[i] + y[i])
SAO_MODEL_BINARY(Sub, x[i] - y[i])
SAO_MODEL_BINARY(Mul, x[i] * y[i])
#undef SAO_MODEL_BINARY

template <typename T>
inline void Muls(const LocalTensor<T> &dst, const LocalTensor<T> &src, const T &s, const int32_t &count)
{
    T *d = detail::Vec(dst, count, "Muls");
    const T *x = detail::Vec(src, count, "Muls");
    for (int32_t i = 0; i < count; ++i) d[i] = x[i] * s;
}
template <typename T>
inline void Adds(const LocalTensor<T> &dst, const LocalTensor<T> &src, const T &s, const int32_t &count)
{
    T *d = detail::Vec(dst, count, "Adds");
    const T *x = detail::Vec(src, count, "Adds");
    for (int32_t i = 0; i < count; ++i) d[i] = x[i] + s;
}
// dst = dst + src * s
template <typename T, typename U>
inline void Axpy(const LocalTensor<T> &dst, const LocalTensor<U> &src, const U &s, const int32_t &count)
{
    T *d = detail::Vec(dst, count, "Axpy");
    const U *x = detail::Vec(src, count, "Axpy");
    for (int32_t i = 0; i < count; ++i) d[i] = d[i] + x[i] * s;
}
template <typename T>
inline void Exp(const LocalTensor<T> &dst, const LocalTensor<T> &src, const int32_t &count)
{
    T *d = detail::Vec(dst, count, "Exp");
    const T *x = detail::Vec(src, count, "Exp");
    for (int32_t i = 0; i < count; ++i) d[i] = std::exp(x[i]);
}
template <typename T>
inline void Relu(const LocalTensor<T> &dst, const LocalTensor<T> &src, const int32_t &count)
{
    T *d = detail::Vec(dst, count, "Relu");
    const T *x = detail::Vec(src, count, "Relu");
    for (int32_t i = 0; i < count; ++i) d[i] = x[i] > T(0) ? x[i] : T(0);
}

namespace detail {
template <typename D, typename S>
inline D Convert(S v, RoundMode) { return static_cast<D>(v); }
template <>
inline bfloat16_t Convert<bfloat16_t, float>(float v, RoundMode) { return bfloat16_t(v); }  // RNE (CAST_RINT / CAST_NONE)
template <>
inline half Convert<half, float>(float v, RoundMode) { return half(v); }
template <>
inline float Convert<float, int32_t>(int32_t v, RoundMode) { return static_cast<float>(v); }
}  // namespace detail

template <typename D, typename S>
inline void Cast(const LocalTensor<D> &dst, const LocalTensor<S> &src, const RoundMode &mode, const uint32_t &count)
{
    D *d = detail::Vec(dst, count, "Cast");
    const S *x = detail::Vec(src, count, "Cast");
    if (static_cast<const void *>(d) == static_cast<const void *>(x) && sizeof(D) != sizeof(S)) {
        throw sao_model::Fault("Cast: in-place cast between different widths");
    }
    for (uint32_t i = 0; i < count; ++i) d[i] = detail::Convert<D, S>(x[i], mode);
}

template <typename T>
inline void CreateVecIndex(const LocalTensor<T> &dst, const T &first, uint32_t count)
{
    T *d = detail::Vec(dst, count, "CreateVecIndex");
    for (uint32_t i = 0; i < count; ++i) d[i] = static_cast<T>(first + static_cast<T>(i));
}

// dst[0] = max (or sum) of src[0..count); the model sums in index order.
template <typename T>
inline void ReduceMax(const LocalTensor<T> &dst, const LocalTensor<T> &src, const LocalTensor<T> &work,
                      const int32_t count, bool calIndex = false)
{
    const T *x = detail::Vec(src, count, "ReduceMax");
    T *d = detail::Vec(dst, 1, "ReduceMax");
    (void)work;
    T m = x[0];
    for (int32_t i = 1; i < count; ++i) m = x[i] > m ? x[i] : m;
    d[0] = m;
    (void)calIndex;
}
template <typename T>
inline void ReduceSum(const LocalTensor<T> &dst, const LocalTensor<T> &src, const LocalTensor<T> &work,
                      const int32_t count)
{
    const T *x = detail::Vec(src, count, "ReduceSum");
    T *d = detail::Vec(dst, 1, "ReduceSum");
    (void)work;
    T s = T(0);
    for (int32_t i = 0; i < count; ++i) s += x[i];
    d[0] = s;
}

// --------------------------------------------------------------- sort family
// Sorted lists are (score, index) pairs of 8 bytes: float score, uint32 index.
namespace detail {
struct Pair {
    float score;
    uint32_t index;
};
}  // namespace detail

// Sort<float, true>: all repeatTime * 32 (score, index) pairs in descending score order;
// equal scores keep their input order (the lower input index first).
template <typename T, bool isFullSort>
inline void Sort(const LocalTensor<T> &dst, const LocalTensor<T> &concat, const LocalTensor<uint32_t> &index,
                 const LocalTensor<T> &tmp, const int32_t repeatTime)
{
    static_assert(std::is_same<T, float>::value, "the model sorts float scores");
    static_assert(isFullSort, "the model implements full sorts");
    if (repeatTime < 1 || repeatTime > 255) throw sao_model::Fault("Sort: repeatTime must be 1..255");
    uint32_t n = static_cast<uint32_t>(repeatTime) * 32;
    const float *s = detail::Vec(concat, n, "Sort");
    const uint32_t *ix = detail::Vec(index, n, "Sort");
    detail::Vec(tmp, 2 * n, "Sort");
    float *d = detail::Vec(dst, 2 * n, "Sort");
    std::vector<detail::Pair> v(n);
    for (uint32_t i = 0; i < n; ++i) v[i] = {s[i], ix[i]};
    std::stable_sort(v.begin(), v.end(), [](const detail::Pair &a, const detail::Pair &b) { return a.score > b.score; });
    std::memcpy(d, v.data(), n * 8);
}

template <typename T>
struct MrgSortSrcList {
    MrgSortSrcList() = default;
    MrgSortSrcList(const LocalTensor<T> &a, const LocalTensor<T> &b, const LocalTensor<T> &c, const LocalTensor<T> &d)
        : src1(a), src2(b), src3(c), src4(d) {}
    LocalTensor<T> src1, src2, src3, src4;
};

// Merge the sorted lists selected by validBit (bit i = list i+1) into dst, descending;
// equal scores: the earlier list first, then the list's own order.
template <typename T, bool isExhaustedSuspension = false>
inline void MrgSort(const LocalTensor<T> &dst, const MrgSortSrcList<T> &list, const uint16_t elementCountList[4],
                    uint32_t sortedNum[4], uint16_t validBit, const int32_t repeatTime)
{
    static_assert(std::is_same<T, float>::value, "the model merges float scores");
    if (repeatTime != 1) throw sao_model::Fault("MrgSort: only repeatTime 1 is modelled");
    const LocalTensor<T> *src[4] = {&list.src1, &list.src2, &list.src3, &list.src4};
    std::vector<detail::Pair> all;
    for (int q = 0; q < 4; ++q) {
        if (!(validBit & (1u << q))) continue;
        uint32_t n = elementCountList[q];
        if (n > 4095) throw sao_model::Fault("MrgSort: a list longer than 4095 elements");
        const float *p = detail::Vec(*src[q], 2 * n, "MrgSort");
        size_t at = all.size();
        all.resize(at + n);
        std::memcpy(all.data() + at, p, n * 8);
        for (uint32_t i = 1; i < n; ++i) {
            if (all[at + i].score > all[at + i - 1].score) throw sao_model::Fault("MrgSort: an input list is not sorted");
        }
        sortedNum[q] = n;
    }
    if (validBit != 0b0011 && validBit != 0b0111 && validBit != 0b1111) throw sao_model::Fault("MrgSort: validBit must select 2-4 lists");
    std::stable_sort(all.begin(), all.end(), [](const detail::Pair &a, const detail::Pair &b) { return a.score > b.score; });
    float *d = detail::Vec(dst, static_cast<uint32_t>(2 * all.size()), "MrgSort");
    std::memcpy(d, all.data(), all.size() * 8);
    (void)isExhaustedSuspension;
}

// Split repeatTime * 32 sorted pairs into scores and indices.
template <typename T>
inline void Extract(const LocalTensor<T> &dstValue, const LocalTensor<uint32_t> &dstIndex, const LocalTensor<T> &sorted,
                    const int32_t repeatTime)
{
    if (repeatTime < 1 || repeatTime > 255) throw sao_model::Fault("Extract: repeatTime must be 1..255");
    uint32_t n = static_cast<uint32_t>(repeatTime) * 32;
    float *v = detail::Vec(dstValue, n, "Extract");
    uint32_t *ix = detail::Vec(dstIndex, n, "Extract");
    const float *s = detail::Vec(sorted, 2 * n, "Extract");
    std::vector<detail::Pair> tmp(n);
    std::memcpy(tmp.data(), s, n * 8);
    for (uint32_t i = 0; i < n; ++i) {
        v[i] = tmp[i].score;
        ix[i] = tmp[i].index;
    }
}

// ------------------------------------------------------------------ Matmul API
template <TPosition POS, CubeFormat FORMAT, typename TYPE, bool ISTRANS = false>
struct MatmulType {
    using T = TYPE;
    static constexpr bool isTrans = ISTRANS;
};

namespace detail {
template <typename T> struct Acc { using type = float; };
template <> struct Acc<int8_t> { using type = int32_t; };
}  // namespace detail

// Synchronous model of the high-level Matmul API with GM operands: C[M, N] = A[M, K] B[K, N]
// (B stored [N, K] when set transposed), accumulated in float (int32 for int8) in k order.
template <class A_TYPE, class B_TYPE, class C_TYPE>
class Matmul {
public:
    using SrcT = typename A_TYPE::T;
    using DstT = typename C_TYPE::T;
    void Init(const TCubeTiling *tiling)
    {
        if (tiling == nullptr) throw sao_model::Fault("Matmul: no tiling");
        m_ = tiling->M;
        n_ = tiling->N;
        k_ = tiling->Ka;
        if (m_ <= 0 || n_ <= 0 || k_ <= 0 || tiling->Kb != k_) throw sao_model::Fault("Matmul: tiling has no valid shape");
    }
    void SetTensorA(const GlobalTensor<SrcT> &a, bool transA = false)
    {
        if (transA) throw sao_model::Fault("Matmul: transposed A is not modelled");
        a_ = a;
        haveA_ = true;
    }
    void SetTensorB(const GlobalTensor<typename B_TYPE::T> &b, bool transB = false)
    {
        if (transB && !B_TYPE::isTrans) throw sao_model::Fault("Matmul: SetTensorB(..., true) needs a MatmulType with isTrans");
        b_ = b;
        transB_ = transB;
        haveB_ = true;
    }
    void IterateAll(const GlobalTensor<DstT> &c, uint8_t enAtomic = 0, bool = false, bool = false, bool = false)
    {
        if (!haveA_ || !haveB_) throw sao_model::Fault("Matmul::IterateAll before SetTensorA/SetTensorB");
        if (m_ == 0) throw sao_model::Fault("Matmul::IterateAll before REGIST_MATMUL_OBJ / Init");
        using Acc = typename detail::Acc<SrcT>::type;
        const SrcT *a = a_.GetPhyAddr();
        const typename B_TYPE::T *b = b_.GetPhyAddr();
        DstT *cp = c.GetPhyAddr();
        sao_model::CheckGm(a, uint64_t(m_) * k_ * sizeof(SrcT), "Matmul A");
        sao_model::CheckGm(b, uint64_t(n_) * k_ * sizeof(SrcT), "Matmul B");
        sao_model::CheckGm(cp, uint64_t(m_) * n_ * sizeof(DstT), "Matmul C");
        for (int32_t i = 0; i < m_; ++i) {
            for (int32_t j = 0; j < n_; ++j) {
                Acc acc = Acc(0);
                for (int32_t kk = 0; kk < k_; ++kk) {
                    Acc x = static_cast<Acc>(static_cast<float>(a[uint64_t(i) * k_ + kk]));
                    Acc y = static_cast<Acc>(static_cast<float>(transB_ ? b[uint64_t(j) * k_ + kk] : b[uint64_t(kk) * n_ + j]));
                    acc += x * y;
                }
                DstT &out = cp[uint64_t(i) * n_ + j];
                out = enAtomic ? static_cast<DstT>(out + static_cast<DstT>(acc)) : static_cast<DstT>(acc);
            }
        }
    }
    void End() {}

private:
    int32_t m_ = 0, n_ = 0, k_ = 0;
    GlobalTensor<SrcT> a_;
    GlobalTensor<typename B_TYPE::T> b_;
    bool transB_ = false, haveA_ = false, haveB_ = false;
};

namespace detail {
inline void Regist() {}
template <class MM, typename... Rest>
inline void Regist(MM &mm, const TCubeTiling *tiling, Rest &&...rest)
{
    mm.Init(tiling);
    Regist(rest...);
}
}  // namespace detail

}  // namespace AscendC

inline AscendC::TPipe *GetTPipePtr() { return sao_model::CurrentPipe(); }
inline GM_ADDR GetSysWorkSpacePtr() { return sao_model::Core().sysWorkspace; }

#define ASCEND_IS_AIC (sao_model::Core().coreType == AscendC::AIC)
#define ASCEND_IS_AIV (sao_model::Core().coreType == AscendC::AIV)
#define REGIST_MATMUL_OBJ(pipe, workspace, ...) AscendC::detail::Regist(__VA_ARGS__)

#endif  // SAO_ASCENDC_MODEL_KERNEL_OPERATOR_H
