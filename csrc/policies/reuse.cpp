// Expected reuse distance: evict the expert whose next use is expected farthest away, Belady's rule
// with the future replaced by an estimate. A forward pass visits the layers in order, so an expert of
// a layer d layers ahead is wanted at the earliest in d resolves, and then only if its layer selects
// it; if each pass selects it with probability p, independently, its next use is expected after
//
//   d + n_layers (1 - p) / p   resolves,
//
// with d = n_layers for the layer just resolved (this pass is done with it). p is the expert's use
// count decayed with a half-life of H forward passes, over the passes seen so decayed (plus half a
// use and one pass: an expert seen once is not certain). Layer distance (HOBBIT's FLD) and frequency
// (LFU) in one unit, time, instead of a weighted sum of unlike scores: a rarely used expert of the
// next layer goes before a popular one of the layer that just ran. Counts are per expert and survive
// eviction and new sequences (what a layer selects is the model's habit more than the text's).

#include "policies.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace {

struct moetier_policy_reuse : moetier_policy_i {
    struct record {
        double   count      = 0.0;  // decayed uses, as of pass count_pass
        uint64_t count_pass = 0;
        uint64_t last_use   = 0;    // tick
    };

    const double                   half_life;  // forward passes
    std::vector<moetier_key>       key;        // [n_slots]
    moetier_expert_records<record> records;

    explicit moetier_policy_reuse(double h) : half_life(h) {}

    void init(int32_t n_slots) override { key.assign(n_slots, moetier_key{}); }

    double decay(uint64_t passes) const { return std::exp2(-(double) passes / half_life); }

    void use(int32_t s, const moetier_key & k, const moetier_policy_ctx & ctx) {
        key[s]     = k;
        record & r = records[k];
        if (r.last_use == 0 || r.count_pass != ctx.pass) {  // one use per forward pass
            r.count      = r.count * decay(ctx.pass - r.count_pass) + 1.0;
            r.count_pass = ctx.pass;
        }
        r.last_use = ctx.tick;
    }

    void on_hit(int32_t s, const moetier_key & k, bool /*high*/, const moetier_policy_ctx & ctx) override {
        use(s, k, ctx);
    }

    void on_load(int32_t s, const moetier_key & k, bool /*high*/, const moetier_policy_ctx & ctx) override {
        use(s, k, ctx);
    }

    int32_t victim(const std::vector<uint8_t> & excluded, const moetier_policy_ctx & ctx) override {
        const int32_t ln     = ctx.n_layers > 0 ? ctx.n_layers : 1;
        // the passes seen so far, decayed as the counts are: sum over i < pass of 2^(-i / H)
        const double  n      = (1.0 - decay(ctx.pass)) / (1.0 - decay(1));
        int32_t       best   = -1;
        double        best_v = -1.0;
        uint64_t      best_t = 0;
        for (int32_t s = 0; s < (int32_t) key.size(); ++s) {
            if (excluded[s]) {
                continue;
            }
            if (key[s].layer < 0) {
                return s;  // an empty slot
            }
            const record & r = records[key[s]];
            const double   p = (r.count * decay(ctx.pass - r.count_pass) + 0.5) / (n + 1.0);
            const int32_t  d = ((key[s].layer - ctx.layer) % ln + ln) % ln;
            const double   v = (d == 0 ? ln : d) + ln * (1.0 - std::min(p, 1.0)) / p;
            if (best < 0 || v > best_v || (v == best_v && r.last_use < best_t)) {
                best   = s;
                best_v = v;
                best_t = r.last_use;
            }
        }
        return best;
    }

    void reset_sequence(const moetier_policy_ctx & /*ctx*/) override {}

    bool across_layers() const override { return true; }
};

}  // namespace

moetier_policy_ptr moetier_policy_reuse_create(double half_life) {
    return std::make_unique<moetier_policy_reuse>(half_life > 0.0 ? half_life : 64.0);
}
