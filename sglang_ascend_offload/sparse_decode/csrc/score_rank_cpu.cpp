// CPU kernel of the score-aware residency policies `score_rank` and `score_rank_guarded`
// (sparse_decode/policies.py: ScoreRankManager, ScoreGuardedManager), rows form.
//
// The torch managers are the specification; tests/sparse_decode/test_score_rank_kernel.py
// compares this kernel with them bit for bit (state and outputs). No torch headers: plain
// C ABI, called through ctypes by sparse_decode/score_kernel.py.
//
// Per batch entry b (state row r = rows[b]), exactly the contract's mechanism:
//   1. reset the row when req_ids[b] != row_req[r] (idle rows too);
//   2. empty every slot whose position is >= stable_len[b];
//   3. top-k entry j is a hit when it is valid (!= -1, row not idle), < stable_len and held;
//   4. victims among the non-hit slots: positions outside the ranking's first D (and empty
//      slots) first, by (stamp, slot); then the ranked ones, lowest rank first (ranks are
//      distinct: one position per rank, one slot per position);
//      the i-th miss in top-k order takes the i-th victim;
//   5. fills get stamp 2*step+1, hits 2*step+2.
// The guarded policy also steps a ghost exact-LRU table on the same inputs and lets at most
// `allowance` victims be positions the ghost holds (GuardedManager's construction): the base
// order is partitioned stably into (allowed, protected over the allowance), hits never.
//
// The state has no derived part: the position -> slot map is rebuilt per row in a per-thread
// dense scratch array that is never cleared (an entry counts only if the slot it names
// still holds the position: slot_token validates it), or, for positions beyond
// kDenseLimit, in a per-row hash table.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kDenseLimit = int64_t(1) << 24;  // positions per dense scratch map (64 MiB int32)

// Position -> slot map of one row, validated against the row's slot_token. Dense maps
// hold int16 slots while H <= 32767 (half the cache lines of the random accesses).
struct PosMap {
  std::vector<int16_t> dense16;  // [size], never cleared (validated), grown with -1
  std::vector<int32_t> dense32;
  std::vector<int32_t> hkeys, hvals;
  int mode = 0;  // 0 dense int16, 1 dense int32, 2 hash
  uint32_t mask = 0;
  const int32_t* tok = nullptr;
  int64_t H = 0;

  // Prepare for a row whose held and looked-up positions are all < bound.
  void start(const int32_t* row_tok, int64_t h, int64_t bound) {
    tok = row_tok;
    H = h;
    if (bound <= kDenseLimit) {
      mode = h <= 32767 ? 0 : 1;
      if (mode == 0 && static_cast<int64_t>(dense16.size()) < bound) dense16.resize(static_cast<size_t>(bound), -1);
      if (mode == 1 && static_cast<int64_t>(dense32.size()) < bound) dense32.resize(static_cast<size_t>(bound), -1);
      return;
    }
    mode = 2;
    uint32_t cap = 2;
    while (cap < 4 * h) cap *= 2;
    hkeys.assign(cap, -1);
    hvals.resize(cap);
    mask = cap - 1;
  }
  static inline uint32_t hash(int32_t p) { return static_cast<uint32_t>(p) * 2654435761u; }
  // p >= 0 and < bound
  inline void prefetch(int32_t p) const {
    if (mode == 0)
      __builtin_prefetch(dense16.data() + p);
    else if (mode == 1)
      __builtin_prefetch(dense32.data() + p);
  }
  // p >= 0 and < bound
  inline void put(int32_t p, int32_t s) {
    if (mode == 0) {
      dense16[p] = static_cast<int16_t>(s);
      return;
    }
    if (mode == 1) {
      dense32[p] = s;
      return;
    }
    uint32_t i = hash(p) & mask;
    while (hkeys[i] != -1 && hkeys[i] != p) i = (i + 1) & mask;
    hkeys[i] = p;
    hvals[i] = s;
  }
  // slot holding p (p >= 0 and < bound), -1 if none
  inline int32_t find(int32_t p) const {
    int32_t s;
    if (mode == 0) {
      s = dense16[p];
    } else if (mode == 1) {
      s = dense32[p];
    } else {
      uint32_t i = hash(p) & mask;
      while (hkeys[i] != -1 && hkeys[i] != p) i = (i + 1) & mask;
      if (hkeys[i] == -1) return -1;
      s = hvals[i];
    }
    return (s >= 0 && s < H && tok[s] == p) ? s : -1;
  }
};

constexpr int64_t kAhead = 16;  // prefetch distance of the map's random accesses

