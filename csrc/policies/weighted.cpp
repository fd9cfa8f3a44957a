// HOBBIT's sequence-level multidimensional priority (eq. 3), and its four parts alone:
//
//   p = w_lru R/T + w_lfu F/T + w_lhu H/T + w_fld (1 - d/l_n)
//
// R: tick of the expert's last use in this sequence, T: ticks of this sequence (so R/T is 1 for the
// expert just used); F, H: forward passes of this sequence that used the expert / used its high-
// precision version, over the passes so far; d = (l_expert - l_current + l_n) % l_n: how many layers
// until the expert's layer runs again, so the layer that just ran is the farthest. The lowest
// priority among unpinned slots is evicted; ties go to the least recently used, then the lowest slot.
// Records are per expert (they survive eviction); F and H reset at each new sequence, and R counts
// from the sequence's start.

#include "policies.h"

#include <algorithm>
#include <limits>

namespace {

struct moetier_policy_weighted : moetier_policy_i {
    // per expert, not per slot: an expert evicted and read again keeps its sequence's counts
    struct record {
        uint64_t last_use  = 0;  // tick of the last use, 0 = never
        uint64_t last_pass = 0;  // forward pass of the last counted use
        uint32_t freq      = 0;  // passes of this sequence that used the expert
        uint32_t hfreq     = 0;  // ... that used its high-precision version
    };

    moetier_policy_weights w;

    std::vector<moetier_key>         key;      // [n_slots]
    std::vector<std::vector<record>> records;  // [layer][expert], grown on first use

    explicit moetier_policy_weighted(const moetier_policy_weights & w_) : w(w_) {}

    void init(int32_t n_slots) override { key.assign(n_slots, moetier_key{}); }

    record & rec(const moetier_key & k) {
        if ((size_t) k.layer >= records.size()) {
            records.resize(k.layer + 1);
        }
        auto & l = records[k.layer];
        if ((size_t) k.expert >= l.size()) {
            l.resize(k.expert + 1);
        }
        return l[k.expert];
    }

    const record & rec(const moetier_key & k) const { return records[k.layer][k.expert]; }

    void use(int32_t s, const moetier_key & k, bool high, const moetier_policy_ctx & ctx) {
        key[s]     = k;
        record & r = rec(k);
        r.last_use = ctx.tick;
        // count a use once per forward pass
        if (r.last_pass != ctx.pass) {
            r.last_pass = ctx.pass;
            ++r.freq;
            r.hfreq += high ? 1 : 0;
        }
    }

    void on_hit(int32_t s, const moetier_key & k, bool high, const moetier_policy_ctx & ctx) override {
        use(s, k, high, ctx);
    }

    void on_load(int32_t s, const moetier_key & k, bool high, const moetier_policy_ctx & ctx) override {
        use(s, k, high, ctx);
    }

    double priority(const record & r, const moetier_key & k, const moetier_policy_ctx & ctx) const {
        const double  T     = (double) (ctx.tick > ctx.seq_tick ? ctx.tick - ctx.seq_tick : 1);
        const double  R     = r.last_use > ctx.seq_tick ? (double) (r.last_use - ctx.seq_tick) : 0.0;
        const double  steps = (double) (ctx.steps > 0 ? ctx.steps : 1);
        const int32_t ln    = ctx.n_layers > 0 ? ctx.n_layers : 1;
        const int32_t d     = ((k.layer - ctx.layer) % ln + ln) % ln;
        return w.lru * (R / T) + w.lfu * (r.freq / steps) + w.lhu * (r.hfreq / steps) + w.fld * (1.0 - (double) d / ln);
    }

    int32_t victim(const std::vector<uint8_t> & excluded, const moetier_policy_ctx & ctx) override {
        int32_t  best   = -1;
        double   best_p = std::numeric_limits<double>::infinity();
        uint64_t best_t = 0;
        for (int32_t s = 0; s < (int32_t) key.size(); ++s) {
            if (excluded[s]) {
                continue;
            }
            const record & r = rec(key[s]);
            const double   p = priority(r, key[s], ctx);
            if (best < 0 || p < best_p || (p == best_p && r.last_use < best_t)) {
                best   = s;
                best_p = p;
                best_t = r.last_use;
            }
        }
        return best;
    }

    void reset_sequence(const moetier_policy_ctx & /*ctx*/) override {
        for (auto & l : records) {
            for (auto & r : l) {
                r.freq  = 0;
                r.hfreq = 0;
            }
        }
    }

    bool across_layers() const override { return w.fld > 0.0f; }
};

}  // namespace

moetier_policy_ptr moetier_policy_weighted_create(const moetier_policy_weights & weights) {
    return std::make_unique<moetier_policy_weighted>(weights);
}
