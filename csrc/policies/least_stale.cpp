// Least-stale, after SpecMD (arXiv 2602.03921): layers run in a fixed order, so an
// expert already used in the current forward pass is not touched again until the next one. Those
// are evicted first, the most recently used of them first (its layer comes back last); only when
// none is left does the least recently used of the older ones go. Weighs layers itself: no
// per-layer partition.

#include "policies.h"

namespace {

struct moetier_policy_least_stale : moetier_policy_i {
    std::vector<uint64_t> last_use;   // [n_slots] tick
    std::vector<uint64_t> last_pass;  // [n_slots] forward pass of the last use

    void init(int32_t n_slots) override {
        last_use.assign(n_slots, 0);
        last_pass.assign(n_slots, 0);
    }

    void on_hit(int32_t s, const moetier_key & /*key*/, bool /*high*/, const moetier_policy_ctx & ctx) override {
        last_use[s]  = ctx.tick;
        last_pass[s] = ctx.pass;
    }

    void on_load(int32_t s, const moetier_key & k, bool high, const moetier_policy_ctx & ctx) override {
        on_hit(s, k, high, ctx);
    }

    int32_t victim(const std::vector<uint8_t> & excluded, const moetier_policy_ctx & ctx) override {
        int32_t fresh = -1;  // used in this pass: the most recent
        int32_t stale = -1;  // older: the least recent
        for (int32_t s = 0; s < (int32_t) last_use.size(); ++s) {
            if (excluded[s]) {
                continue;
            }
            if (last_pass[s] == ctx.pass) {
                if (fresh < 0 || last_use[s] > last_use[fresh]) {
                    fresh = s;
                }
            } else if (stale < 0 || last_use[s] < last_use[stale]) {
                stale = s;
            }
        }
        return fresh >= 0 ? fresh : stale;
    }

    void reset_sequence(const moetier_policy_ctx & /*ctx*/) override {}

    bool across_layers() const override { return true; }
};

}  // namespace

moetier_policy_ptr moetier_policy_least_stale_create() {
    return std::make_unique<moetier_policy_least_stale>();
}