// Fill the map with the row's held positions (all < bound).
inline void build_map(PosMap& m, const int32_t* tok, int64_t H) {
  for (int64_t s = 0; s < H; ++s) {
    if (s + kAhead < H && tok[s + kAhead] >= 0) m.prefetch(tok[s + kAhead]);
    if (tok[s] >= 0) m.put(tok[s], static_cast<int32_t>(s));
  }
}

struct Scratch {
  PosMap own, ghost;
  std::vector<uint8_t> hit, ghost_sel, prot;
  std::vector<int32_t> rank, slot_at, miss_j, victims, deferred, order_u, ghost_miss_j, ghost_victims;
  std::vector<uint64_t> keys;
  void size(int64_t H, int64_t K, int64_t D) {
    hit.resize(H);
    ghost_sel.resize(H);
    prot.resize(H);
    rank.resize(H);
    slot_at.resize(D);
    miss_j.resize(K);
    victims.resize(H);
    deferred.resize(H);
    order_u.resize(H);
    ghost_miss_j.resize(K);
    ghost_victims.resize(K);
    keys.resize(H);
  }
};

// Contract steps 1-2 on one row, in place.
inline void reset_and_drop(int32_t* tok, int64_t* stamp, int64_t* row_req_r, int64_t req, int32_t stab, int64_t H) {
  if (req != *row_req_r) {
    std::fill(tok, tok + H, -1);
    std::fill(stamp, stamp + H, int64_t(0));
    *row_req_r = req;
  }
  for (int64_t s = 0; s < H; ++s) {
    if (tok[s] >= stab) {
      tok[s] = -1;
      stamp[s] = 0;
    }
  }
}

// The smallest `want` of the (stamp, slot) keys of slots listed in keys[0..n) (packed as
// stamp * H + slot; stamps < 2^32), sorted ascending, written as slots to out.
inline void smallest_by_recency(uint64_t* keys, int64_t n, int64_t want, int64_t H, int32_t* out) {
  if (want <= 0 || n == 0) return;
  if (want < n) {
    std::nth_element(keys, keys + want, keys + n);
    std::sort(keys, keys + want);
  } else {
    std::sort(keys, keys + n);
    want = n;
  }
  for (int64_t i = 0; i < want; ++i) out[i] = static_cast<int32_t>(keys[i] % static_cast<uint64_t>(H));
}

// One exact-LRU step of the ghost row (residency_manage). Marks ghost_sel (hits and fills)
// and returns its miss count.
int32_t ghost_lru_row(Scratch& sc, int32_t* gtok, int64_t* gstamp, int64_t* greq_r, const int32_t* tk, int64_t req,
                      int32_t stab, int64_t H, int64_t K, int64_t fill_stamp, int64_t hit_stamp) {
  reset_and_drop(gtok, gstamp, greq_r, req, stab, H);
  PosMap& gm = sc.ghost;
  gm.start(gtok, H, stab);
  build_map(gm, gtok, H);
  uint8_t* sel = sc.ghost_sel.data();
  std::fill(sel, sel + H, uint8_t(0));
  int32_t nmiss = 0;
  for (int64_t j = 0; j < K; ++j) {
    if (j + kAhead < K && tk[j + kAhead] >= 0 && tk[j + kAhead] < stab) gm.prefetch(tk[j + kAhead]);
    const int32_t p = tk[j];
    if (p == -1 || req == -1) continue;
    const int32_t s = (p >= 0 && p < stab) ? gm.find(p) : -1;
    if (s >= 0) {
      sel[s] = 1;
      gstamp[s] = hit_stamp;  // hits are never victims: stamping now changes no victim order
    } else {
      sc.ghost_miss_j[nmiss++] = static_cast<int32_t>(j);
    }
  }
  if (nmiss == 0) return 0;
  // hits were restamped above; the victims are the non-hit slots, whose stamps are untouched
  int64_t n = 0;
  uint64_t* keys = sc.keys.data();
  for (int64_t s = 0; s < H; ++s)
    if (!sel[s]) keys[n++] = static_cast<uint64_t>(gstamp[s]) * static_cast<uint64_t>(H) + static_cast<uint64_t>(s);
  smallest_by_recency(keys, n, nmiss, H, sc.ghost_victims.data());
  for (int32_t i = 0; i < nmiss; ++i) {
    const int32_t v = sc.ghost_victims[i];
    const int32_t p = tk[sc.ghost_miss_j[i]];
    gtok[v] = p;
    gstamp[v] = fill_stamp;
    sel[v] = 1;
    if (p >= 0 && p < stab) gm.put(p, v);  // keep the map current: L' is looked up below
  }
  return nmiss;
}

