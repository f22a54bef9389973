/*
 * The residency step of one row (the manage half of LIM / LIM-C8), on one vector core.
 *
 * Implements docs/residency_contract.md exactly (exact LRU, policy "lru"):
 *   1. reset the row when req_ids[r] != row_req[r];
 *   2. empty every slot holding a position >= stable_len[r];
 *   3. entry j is a hit when a slot holds topk[j] (< stable_len) ;
 *   4. evictable = slots not hit this step, ordered by (stamp, slot); the i-th miss in
 *      top-k order takes the i-th evictable slot;
 *   5. filled slots get stamp 2*step+1, hit slots 2*step+2.
 *
 * Branches, all decided on the device from the row's own data:
 *   - first fill: after steps 1-2 no slot is occupied (new request, idle row, or every
 *     slot speculative). Every valid entry misses and takes slots 0, 1, ... in order,
 *     which is what step 4 gives for empty slots (stamp 0, ascending slot).
 *   - steady: an open-addressing table (position -> slot, int16, >= 2*Hh entries) gives
 *     the hits in O(Hh + K); victims are the empty evictable slots in slot order, then
 *     the oldest occupied ones by (stamp, slot) through a bounded max-heap over the
 *     int64 stamps (exact order, no float keys).
 *
 * The entries of a step are a top-K (one query token per row) or, with several query
 * tokens per row (speculative verify rows of one request), the union of their top-K:
 * their distinct positions ascending, -1 after, W = min(n * K, Hh) entries wide (the
 * caller adds them in priority order with AddPosition, which keeps the first W: the rest
 * overflow, and the row's step never sees them). A position several tokens select is one
 * lookup; each token then reads its slots back from the row's positions after the step
 * (RebuildTable + SlotOf; a position that overflowed has none).
 *
 * Most of the work is scalar over UB-resident arrays (Hh <= 4096, W <= Hh); the bulk
 * fills are vector instructions. UB: the entry-sized arrays share buffers where one is
 * consumed before the other is written at the same or a lower index (hit slot -> miss
 * position, victim -> miss slot), so a step of W = Hh = 4096 fits the pool. Correctness first: vectorising the lookup and the
 * victim selection is future work (see ascendc_ops/README.md).
 *
 * Stamps are int64 in GM; they are moved as pairs of uint32 words (lo, hi) so only
 * word-sized DataCopy is needed, and combined on the scalar unit.
 *
 * STATUS: compiled on CPU (syntax-only, asc-devkit 8.5.0 headers) and run on the functional
 * model (check-kernels); never run on an NPU. See ascendc_ops/README.md.
 */
#ifndef SAO_RESIDENCY_MANAGE_H
#define SAO_RESIDENCY_MANAGE_H

#include "sao_kernel_common.h"

namespace sao {

// GM views of the residency state, the row inputs and the per-row outputs.
struct ResidencyGm {
    AscendC::GlobalTensor<int32_t> slotToken;    // [R, Hh]   in/out
    AscendC::GlobalTensor<uint32_t> stampWords;  // [R, 2*Hh] in/out (int64 slot_stamp as lo/hi words)
    AscendC::GlobalTensor<int64_t> rowReq;       // [R]       in/out
    AscendC::GlobalTensor<int64_t> reqIds;       // [R]
    AscendC::GlobalTensor<int32_t> stableLen;    // [R]
    AscendC::GlobalTensor<uint8_t> hitMask;      // [R, W]    out (bool); W = entries per step
    AscendC::GlobalTensor<int32_t> slots;        // [R, W]    out
    AscendC::GlobalTensor<int32_t> missCount;    // [R]       out
    AscendC::GlobalTensor<int32_t> missTokens;   // [R, W]    out
    AscendC::GlobalTensor<int32_t> missSlots;    // [R, W]    out
};

// UB bytes the row step needs for steps of `k` entries (the caller carves them out of its
// pool; host/tiling.cpp mirrors this).
__aicore__ inline uint32_t ResidencyUbBytes(uint32_t hot, uint32_t k, uint32_t hashBits)
{
    return AlignUp(hot * 4, 32) + AlignUp(hot * 8, 32) + AlignUp((1u << hashBits) * 2, 32) +
           AlignUp(hot * 2, 32) + 4 * AlignUp(k * 4, 32) + AlignUp(k, 32) + 2 * 32;
}

class RowResidency {
public:
    __aicore__ inline RowResidency() {}

