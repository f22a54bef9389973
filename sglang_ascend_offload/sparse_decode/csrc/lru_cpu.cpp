// CPU kernel of the exact-LRU residency contract (docs/residency_contract.md), rows form.
//
// Built by sglang_ascend_offload/sparse_decode/cpu_kernel.py (g++ -O3 -shared; no torch
// headers, called through ctypes behind torch custom ops). The torch reference
// (sparse_decode/residency.py) is the specification; tests compare the two bit for bit.
//
// Per engine row the kernel keeps, next to the contract's state (slot_token, slot_stamp,
// row_req), three derived structures that are only ever updated where the contract's
// state changes, so a step costs one pass over the row's top-k and O(H) byte/int work:
//
//   order  int32 [R, H]   the row's slots sorted by (slot_stamp, slot) ascending: the
//                         LRU eviction order, maintained instead of sorted per step;
//   hkeys / hvals int32 [R, C]   open-addressing hash map position -> slot (linear
//                         probing, backward-shift deletion, C = power of two >= 2H):
//                         a persistent position map whose memory is bounded by H, not
//                         by the context length;
//   maxpos int32 [R]      an upper bound of the positions the row holds (-1: none), so
//                         the speculative-invalidation scan runs only when some held
//                         position may be >= stable_len.
//
// Invariant needed for the maintained order: per row, steps are strictly increasing
// (stamps of earlier steps are <= 2*(step-1)+2 < 2*step+1). The engine guarantees it.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

struct RowMap {
  static constexpr bool kLazy = false;
  int32_t* hk;
  int32_t* hv;
  uint32_t mask;
  int shift;

  inline uint32_t home(int32_t p) const { return (static_cast<uint32_t>(p) * 2654435761u) >> shift; }

  inline void prefetch(int32_t p) const {
    const uint32_t i = home(p);
    __builtin_prefetch(hk + i);
    __builtin_prefetch(hv + i);
  }

  inline void prefetch2(int32_t) const {}

  inline int32_t find(int32_t p) const {
    uint32_t i = home(p);
    while (true) {
      int32_t k = hk[i];
      if (k == p) return hv[i];
      if (k < 0) return -1;
      i = (i + 1) & mask;
    }
  }

  inline void insert(int32_t p, int32_t s) {
    uint32_t i = home(p);
    while (hk[i] >= 0) i = (i + 1) & mask;
    hk[i] = p;
    hv[i] = s;
  }

  inline void clear(const int32_t*, int64_t) { std::fill(hk, hk + mask + 1, -1); }

  // Returns false if p is absent (a corrupted state: the caller reports it).
  inline bool erase(int32_t p) {
    uint32_t i = home(p);
    while (hk[i] != p) {
      if (hk[i] < 0) return false;
      i = (i + 1) & mask;
    }
    uint32_t j = i;
    while (true) {
      j = (j + 1) & mask;
      int32_t k = hk[j];
      if (k < 0) break;
      uint32_t h = home(k);
      bool stays = (i <= j) ? (h > i && h <= j) : (h > i || h <= j);
      if (!stays) {
        hk[i] = k;
        hv[i] = hv[j];
        i = j;
      }
    }
    hk[i] = -1;
    return true;
  }
};

// Dense map: slot_of[p] for 0 <= p < width (positions index the token table, so they
// are < its width). Never cleared: an entry is trusted only if the slot it names still
// holds the position (slot_token[slot_of[p]] == p), so evictions, invalidations and
// resets write nothing here and a step touches the map only at its lookups and fills.
// Correct because slot_of[p] is rewritten at every fill of p and a position is held by
// at most one slot of the row. Slot is int16_t when H <= 32767 (half the cold lines a
// row's lookups touch, half the memory), else int32_t.
template <typename Slot>
struct DenseMap {
  Slot* so;
  const int32_t* tok;
  int64_t width;

  inline void prefetch(int32_t p) const {
    if (p < width) __builtin_prefetch(so + p);
  }
  // Second stage: the slot_token entry the check of p reads (so[p] fetched earlier).
  inline void prefetch2(int32_t p) const {
    if (p < width) {
      const int32_t s = so[p];
      if (s >= 0) __builtin_prefetch(tok + s);
    }
  }
  inline int32_t find(int32_t p) const {
    const int32_t s = p < width ? so[p] : -1;
    return (s >= 0 && tok[s] == p) ? s : -1;
  }
  inline void insert(int32_t p, int32_t s) { so[p] = static_cast<Slot>(s); }
  inline bool erase(int32_t) { return true; }
  inline void clear(const int32_t*, int64_t) {}
  static constexpr bool kLazy = true;
};