int manage_rows(int32_t* slot_token, int64_t* slot_stamp, int64_t* row_req, int64_t R, int64_t H,
                const int64_t* rows, const int32_t* topk, const int64_t* req_ids, const int32_t* stable_len,
                const int32_t* ranked, int64_t B, int64_t K, int64_t D, int64_t step, uint8_t* hit_mask,
                int32_t* slots, int32_t* miss_count, int32_t* miss_tokens, int32_t* miss_slots, int32_t* g_tok,
                int64_t* g_stamp, int64_t* g_req, int64_t* g_misses, int64_t* o_misses, int64_t seed,
                int64_t slack_shift) {
  const bool guarded = g_tok != nullptr;
  const int64_t fill_stamp = 2 * step + 1;
  const int64_t hit_stamp = 2 * step + 2;
  thread_local Scratch sc;
  sc.size(H, K, D);
  for (int64_t b = 0; b < B; ++b) {
    if (rows[b] < 0 || rows[b] >= R) return 1;
  }
  for (int64_t b = 0; b < B; ++b) {
    const int64_t r = rows[b];
    int32_t* tok = slot_token + r * H;
    int64_t* stamp = slot_stamp + r * H;
    const int64_t req = req_ids[b];
    const int32_t stab = stable_len[b];
    const int32_t* tk = topk + b * K;
    const int32_t* rk = ranked + b * D;
    uint8_t* hm = hit_mask + b * K;
    int32_t* sl = slots + b * K;
    int32_t* mt = miss_tokens + b * K;
    int32_t* ms = miss_slots + b * K;

    const bool was_reset = req != row_req[r];
    reset_and_drop(tok, stamp, row_req + r, req, stab, H);
    PosMap& om = sc.own;
    om.start(tok, H, stab);
    build_map(om, tok, H);

    int64_t m_l = 0, allowance = 0;
    if (guarded) {
      if (was_reset) g_misses[r] = o_misses[r] = 0;
      const int32_t gm = ghost_lru_row(sc, g_tok + r * H, g_stamp + r * H, g_req + r, tk, req, stab, H, K,
                                       fill_stamp, hit_stamp);
      m_l = g_misses[r] + gm;
    }

    // 3. lookup
    uint8_t* hit = sc.hit.data();
    std::fill(hit, hit + H, uint8_t(0));
    int32_t nmiss = 0;
    for (int64_t j = 0; j < K; ++j) {
      if (j + kAhead < K && tk[j + kAhead] >= 0 && tk[j + kAhead] < stab) om.prefetch(tk[j + kAhead]);
      const int32_t p = tk[j];
      hm[j] = 0;
      sl[j] = -1;
      mt[j] = -1;
      ms[j] = -1;
      if (p == -1 || req == -1) continue;
      const int32_t s = (p >= 0 && p < stab) ? om.find(p) : -1;
      if (s >= 0) {
        hm[j] = 1;
        sl[j] = s;
        hit[s] = 1;
      } else {
        sc.miss_j[nmiss++] = static_cast<int32_t>(j);
      }
    }
    miss_count[b] = nmiss;

    int64_t m_c = 0;
    if (guarded) {
      m_c = o_misses[r] + nmiss;
      int64_t slack = seed + (slack_shift >= 0 ? (m_l >> slack_shift) : 0);
      // |(L' \ S) \ C|: ghost positions not selected this step that we do not hold
      const int32_t* gt = g_tok + r * H;
      int64_t ghost_missing = 0;
      for (int64_t s = 0; s < H; ++s) {
        const int32_t p = gt[s];
        if (p < 0 || sc.ghost_sel[s]) continue;
        if (!(p < stab && om.find(p) >= 0)) ++ghost_missing;
      }
      allowance = (m_l - m_c + slack) - ghost_missing;
      g_misses[r] = m_l;
      o_misses[r] = m_c;
    }
    if (nmiss == 0) {
      for (int64_t j = 0; j < K; ++j)
        if (hm[j]) stamp[sl[j]] = hit_stamp;
      continue;
    }

    // ranks of held positions (D = unranked)
    int32_t* rank = sc.rank.data();
    int32_t* slot_at = sc.slot_at.data();
    std::fill(rank, rank + H, static_cast<int32_t>(D));
    for (int64_t j = 0; j < D; ++j) {
      if (j + kAhead < D && rk[j + kAhead] >= 0 && rk[j + kAhead] < stab) om.prefetch(rk[j + kAhead]);
      const int32_t p = rk[j];
      const int32_t s = (p >= 0 && p < stab) ? om.find(p) : -1;
      slot_at[j] = s;
      if (s >= 0) rank[s] = static_cast<int32_t>(j);
    }

    // 4. victims: unranked non-hit slots by (stamp, slot), then ranked non-hit by rank descending
    int32_t* victims = sc.victims.data();
    int64_t nv = 0;
    uint64_t* keys = sc.keys.data();
    int64_t nu = 0;
    for (int64_t s = 0; s < H; ++s)
      if (!hit[s] && rank[s] == D)
        keys[nu++] = static_cast<uint64_t>(stamp[s]) * static_cast<uint64_t>(H) + static_cast<uint64_t>(s);
    if (!guarded) {
      const int64_t take = std::min<int64_t>(nu, nmiss);
      smallest_by_recency(keys, nu, take, H, victims);
      nv = take;
      for (int64_t j = D - 1; j >= 0 && nv < nmiss; --j) {
        const int32_t s = slot_at[j];
        if (s >= 0 && rank[s] == j && !hit[s]) victims[nv++] = s;
      }
    } else {
      // base order walked lazily; a protected slot (held by L', not hit) beyond the
      // allowance is deferred after every allowed one
      uint8_t* prot = sc.prot.data();
      for (int64_t s = 0; s < H; ++s) {
        const int32_t p = tok[s];
        // L' never holds a position >= stable_len that we hold: we hold none
        prot[s] = (p >= 0 && p < stab && !hit[s] && sc.ghost.find(p) >= 0) ? 1 : 0;
      }
      int32_t* base_u = sc.order_u.data();
      smallest_by_recency(keys, nu, nu, H, base_u);  // every unranked one, in order
      int32_t* deferred = sc.deferred.data();
      int64_t nd = 0, cum = 0;
      auto visit = [&](int32_t s) {
        if (prot[s]) {
          ++cum;
          if (cum > allowance) {
            deferred[nd++] = s;
            return;
          }
        }
        victims[nv++] = s;
      };
      for (int64_t i = 0; i < nu && nv < nmiss; ++i) visit(base_u[i]);
      for (int64_t j = D - 1; j >= 0 && nv < nmiss; --j) {
        const int32_t s = slot_at[j];
        if (s >= 0 && rank[s] == j && !hit[s]) visit(s);
      }
      for (int64_t i = 0; i < nd && nv < nmiss; ++i) victims[nv++] = deferred[i];
    }
    if (nv < nmiss) return 2;  // cannot happen with H >= K (checked by the caller)

    // 5. assign: the i-th miss takes the i-th victim
    for (int32_t i = 0; i < nmiss; ++i) {
      const int32_t j = sc.miss_j[i];
      const int32_t v = victims[i];
      tok[v] = tk[j];
      stamp[v] = fill_stamp;
      sl[j] = v;
      mt[i] = tk[j];
      ms[i] = v;
    }
    for (int64_t j = 0; j < K; ++j)
      if (hm[j]) stamp[sl[j]] = hit_stamp;
  }
  return 0;
}

}  // namespace