    // pool: at least ResidencyUbBytes() bytes of VECCALC UB; k: entries per step.
    __aicore__ inline void Init(const ResidencyGm &gm, const AscendC::LocalTensor<uint8_t> &pool, uint32_t hot,
                                uint32_t k, uint32_t hashBits, int64_t step)
    {
        gm_ = gm;
        hot_ = hot;
        k_ = k;
        hashBits_ = hashBits;
        fillStamp_ = 2 * step + 1;
        hitStamp_ = 2 * step + 2;
        uint32_t off = 0;
        slotToken_ = Carve<int32_t>(pool, off, hot);
        stampWords_ = Carve<uint32_t>(pool, off, 2 * hot);
        table_ = Carve<int16_t>(pool, off, 1u << hashBits);
        slotHit_ = Carve<int16_t>(pool, off, hot);
        hitSlot_ = Carve<int32_t>(pool, off, k);
        missTokens_ = hitSlot_;  // entry j's hit slot is read before miss i <= j is written
        slots_ = Carve<int32_t>(pool, off, k);
        victims_ = Carve<int32_t>(pool, off, k);
        missSlots_ = victims_;  // victim i is read, then miss slot i written with it
        heap_ = Carve<int32_t>(pool, off, k);
        hitBytes_ = Carve<uint8_t>(pool, off, AlignUp(k, 32));
        rowReqOut_ = Carve<int64_t>(pool, off, 1);  // each scalar on its own 32-byte line:
        missCountOut_ = Carve<int32_t>(pool, off, 1);  // DataCopyPad needs aligned UB addresses
    }

    // One step of row `row` for the top-k `topk` (UB int32 [K], -1 = padding; all -1 for
    // a row no query token owns). Reads and writes the row's GM state and outputs.
    __aicore__ inline void Step(uint32_t row, const AscendC::LocalTensor<int32_t> &topk)
    {
        LoadRow(row);
        int64_t req = gm_.reqIds.GetValue(row);
        int32_t stable = gm_.stableLen.GetValue(row);
        ResetAndDropSpeculative(row, req, stable);
        bool idle = req == -1;
        uint32_t occupied = CountOccupied();
        uint32_t misses = occupied == 0 ? FirstFill(topk, idle) : Steady(topk, idle, stable);
        StoreRow(row, misses);
    }

    // Hot slot of each top-k entry after the last Step (UB int32 [K], -1 = padding).
    __aicore__ inline const AscendC::LocalTensor<int32_t> &Slots() const { return slots_; }

    // ------------------------------------------------ several query tokens per row
    // The union is built in the slots buffer and passed to Step as its entries: Step reads
    // entry j before it writes slot j, so the two may share the buffer.
    __aicore__ inline const AscendC::LocalTensor<int32_t> &UnionEntries() const { return slots_; }

    // Start an empty union (positions are added with AddPosition, then FinishUnion).
    __aicore__ inline void BeginUnion()
    {
        AscendC::Duplicate(table_, static_cast<int16_t>(-1), 1u << hashBits_);
        WaitPipe<AscendC::HardEvent::V_S>();
        unionSize_ = 0;
    }

    // Add one position (-1 = padding, skipped) unless the union already holds it or is
    // full (W distinct positions: what comes after overflows).
    __aicore__ inline void AddPosition(int32_t pos)
    {
        if (pos < 0 || unionSize_ >= k_) {
            return;
        }
        uint32_t mask = (1u << hashBits_) - 1;
        uint32_t h = Hash(pos);
        for (int16_t e = table_.GetValue(h); e != -1; e = table_.GetValue(h)) {
            if (slots_.GetValue(static_cast<uint32_t>(e)) == pos) {
                return;
            }
            h = (h + 1) & mask;
        }
        table_.SetValue(h, static_cast<int16_t>(unionSize_));  // at most W <= Hh: load factor <= 1/2
        slots_.SetValue(unionSize_++, pos);
    }

    // Sort the union ascending (heap sort on the scalar unit) and pad it with -1 to k entries.
    __aicore__ inline void FinishUnion()
    {
        uint32_t n = unionSize_;
        for (uint32_t i = n / 2; i > 0; --i) {
            SiftPositions(i - 1, n);
        }
        for (uint32_t end = n; end > 1; --end) {
            int32_t top = slots_.GetValue(0);
            slots_.SetValue(0, slots_.GetValue(end - 1));
            slots_.SetValue(end - 1, top);
            SiftPositions(0, end - 1);
        }
        for (uint32_t j = n; j < k_; ++j) {
            slots_.SetValue(j, -1);
        }
    }