template <typename Map, typename MakeMap>
int manage_rows(MakeMap make_map, int32_t* __restrict slot_token, int64_t* __restrict slot_stamp,
                int64_t* __restrict row_req, int32_t* __restrict order, int32_t* __restrict maxpos, int64_t R,
                int64_t H, int64_t map_width, const int64_t* __restrict rows, const int32_t* __restrict topk,
                const int64_t* __restrict req_ids, const int32_t* __restrict stable_len, int64_t B, int64_t K,
                int64_t step, uint8_t* __restrict hit_mask, int32_t* __restrict slots,
                int32_t* __restrict miss_count, int32_t* __restrict miss_tokens, int32_t* __restrict miss_slots) {
  const int64_t fill_stamp = 2 * step + 1;
  const int64_t hit_stamp = 2 * step + 2;
  // Per-thread scratch, grown on demand and reused across calls (no allocation per step;
  // every element read is written first in the same row).
  thread_local std::vector<uint8_t> flag_buf;  // [H+1]: H is the target of branch-free stores
  thread_local std::vector<int32_t> miss_j_buf, victims_buf, neworder_buf, fills_buf, hit_slots_buf;
  if (flag_buf.size() < static_cast<size_t>(H + 1)) flag_buf.resize(H + 1);
  if (miss_j_buf.size() < static_cast<size_t>(K + 1)) miss_j_buf.resize(K + 1);
  if (victims_buf.size() < static_cast<size_t>(K + 1)) victims_buf.resize(K + 1);
  if (neworder_buf.size() < static_cast<size_t>(H + 1)) neworder_buf.resize(H + 1);
  if (fills_buf.size() < static_cast<size_t>(H + 1)) fills_buf.resize(H + 1);
  if (hit_slots_buf.size() < static_cast<size_t>(H + 1)) hit_slots_buf.resize(H + 1);
  uint8_t* __restrict flag = flag_buf.data();
  int32_t* __restrict miss_j = miss_j_buf.data();
  int32_t* __restrict victims = victims_buf.data();
  int32_t* __restrict neworder = neworder_buf.data();
  int32_t* __restrict fills = fills_buf.data();
  int32_t* __restrict hit_slots = hit_slots_buf.data();

  for (int64_t b = 0; b < B; ++b) {
    const int64_t r = rows[b];
    if (r < 0 || r >= R) return 1;
    int32_t* __restrict tok = slot_token + r * H;
    int64_t* __restrict stamp = slot_stamp + r * H;
    int32_t* __restrict ord = order + r * H;
    Map map = make_map(r);
    const int64_t req = req_ids[b];
    const int32_t stab = stable_len[b];
    const int32_t* __restrict tk = topk + b * K;
    uint8_t* __restrict hm = hit_mask + b * K;
    int32_t* __restrict sl = slots + b * K;
    int32_t* __restrict mt = miss_tokens + b * K;
    int32_t* __restrict ms = miss_slots + b * K;
    uint8_t* __restrict fl = flag;
    int32_t* __restrict mj = miss_j;

    // 1. reset on a request change (idle rows too)
    if (req != row_req[r]) {
      map.clear(tok, H);
      std::fill(tok, tok + H, -1);
      std::fill(stamp, stamp + H, int64_t(0));
      for (int64_t s = 0; s < H; ++s) ord[s] = static_cast<int32_t>(s);
      maxpos[r] = -1;
      row_req[r] = req;
    }
    // 2. empty every slot holding a position >= stable_len (only if one may exist)
    if (maxpos[r] >= stab) {
      bool dropped = false;
      int32_t mx = -1;
      for (int64_t s = 0; s < H; ++s) {
        const int32_t t = tok[s];
        if (t < 0) continue;
        if (t >= stab) {
          if (!map.erase(t)) return 2;
          tok[s] = -1;
          stamp[s] = 0;
          dropped = true;
        } else if (t > mx) {
          mx = t;
        }
      }
      maxpos[r] = mx;
      if (dropped) {  // empties (stamp 0) first by slot, then the others in their order
        int64_t n = 0;
        for (int64_t s = 0; s < H; ++s)
          if (tok[s] < 0) neworder[n++] = static_cast<int32_t>(s);
        for (int64_t i = 0; i < H; ++i)
          if (tok[ord[i]] >= 0) neworder[n++] = ord[i];
        std::memcpy(ord, neworder, H * sizeof(int32_t));
      }
    }
    if (req == -1) {  // idle row: every entry is padding
      std::memset(hm, 0, K);
      std::fill(sl, sl + K, -1);
      std::fill(mt, mt + K, -1);
      std::fill(ms, ms + K, -1);
      miss_count[b] = 0;
      continue;
    }
    // 3. lookup. The row's slot_token (H int32) is read at random by the entry checks:
    // fetch all of its lines up front (a paired cold-cache microbenchmark: ~4 % faster).
    for (int64_t s2 = 0; s2 < H; s2 += 16) __builtin_prefetch(tok + s2);
    std::memset(flag, 0, H);
    int64_t m = 0, hits = 0;
    // The map and the row's slot_token are cold (one layer's state among many): a
    // two-stage software pipeline fetches slot_of[p] kAhead entries ahead and, once that
    // line has arrived, slot_token[slot_of[p]] kAhead2 entries ahead (the dependent load
    // of the entry check), so the loop below mostly hits L1.
    constexpr int64_t kAhead = 48, kAhead2 = 16;
    for (int64_t j = 0; j < std::min(K, kAhead); ++j)
      if (tk[j] >= 0) map.prefetch(tk[j]);
    for (int64_t j = 0; j < std::min(K, kAhead2); ++j)
      if (tk[j] >= 0) map.prefetch2(tk[j]);
    // Branch-free: whether an entry hits is data (about half of them), not control.
    for (int64_t j = 0; j < K; ++j) {
      if (j + kAhead < K && tk[j + kAhead] >= 0) map.prefetch(tk[j + kAhead]);
      if (j + kAhead2 < K && tk[j + kAhead2] >= 0) map.prefetch2(tk[j + kAhead2]);
      const int32_t p = tk[j];
      if (map_width >= 0 && p >= map_width) return 3;
      const int32_t found = (p >= 0 && p < stab) ? map.find(p) : -1;
      const bool hit = found >= 0;
      hm[j] = hit;
      sl[j] = found;  // -1 for padding and misses (a miss gets its victim below)
      fl[hit ? found : H] = 2;
      hits += hit;
      mj[m] = static_cast<int32_t>(j);
      m += (!hit) & (p >= 0);
    }
    // The order and stamp rows are read / written by steps 4-5 and the order rebuild:
    // fetch them while the victims are chosen.
    for (int64_t s2 = 0; s2 < H; s2 += 16) __builtin_prefetch(ord + s2);
    for (int64_t s2 = 0; s2 < H; s2 += 8) __builtin_prefetch(stamp + s2);
    // 4. victims: the first m non-hit slots of the eviction order
    int64_t v = 0, pos = 0;
    while (v < m) {
      const int32_t s = ord[pos++];
      if (flag[s] != 2) victims[v++] = s;
    }
    // 5. update: fills then hit stamps. Evicting a victim touches its old position's
    // map entry, a cold line: fetch those ahead too.
    int32_t mx = maxpos[r];
    if (!Map::kLazy)
      for (int64_t q = 0; q < std::min(m, kAhead); ++q)
        if (tok[victims[q]] >= 0) map.prefetch(tok[victims[q]]);
    for (int64_t q = 0; q < m; ++q) {
      if (!Map::kLazy && q + kAhead < m && tok[victims[q + kAhead]] >= 0) map.prefetch(tok[victims[q + kAhead]]);
      const int32_t s = victims[q];
      const int32_t j = miss_j[q];
      const int32_t p = tk[j];
      if (tok[s] >= 0 && !map.erase(tok[s])) return 2;
      tok[s] = p;
      map.insert(p, s);
      stamp[s] = fill_stamp;
      flag[s] = 1;
      sl[j] = s;
      mt[q] = p;
      ms[q] = s;
      if (p > mx) mx = p;
    }
    maxpos[r] = mx;
    miss_count[b] = static_cast<int32_t>(m);
    std::fill(mt + m, mt + K, -1);
    std::fill(ms + m, ms + K, -1);
    if (m == 0 && hits == 0) continue;
    // New order, in place: untouched slots in their order (compacted to the front: the
    // write index never passes the read index), then fills by slot, then hits by slot.
    // Branch-free stores: a slot is written at its cursor, which advances only if it belongs.
    int64_t n = 0;
    for (int64_t i = pos; i < H; ++i) {
      const int32_t s = ord[i];
      ord[n] = s;
      n += flag[s] == 0;
    }
    int64_t nf = 0, nh = 0;
    for (int64_t s = 0; s < H; ++s) {
      const uint8_t f = flag[s];
      fills[nf] = static_cast<int32_t>(s);
      nf += f == 1;
      hit_slots[nh] = static_cast<int32_t>(s);
      nh += f == 2;
    }
    std::memcpy(ord + n, fills, nf * sizeof(int32_t));
    std::memcpy(ord + n + nf, hit_slots, nh * sizeof(int32_t));
    for (int64_t i = 0; i < nh; ++i) stamp[hit_slots[i]] = hit_stamp;
  }
  return 0;
}
}  // namespace

