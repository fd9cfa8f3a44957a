// Least recently used: evict the unpinned slot whose last use is oldest.

#include "policies.h"

namespace {

struct moetier_policy_lru : moetier_policy_i {
    std::vector<uint64_t> last_use;  // [n_slots] tick of the last hit or load, 0 = never used

    void init(int32_t n_slots) override { last_use.assign(n_slots, 0); }

    void on_hit(int32_t slot, const moetier_key & /*key*/, bool /*high*/, const moetier_policy_ctx & ctx) override {
        last_use[slot] = ctx.tick;
    }

    void on_load(int32_t slot, const moetier_key & /*key*/, bool /*high*/, const moetier_policy_ctx & ctx) override {
        last_use[slot] = ctx.tick;
    }

    int32_t victim(const std::vector<uint8_t> & excluded, const moetier_policy_ctx & /*ctx*/) override {
        int32_t best = -1;
        for (int32_t s = 0; s < (int32_t) last_use.size(); ++s) {
            if (excluded[s]) {
                continue;
            }
            if (best < 0 || last_use[s] < last_use[best]) {
                best = s;
            }
        }
        return best;
    }

    // recency is not a sequence-level record: it carries over
    void reset_sequence(const moetier_policy_ctx & /*ctx*/) override {}
};

}  // namespace

moetier_policy_ptr moetier_policy_lru_create() {
    return std::make_unique<moetier_policy_lru>();
}
