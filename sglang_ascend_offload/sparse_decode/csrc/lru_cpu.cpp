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

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

// Phase timers for tuning (off by default): build with -DSAO_LRU_PROFILE and read them
// with sao_lru_profile(); they add a rdtsc per phase and row.
#ifdef SAO_LRU_PROFILE
#include <x86intrin.h>
static uint64_t g_prof[8];
#define SAO_PROF_START uint64_t prof_last_ = __rdtsc();
#define SAO_PROF(i)                    \
  do {                                 \
    const uint64_t n_ = __rdtsc();     \
    g_prof[i] += n_ - prof_last_;      \
    prof_last_ = n_;                   \
  } while (0)
#else
#define SAO_PROF_START
#define SAO_PROF(i) \
  do {              \
  } while (0)
#endif

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

// 0: scalar lookups everywhere; 1 (default): the AVX-512 lookup for the int16 dense map
// where the CPU has AVX-512 F/BW/VL (sao_lru_set_simd; the tests run both).
int g_simd = 1;

bool simd_lookup_available() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl");
  return ok;
}

// Step 3 (lookup) of one row for the int16 dense map, 16 entries a vector: the same
// outputs as the scalar loop (hm, sl, flag 2 at hit slots, mj = the miss entries'
// indices in order; returns the miss count, hits in *hits_out), or -1 when a position
// is >= width. Two passes: the first only gathers slot_of[p] of every entry into sbuf
// (its iterations are independent, so many of the row's cold map lines are in flight
// at once), the second checks them against slot_token. The row's other cold state is
// prefetched a few lines per iteration (slot_token in pass 1; order and stamps, used
// by steps 4-5, in pass 2): issuing all of a row's ~1000 lines in one burst, as the
// scalar path does, measured ~20 % slower in a paired cold-state microbenchmark. slot_of[p] is gathered as the 32-bit word at byte 2p - 2 (its high half;
// byte 0 and the low half for p == 0), so every read lies inside the row's map. mj
// needs K + 16 entries (a vector store past the misses), sbuf K + 16.
__attribute__((target("avx512f,avx512bw,avx512vl"))) int64_t lookup_dense16_avx512(
    const int32_t* __restrict tk, int64_t K, const int16_t* __restrict so, const int32_t* __restrict tok,
    int32_t stab, int64_t width, uint8_t* __restrict hm, int32_t* __restrict sl, uint8_t* __restrict fl,
    int32_t* __restrict mj, int32_t* __restrict sbuf, int64_t* hits_out, const int32_t* ord, const int64_t* stamp,
    int64_t H) {
  const __m512i zero = _mm512_setzero_si512(), neg1 = _mm512_set1_epi32(-1);
  const __m512i vstab = _mm512_set1_epi32(stab);
  const __m512i vwidth = _mm512_set1_epi32(static_cast<int32_t>(std::min<int64_t>(width, INT32_MAX)));
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m128i one8 = _mm_set1_epi8(1);
  SAO_PROF_START
  // pass 1: s = slot_of[p] for valid entries (-1 for the others)
  for (int64_t j = 0; j < K; j += 16) {
    // the row's slot_token lines (read at random by pass 2), a few per iteration
    for (int64_t x = j * H / K; x < std::min(H, (j + 16) * H / K); x += 16) __builtin_prefetch(tok + x);
    const __mmask16 lm = K - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (K - j)) - 1);
    const __m512i p = _mm512_mask_loadu_epi32(neg1, lm, tk + j);  // lanes past K: padding
    const __mmask16 nonneg = _mm512_cmpge_epi32_mask(p, zero);
    if (_mm512_mask_cmpge_epi32_mask(nonneg, p, vwidth)) return -1;
    const __mmask16 valid = _mm512_mask_cmplt_epi32_mask(nonneg, p, vstab);
    const __mmask16 at0 = _mm512_cmpeq_epi32_mask(p, zero);
    const __m512i off = _mm512_max_epi32(_mm512_sub_epi32(_mm512_add_epi32(p, p), _mm512_set1_epi32(2)), zero);
    const __m512i raw = _mm512_mask_i32gather_epi32(zero, valid, off, so, 1);
    const __m512i sv = _mm512_mask_blend_epi32(at0, _mm512_srai_epi32(raw, 16),
                                               _mm512_srai_epi32(_mm512_slli_epi32(raw, 16), 16));
    _mm512_storeu_si512(sbuf + j, _mm512_mask_blend_epi32(valid, neg1, sv));
  }
  SAO_PROF(5);
  // pass 2: hits, outputs, flags, miss indices
  int64_t m = 0, hits = 0;
  for (int64_t j = 0; j < K; j += 16) {
    // the order and stamp rows (steps 4-5 and the rebuild), a few lines per iteration
    for (int64_t x = j * H / K; x < std::min(H, (j + 16) * H / K); x += 16) __builtin_prefetch(ord + x);
    for (int64_t x = j * H / K; x < std::min(H, (j + 16) * H / K); x += 8) __builtin_prefetch(stamp + x);
    const __mmask16 lm = K - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (K - j)) - 1);
    const __m512i p = _mm512_mask_loadu_epi32(neg1, lm, tk + j);
    const __mmask16 nonneg = _mm512_cmpge_epi32_mask(p, zero);
    const __m512i s = _mm512_loadu_si512(sbuf + j);
    const __mmask16 held = _mm512_cmpge_epi32_mask(s, zero);
    const __m512i t = _mm512_mask_i32gather_epi32(neg1, held, s, tok, 4);
    const __mmask16 hit = _mm512_mask_cmpeq_epi32_mask(held, t, p);
    _mm512_mask_storeu_epi32(sl + j, lm, _mm512_mask_blend_epi32(hit, neg1, s));
    _mm_mask_storeu_epi8(hm + j, lm, _mm_maskz_mov_epi8(hit, one8));
    const __mmask16 miss = nonneg & static_cast<__mmask16>(~hit);
    _mm512_storeu_si512(mj + m, _mm512_maskz_compress_epi32(miss, _mm512_add_epi32(iota, _mm512_set1_epi32(
                                                                    static_cast<int32_t>(j)))));
    m += __builtin_popcount(miss);
    hits += __builtin_popcount(hit);
    for (unsigned h = hit; h; h &= h - 1) fl[sbuf[j + __builtin_ctz(h)]] = 2;
  }
  SAO_PROF(6);
  *hits_out = hits;
  return m;
}