    // After a Step: the position -> slot table of the row as it now stands (SlotOf).
    __aicore__ inline void RebuildTable() { BuildTable(); }

    // Slot holding `pos` after the last Step (RebuildTable first), -1 when none does.
    __aicore__ inline int32_t SlotOf(int32_t pos) const { return pos < 0 ? -1 : Find(pos); }

private:
    template <typename T>
    __aicore__ inline AscendC::LocalTensor<T> Carve(const AscendC::LocalTensor<uint8_t> &pool, uint32_t &off,
                                                    uint32_t count)
    {
        AscendC::LocalTensor<T> t = pool[off].template ReinterpretCast<T>();
        off += AlignUp(count * sizeof(T), 32);
        return t;
    }

    __aicore__ inline int64_t Stamp(uint32_t s) const
    {
        uint64_t lo = stampWords_.GetValue(2 * s);
        uint64_t hi = stampWords_.GetValue(2 * s + 1);
        return static_cast<int64_t>(lo | (hi << 32));
    }

    __aicore__ inline void SetStamp(uint32_t s, int64_t v)
    {
        uint64_t u = static_cast<uint64_t>(v);
        stampWords_.SetValue(2 * s, static_cast<uint32_t>(u & 0xffffffffu));
        stampWords_.SetValue(2 * s + 1, static_cast<uint32_t>(u >> 32));
    }

    // ------------------------------------------------------------- GM <-> UB
    __aicore__ inline void LoadRow(uint32_t row)
    {
        AscendC::DataCopy(slotToken_, gm_.slotToken[row * hot_], hot_);
        AscendC::DataCopy(stampWords_, gm_.stampWords[2 * row * hot_], 2 * hot_);
        WaitPipe<AscendC::HardEvent::MTE2_S>();
    }

    __aicore__ inline void StoreRow(uint32_t row, uint32_t misses)
    {
        // compacted miss lists: -1 after the misses
        for (uint32_t i = misses; i < k_; ++i) {
            missTokens_.SetValue(i, -1);
            missSlots_.SetValue(i, -1);
        }
        rowReqOut_.SetValue(0, gm_.reqIds.GetValue(row));  // row_req[r] = req_ids[r]
        missCountOut_.SetValue(0, static_cast<int32_t>(misses));
        WaitPipe<AscendC::HardEvent::S_MTE3>();
        AscendC::DataCopy(gm_.slotToken[row * hot_], slotToken_, hot_);
        AscendC::DataCopy(gm_.stampWords[2 * row * hot_], stampWords_, 2 * hot_);
        StoreExact(gm_.hitMask[row * k_], hitBytes_, k_);
        StoreExact(gm_.slots[row * k_], slots_, k_);
        StoreExact(gm_.missTokens[row * k_], missTokens_, k_);
        StoreExact(gm_.missSlots[row * k_], missSlots_, k_);
        StoreExact(gm_.rowReq[row], rowReqOut_, 1);
        StoreExact(gm_.missCount[row], missCountOut_, 1);
        // the next row reuses these buffers: its loads and scalar writes wait for the stores
        WaitPipe<AscendC::HardEvent::MTE3_MTE2>();
        WaitPipe<AscendC::HardEvent::MTE3_S>();
    }

    // ------------------------------------------------------- contract steps 1-2
    __aicore__ inline void ResetAndDropSpeculative(uint32_t row, int64_t req, int32_t stable)
    {
        if (req != gm_.rowReq.GetValue(row)) {
            AscendC::Duplicate(slotToken_, static_cast<int32_t>(-1), hot_);
            AscendC::Duplicate(stampWords_, static_cast<uint32_t>(0), 2 * hot_);
            WaitPipe<AscendC::HardEvent::V_S>();
            return;  // nothing is occupied, nothing speculative is left
        }
        for (uint32_t s = 0; s < hot_; ++s) {
            int32_t tok = slotToken_.GetValue(s);
            if (tok != -1 && tok >= stable) {
                slotToken_.SetValue(s, -1);
                SetStamp(s, 0);
            }
        }
    }

