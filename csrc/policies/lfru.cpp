// LFRU, a frequency-weighted LRU as the field's expert caches use it (vLLM #37190's tinyserve
// cache): an expert's priority is its uses (forward passes that used it, over the whole run) over
// one plus the passes since its last use; the lowest is evicted, ties to the least recently used.
// Inside the cache's per-layer partition.

#include "policies.h"

namespace {

struct moetier_policy_lfru : moetier_policy_i {
    struct record {
        uint64_t uses      = 0;
        uint64_t last_pass = 0;
        uint64_t last_use  = 0;  // tick
    };

    std::vector<moetier_key>       key;  // [n_slots]
    moetier_expert_records<record> records;

    void init(int32_t n_slots) override { key.assign(n_slots, moetier_key{}); }

    record & rec(const moetier_key & k) { return records[k]; }

    void use(int32_t s, const moetier_key & k, const moetier_policy_ctx & ctx) {
        key[s]     = k;
        record & r = rec(k);
        if (r.uses == 0 || r.last_pass != ctx.pass) {
            ++r.uses;
            r.last_pass = ctx.pass;
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
        int32_t  best   = -1;
        double   best_p = 0.0;
        uint64_t best_t = 0;
        for (int32_t s = 0; s < (int32_t) key.size(); ++s) {
            if (excluded[s]) {
                continue;
            }
            if (key[s].layer < 0) {
                return s;  // never filled (the cache hands those out before asking): nothing to keep
            }
            const record & r = rec(key[s]);
            const double   p = (double) r.uses / (1.0 + (double) (ctx.pass - r.last_pass));
            if (best < 0 || p < best_p || (p == best_p && r.last_use < best_t)) {
                best   = s;
                best_p = p;
                best_t = r.last_use;
            }
        }
        return best;
    }

    void reset_sequence(const moetier_policy_ctx & /*ctx*/) override {}
};

}  // namespace

moetier_policy_ptr moetier_policy_lfru_create() {
    return std::make_unique<moetier_policy_lfru>();
}