// Step 4 (victims) with AVX-512: the first m slots s of ord with flag[s] != 2 into
// victims[0..m), 16 order entries a vector; returns the order index just past the m-th
// (the scalar loop's pos). Needs m <= H - (#hits) (always: hits + m <= K <= H), victims
// K + 16 entries, flag H + 4 bytes (a slot's flag is read as a 32-bit word).
__attribute__((target("avx512f,avx512bw,avx512vl,bmi2"))) int64_t victims_avx512(
    const int32_t* __restrict ord, const uint8_t* __restrict flag, int64_t H, int64_t m,
    int32_t* __restrict victims) {
  const __m512i lo8 = _mm512_set1_epi32(0xFF), two = _mm512_set1_epi32(2);
  int64_t v = 0, pos = 0;
  while (v < m) {
    const __mmask16 lm = H - pos >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (H - pos)) - 1);
    const __m512i sv = _mm512_maskz_loadu_epi32(lm, ord + pos);
    const __m512i f = _mm512_and_si512(_mm512_mask_i32gather_epi32(two, lm, sv, flag, 1), lo8);
    __mmask16 take = _mm512_mask_cmpneq_epi32_mask(lm, f, two);
    const int64_t need = m - v;
    const int c = __builtin_popcount(take);
    if (c >= need) {  // keep the first `need` of them
      take = static_cast<__mmask16>(_pdep_u32((1u << need) - 1, take));
      _mm512_mask_compressstoreu_epi32(victims + v, take, sv);
      return pos + 32 - __builtin_clz(static_cast<unsigned>(take));
    }
    _mm512_storeu_si512(victims + v, _mm512_maskz_compress_epi32(take, sv));
    v += c;
    pos += 16;
  }
  return pos;
}