    __aicore__ inline uint32_t CountOccupied() const
    {
        uint32_t n = 0;
        for (uint32_t s = 0; s < hot_; ++s) {
            n += slotToken_.GetValue(s) != -1 ? 1u : 0u;
        }
        return n;
    }

    // ------------------------------------------------------------- first fill
    __aicore__ inline uint32_t FirstFill(const AscendC::LocalTensor<int32_t> &topk, bool idle)
    {
        uint32_t misses = 0;
        for (uint32_t j = 0; j < k_; ++j) {
            int32_t tok = topk.GetValue(j);
            hitBytes_.SetValue(j, 0);
            if (idle || tok == -1) {
                slots_.SetValue(j, -1);
                continue;
            }
            int32_t slot = static_cast<int32_t>(misses);  // empty slots in ascending order
            slots_.SetValue(j, slot);
            missTokens_.SetValue(misses, tok);
            missSlots_.SetValue(misses, slot);
            slotToken_.SetValue(slot, tok);
            SetStamp(slot, fillStamp_);
            ++misses;
        }
        return misses;
    }

    // ----------------------------------------------------------------- steady
    __aicore__ inline uint32_t Hash(int32_t pos) const
    {
        return (static_cast<uint32_t>(pos) * 2654435761u) >> (32 - hashBits_);
    }

    __aicore__ inline void BuildTable()
    {
        AscendC::Duplicate(table_, static_cast<int16_t>(-1), 1u << hashBits_);
        AscendC::Duplicate(slotHit_, static_cast<int16_t>(0), hot_);
        WaitPipe<AscendC::HardEvent::V_S>();
        uint32_t mask = (1u << hashBits_) - 1;
        for (uint32_t s = 0; s < hot_; ++s) {
            int32_t tok = slotToken_.GetValue(s);
            if (tok == -1) {
                continue;
            }
            uint32_t h = Hash(tok);
            while (table_.GetValue(h) != -1) {  // load factor <= 1/2: short probes
                h = (h + 1) & mask;
            }
            table_.SetValue(h, static_cast<int16_t>(s));
        }
    }

    __aicore__ inline int32_t Find(int32_t tok) const
    {
        uint32_t mask = (1u << hashBits_) - 1;
        for (uint32_t h = Hash(tok);; h = (h + 1) & mask) {
            int16_t s = table_.GetValue(h);
            if (s == -1) {
                return -1;
            }
            if (slotToken_.GetValue(static_cast<uint32_t>(s)) == tok) {
                return s;
            }
        }
    }

    // (stamp, slot) ordering of occupied evictable slots
    __aicore__ inline bool Older(int32_t a, int32_t b) const
    {
        int64_t sa = Stamp(a);
        int64_t sb = Stamp(b);
        return sa < sb || (sa == sb && a < b);
    }

    // Max-heap (by Older) of slot indices in heap_[0..n): the root is the youngest kept.
    __aicore__ inline void SiftDown(uint32_t i, uint32_t n)
    {
        while (true) {
            uint32_t l = 2 * i + 1;
            if (l >= n) {
                return;
            }
            uint32_t c = l;
            if (l + 1 < n && Older(heap_.GetValue(l), heap_.GetValue(l + 1))) {
                c = l + 1;
            }
            if (!Older(heap_.GetValue(i), heap_.GetValue(c))) {
                return;
            }
            int32_t t = heap_.GetValue(i);
            heap_.SetValue(i, heap_.GetValue(c));
            heap_.SetValue(c, t);
            i = c;
        }
    }

    __aicore__ inline void SiftUp(uint32_t i)
    {
        while (i > 0) {
            uint32_t p = (i - 1) / 2;
            if (!Older(heap_.GetValue(p), heap_.GetValue(i))) {
                return;
            }
            int32_t t = heap_.GetValue(i);
            heap_.SetValue(i, heap_.GetValue(p));
            heap_.SetValue(p, t);
            i = p;
        }
    }