extern "C" {

// Error codes: 0 ok, 1 a row index out of range, 2 the derived state disagrees with the
// contract's state (a slot's position missing from the map), 3 a position outside the
// dense map, 4 an int16 map with H > 32767. map_kind 0: dense map (hkeys = int32 slot_of [R, C], C = width), 1: hash map,
// 2: dense map with int16 slot_of (hkeys points at int16 [R, C]; needs H <= 32767).
int sao_lru_manage_rows(int32_t* slot_token, int64_t* slot_stamp, int64_t* row_req, int32_t* order,
                        int32_t* hkeys, int32_t* hvals, int32_t* maxpos, int64_t R, int64_t H, int64_t C,
                        const int64_t* rows, const int32_t* topk, const int64_t* req_ids,
                        const int32_t* stable_len, int64_t B, int64_t K, int64_t step, uint8_t* hit_mask,
                        int32_t* slots, int32_t* miss_count, int32_t* miss_tokens, int32_t* miss_slots,
                        int64_t map_kind) {
  if (map_kind == 2) {
    if (H > 32767) return 4;
    int16_t* so = reinterpret_cast<int16_t*>(hkeys);
    auto make = [so, slot_token, H, C](int64_t r) { return DenseMap<int16_t>{so + r * C, slot_token + r * H, C}; };
    return manage_rows<DenseMap<int16_t>>(make, slot_token, slot_stamp, row_req, order, maxpos, R, H, C, rows, topk,
                                          req_ids, stable_len, B, K, step, hit_mask, slots, miss_count, miss_tokens,
                                          miss_slots);
  }
  if (map_kind == 0) {
    auto make = [hkeys, slot_token, H, C](int64_t r) {
      return DenseMap<int32_t>{hkeys + r * C, slot_token + r * H, C};
    };
    return manage_rows<DenseMap<int32_t>>(make, slot_token, slot_stamp, row_req, order, maxpos, R, H, C, rows, topk,
                                 req_ids, stable_len, B, K, step, hit_mask, slots, miss_count, miss_tokens,
                                 miss_slots);
  }
  int log2c = 0;
  while ((int64_t(1) << log2c) < C) ++log2c;
  const int shift = 32 - log2c;
  auto make = [hkeys, hvals, C, shift](int64_t r) {
    return RowMap{hkeys + r * C, hvals + r * C, static_cast<uint32_t>(C - 1), shift};
  };
  return manage_rows<RowMap>(make, slot_token, slot_stamp, row_req, order, maxpos, R, H, -1, rows, topk,
                             req_ids, stable_len, B, K, step, hit_mask, slots, miss_count, miss_tokens,
                             miss_slots);
}

// hot[rows[b], miss_slots[b,i], :] = host[token_table[rows[b], miss_tokens[b,i]], :] for
// i < miss_count[b]; rows of row_bytes bytes. Error codes: 0 ok, 1 an index out of range.
int sao_copy_miss_rows(const uint8_t* host, int64_t host_rows, uint8_t* hot, int64_t hot_rows, int64_t H,
                       int64_t row_bytes, const int32_t* token_table, int64_t table_rows, int64_t table_stride,
                       const int64_t* rows, const int32_t* miss_tokens, const int32_t* miss_slots,
                       const int32_t* miss_count, int64_t B, int64_t K) {
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = miss_count[b];
    if (n == 0) continue;
    const int64_t r = rows[b];
    if (r < 0 || r >= hot_rows || r >= table_rows || n > K) return 1;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t p = miss_tokens[b * K + i];
      const int64_t s = miss_slots[b * K + i];
      if (p < 0 || p >= table_stride || s < 0 || s >= H) return 1;
      const int64_t src = token_table[r * table_stride + p];
      if (src < 0 || src >= host_rows) return 1;
      std::memcpy(hot + (r * H + s) * row_bytes, host + src * row_bytes, row_bytes);
    }
  }
  return 0;
}

}  // extern "C"