// The order rebuild with AVX-512 (same result as the scalar loops): ord[pos..H) without
// the slots whose flag is set, compacted to the front, then the fills (flag 1) by
// slot, then the hits (flag 2) by slot; hit slots get hit_stamp. fills / hit_slots
// need H + 16 entries, flag H + 4 bytes.
__attribute__((target("avx512f,avx512bw,avx512vl"))) void rebuild_order_avx512(
    int32_t* __restrict ord, int64_t pos, int64_t H, const uint8_t* __restrict flag, int32_t* __restrict fills,
    int32_t* __restrict hit_slots, int64_t* __restrict stamp, int64_t hit_stamp) {
  const __m512i lo8 = _mm512_set1_epi32(0xFF), zero = _mm512_setzero_si512();
  const __m512i one = _mm512_set1_epi32(1), two = _mm512_set1_epi32(2);
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  int64_t n = 0;
  for (int64_t i = pos; i < H; i += 16) {  // in place: the write index never passes the read index
    const __mmask16 lm = H - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (H - i)) - 1);
    const __m512i sv = _mm512_maskz_loadu_epi32(lm, ord + i);
    const __m512i f = _mm512_and_si512(_mm512_mask_i32gather_epi32(one, lm, sv, flag, 1), lo8);
    const __mmask16 keep = _mm512_mask_cmpeq_epi32_mask(lm, f, zero);
    const int c = __builtin_popcount(keep);
    _mm512_mask_storeu_epi32(ord + n, static_cast<__mmask16>((1u << c) - 1), _mm512_maskz_compress_epi32(keep, sv));
    n += c;
  }
  int64_t nf = 0, nh = 0;
  const __m512i hs = _mm512_set1_epi64(hit_stamp);
  for (int64_t s0 = 0; s0 < H; s0 += 16) {
    const __mmask16 lm = H - s0 >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (H - s0)) - 1);
    const __m512i f = _mm512_maskz_cvtepu8_epi32(lm, _mm_maskz_loadu_epi8(lm, flag + s0));
    const __m512i sv = _mm512_add_epi32(iota, _mm512_set1_epi32(static_cast<int32_t>(s0)));
    const __mmask16 isf = _mm512_cmpeq_epi32_mask(f, one), ish = _mm512_cmpeq_epi32_mask(f, two);
    _mm512_storeu_si512(fills + nf, _mm512_maskz_compress_epi32(isf, sv));
    _mm512_storeu_si512(hit_slots + nh, _mm512_maskz_compress_epi32(ish, sv));
    nf += __builtin_popcount(isf);
    nh += __builtin_popcount(ish);
    _mm512_mask_storeu_epi64(stamp + s0, static_cast<__mmask8>(ish), hs);
    _mm512_mask_storeu_epi64(stamp + s0 + 8, static_cast<__mmask8>(ish >> 8), hs);
  }
  std::memcpy(ord + n, fills, nf * sizeof(int32_t));
  std::memcpy(ord + n + nf, hit_slots, nh * sizeof(int32_t));
}

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
  thread_local std::vector<uint8_t> flag_buf;  // [H+4]: H is the target of branch-free stores; 32-bit gathers
  thread_local std::vector<int32_t> miss_j_buf, victims_buf, neworder_buf, fills_buf, hit_slots_buf;
  if (flag_buf.size() < static_cast<size_t>(H + 4)) flag_buf.resize(H + 4);
  if (miss_j_buf.size() < static_cast<size_t>(K + 16)) miss_j_buf.resize(K + 16);
  if (victims_buf.size() < static_cast<size_t>(K + 16)) victims_buf.resize(K + 16);
  // neworder doubles as the AVX-512 lookup's slot buffer (K + 16 <= H + 16)
  if (neworder_buf.size() < static_cast<size_t>(H + 16)) neworder_buf.resize(H + 16);
  if (fills_buf.size() < static_cast<size_t>(H + 16)) fills_buf.resize(H + 16);
  if (hit_slots_buf.size() < static_cast<size_t>(H + 16)) hit_slots_buf.resize(H + 16);
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
    SAO_PROF_START

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
    SAO_PROF(0);
    // 3. lookup: the AVX-512 loops for the int16 dense map where the CPU has them,
    // else the scalar loop.
    std::memset(flag, 0, H);
    int64_t m = 0, hits = 0;
    constexpr int64_t kAhead = 48, kAhead2 = 16;
    bool looked_up = false;
    if constexpr (std::is_same<Map, DenseMap<int16_t>>::value) {
      if (g_simd && simd_lookup_available()) {
        m = lookup_dense16_avx512(tk, K, map.so, tok, stab, map.width, hm, sl, fl, mj, neworder, &hits, ord, stamp, H);
        if (m < 0) return 3;
        looked_up = true;
      }
    }
    if (!looked_up) {
      // The row's slot_token (H int32) is read at random by the entry checks: fetch all
      // of its lines up front (a paired cold-cache microbenchmark: ~4 % faster).
      for (int64_t s2 = 0; s2 < H; s2 += 16) __builtin_prefetch(tok + s2);
      // The map and the row's slot_token are cold (one layer's state among many): a
      // two-stage software pipeline fetches slot_of[p] kAhead entries ahead and, once that
      // line has arrived, slot_token[slot_of[p]] kAhead2 entries ahead (the dependent load
      // of the entry check), so the loop below mostly hits L1.
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
        const bool valid = (p >= 0) & (p < stab);
        const int32_t found = valid ? map.find(p) : -1;
        const bool hit = found >= 0;
        hm[j] = hit;
        sl[j] = found;  // -1 for padding and misses (a miss gets its victim below)
        fl[hit ? found : H] = 2;
        hits += hit;
        mj[m] = static_cast<int32_t>(j);
        m += (!hit) & (p >= 0);
      }
    }
    SAO_PROF(1);
    // The order and stamp rows are read / written by steps 4-5 and the order rebuild:
    // fetch them while the victims are chosen.
    if (!looked_up) {  // (the AVX-512 lookup fetched them, spread over its passes)
      for (int64_t s2 = 0; s2 < H; s2 += 16) __builtin_prefetch(ord + s2);
      for (int64_t s2 = 0; s2 < H; s2 += 8) __builtin_prefetch(stamp + s2);
    }
    // 4. victims: the first m non-hit slots of the eviction order
    const bool simd = g_simd && simd_lookup_available();
    int64_t pos = 0;
    if (simd) {
      pos = victims_avx512(ord, flag, H, m, victims);
    } else {
      int64_t v = 0;
      while (v < m) {
        const int32_t s = ord[pos++];
        if (flag[s] != 2) victims[v++] = s;
      }
    }
    SAO_PROF(2);
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
    SAO_PROF(3);
    if (m == 0 && hits == 0) continue;
    // New order, in place: untouched slots in their order (compacted to the front: the
    // write index never passes the read index), then fills by slot, then hits by slot.
    // Branch-free stores: a slot is written at its cursor, which advances only if it belongs.
    if (simd) {
      rebuild_order_avx512(ord, pos, H, flag, fills, hit_slots, stamp, hit_stamp);
      SAO_PROF(4);
      continue;
    }
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
    SAO_PROF(4);
  }
  return 0;
}
}  // namespace

extern "C" {

// Lookup implementation: 1 (default) the AVX-512 lookup for the int16 dense map where
// the CPU supports it, 0 the scalar loop everywhere. Returns whether the AVX-512 lookup
// is available on this CPU.
int sao_lru_set_simd(int on) {
  g_simd = on;
  return simd_lookup_available() ? 1 : 0;
}

// Phase cycle counters (rdtsc) of a -DSAO_LRU_PROFILE build: 0 reset / invalidation,
// 1 lookup, 2 victims, 3 fills, 4 order rebuild and stamps; within 1, the AVX-512
// lookup's 5 gather pass and 6 check pass. Copies them to out[0..7]
// and clears them; returns 0, or 1 when the build has no timers.
int sao_lru_profile(uint64_t* out) {
#ifdef SAO_LRU_PROFILE
  for (int i = 0; i < 8; ++i) {
    out[i] = g_prof[i];
    g_prof[i] = 0;
  }
  return 0;
#else
  (void)out;
  return 1;
#endif
}

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
