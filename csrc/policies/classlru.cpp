// ClassLRU, after upstream llama.cpp's GPU expert cache (commit c4fb579, known to us from a
// description of the file: a use count decayed with a 128-token half-life, 8 frequency classes, the
// victim the slot with the largest age / 2^class). Tokens are forward passes here (one per decoded
// token), ages are ticks (layer resolves), and the counts are per expert, so an expert read again
// keeps its history. Inside the cache's per-layer partition, as every policy without layer distances.

#include "policies.h"

#include <algorithm>
#include <cmath>

namespace {

constexpr double  MOETIER_CLASSLRU_HALF_LIFE = 128.0;  // forward passes
constexpr int32_t MOETIER_CLASSLRU_CLASSES   = 8;

struct moetier_policy_classlru : moetier_policy_i {
    struct record {
        double   count      = 0.0;  // decayed uses, as of pass count_pass
        uint64_t count_pass = 0;
        uint64_t last_use   = 0;    // tick
    };

    std::vector<moetier_key>       key;  // [n_slots]
    moetier_expert_records<record> records;

    void init(int32_t n_slots) override { key.assign(n_slots, moetier_key{}); }

    record & rec(const moetier_key & k) { return records[k]; }

    static double decayed(const record & r, uint64_t pass) {
        return r.count * std::exp2(-(double) (pass - r.count_pass) / MOETIER_CLASSLRU_HALF_LIFE);
    }

    void use(int32_t s, const moetier_key & k, const moetier_policy_ctx & ctx) {
        key[s]     = k;
        record & r = rec(k);
        if (r.last_use == 0 || r.count_pass != ctx.pass) {  // one use per forward pass
            r.count      = decayed(r, ctx.pass) + 1.0;
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
        int32_t best   = -1;
        double  best_v = -1.0;
        for (int32_t s = 0; s < (int32_t) key.size(); ++s) {
            if (excluded[s]) {
                continue;
            }
            if (key[s].layer < 0) {
                return s;  // never filled (the cache hands those out before asking): nothing to keep
            }
            const record & r = rec(key[s]);
            const double   c = decayed(r, ctx.pass);
            const int32_t  cls =
                c < 1.0 ? 0 : std::min(MOETIER_CLASSLRU_CLASSES - 1, (int32_t) std::floor(std::log2(c)));
            const double v = (double) (ctx.tick - r.last_use) / (double) (1 << cls);
            if (v > best_v) {
                best   = s;
                best_v = v;
            }
        }
        return best;
    }

    // the counts decay instead of resetting
    void reset_sequence(const moetier_policy_ctx & /*ctx*/) override {}
};

}  // namespace

moetier_policy_ptr moetier_policy_classlru_create() {
    return std::make_unique<moetier_policy_classlru>();
}