extern "C" {

// Error codes: 0 ok, 1 a row index out of range, 2 fewer evictable slots than misses
// (H < K). g_tok == nullptr: score_rank; else score_rank_guarded with the ghost LRU table
// (g_tok int32 [R,H], g_stamp int64 [R,H], g_req int64 [R]) and the miss counters
// (g_misses, o_misses int64 [R]); slack_shift < 0 = no proportional slack.
int sao_score_rank_rows(int32_t* slot_token, int64_t* slot_stamp, int64_t* row_req, int64_t R, int64_t H,
                        const int64_t* rows, const int32_t* topk, const int64_t* req_ids,
                        const int32_t* stable_len, const int32_t* ranked, int64_t B, int64_t K, int64_t D,
                        int64_t step, uint8_t* hit_mask, int32_t* slots, int32_t* miss_count,
                        int32_t* miss_tokens, int32_t* miss_slots, int32_t* g_tok, int64_t* g_stamp,
                        int64_t* g_req, int64_t* g_misses, int64_t* o_misses, int64_t seed, int64_t slack_shift) {
  return manage_rows(slot_token, slot_stamp, row_req, R, H, rows, topk, req_ids, stable_len, ranked, B, K, D, step,
                     hit_mask, slots, miss_count, miss_tokens, miss_slots, g_tok, g_stamp, g_req, g_misses,
                     o_misses, seed, slack_shift);
}

}  // extern "C"