    // victims_[0..need): evictable slots in (stamp, slot) order.
    __aicore__ inline void ChooseVictims(uint32_t need)
    {
        uint32_t n = 0;
        for (uint32_t s = 0; s < hot_ && n < need; ++s) {  // empty slots first (stamp 0), by slot
            if (slotToken_.GetValue(s) == -1) {
                victims_.SetValue(n++, static_cast<int32_t>(s));
            }
        }
        uint32_t more = need - n;
        if (more == 0) {
            return;
        }
        uint32_t size = 0;  // keep the `more` oldest occupied, non-hit slots
        for (uint32_t s = 0; s < hot_; ++s) {
            if (slotToken_.GetValue(s) == -1 || slotHit_.GetValue(s) != 0) {
                continue;
            }
            int32_t slot = static_cast<int32_t>(s);
            if (size < more) {
                heap_.SetValue(size, slot);
                SiftUp(size++);
            } else if (Older(slot, heap_.GetValue(0))) {
                heap_.SetValue(0, slot);
                SiftDown(0, size);
            }
        }
        for (uint32_t i = size; i > 0; --i) {  // pop youngest first: fill from the back
            victims_.SetValue(n + i - 1, heap_.GetValue(0));
            heap_.SetValue(0, heap_.GetValue(i - 1));
            SiftDown(0, i - 1);
        }
    }

    __aicore__ inline uint32_t Steady(const AscendC::LocalTensor<int32_t> &topk, bool idle, int32_t stable)
    {
        BuildTable();
        uint32_t misses = 0;
        for (uint32_t j = 0; j < k_; ++j) {  // lookup (contract step 3)
            int32_t tok = topk.GetValue(j);
            int32_t found = -1;
            if (!idle && tok != -1) {
                found = tok < stable ? Find(tok) : -1;
                misses += found < 0 ? 1u : 0u;
            }
            hitSlot_.SetValue(j, found);
            if (found >= 0) {
                slotHit_.SetValue(static_cast<uint32_t>(found), 1);
            }
        }
        ChooseVictims(misses);  // contract step 4
        uint32_t i = 0;
        for (uint32_t j = 0; j < k_; ++j) {  // assignment + step 5
            int32_t tok = topk.GetValue(j);
            int32_t hit = hitSlot_.GetValue(j);
            hitBytes_.SetValue(j, static_cast<uint8_t>(hit >= 0 ? 1 : 0));
            if (hit >= 0) {
                slots_.SetValue(j, hit);
                SetStamp(static_cast<uint32_t>(hit), hitStamp_);
            } else if (!idle && tok != -1) {
                int32_t victim = victims_.GetValue(i);
                slots_.SetValue(j, victim);
                missTokens_.SetValue(i, tok);
                missSlots_.SetValue(i, victim);
                slotToken_.SetValue(static_cast<uint32_t>(victim), tok);
                SetStamp(static_cast<uint32_t>(victim), fillStamp_);
                ++i;
            } else {
                slots_.SetValue(j, -1);
            }
        }
        return misses;
    }

    // Max-heap sift over the union positions in slots_[0..n).
    __aicore__ inline void SiftPositions(uint32_t i, uint32_t n)
    {
        while (true) {
            uint32_t l = 2 * i + 1;
            if (l >= n) {
                return;
            }
            uint32_t c = l;
            if (l + 1 < n && slots_.GetValue(l) < slots_.GetValue(l + 1)) {
                c = l + 1;
            }
            if (slots_.GetValue(i) >= slots_.GetValue(c)) {
                return;
            }
            int32_t t = slots_.GetValue(i);
            slots_.SetValue(i, slots_.GetValue(c));
            slots_.SetValue(c, t);
            i = c;
        }
    }

    ResidencyGm gm_;
    uint32_t unionSize_ = 0;
    uint32_t hot_ = 0;
    uint32_t k_ = 0;
    uint32_t hashBits_ = 0;
    int64_t fillStamp_ = 1;
    int64_t hitStamp_ = 2;
    AscendC::LocalTensor<int32_t> slotToken_;
    AscendC::LocalTensor<uint32_t> stampWords_;
    AscendC::LocalTensor<int16_t> table_;
    AscendC::LocalTensor<int16_t> slotHit_;
    AscendC::LocalTensor<int32_t> hitSlot_;
    AscendC::LocalTensor<int32_t> slots_;
    AscendC::LocalTensor<int32_t> missTokens_;
    AscendC::LocalTensor<int32_t> missSlots_;
    AscendC::LocalTensor<int32_t> victims_;
    AscendC::LocalTensor<int32_t> heap_;
    AscendC::LocalTensor<uint8_t> hitBytes_;
    AscendC::LocalTensor<int64_t> rowReqOut_;
    AscendC::LocalTensor<int32_t> missCountOut_;
};

}  // namespace sao

#endif  // SAO_RESIDENCY_MANAGE_H
