// Random replacement: the baseline HOBBIT normalises miss penalties to (Fig. 18a). Seeded, so runs
// and replays are reproducible.

#include "policies.h"

#include <random>

namespace {

struct moetier_policy_random : moetier_policy_i {
    std::mt19937_64 rng{ 0x6d6f6574 };

    void init(int32_t /*n_slots*/) override {}

    void on_hit(int32_t, const moetier_key &, bool, const moetier_policy_ctx &) override {}

    void on_load(int32_t, const moetier_key &, bool, const moetier_policy_ctx &) override {}

    int32_t victim(const std::vector<uint8_t> & excluded, const moetier_policy_ctx & /*ctx*/) override {
        int32_t n = 0;
        for (uint8_t x : excluded) {
            n += x ? 0 : 1;
        }
        if (n == 0) {
            return -1;
        }
        int32_t pick = (int32_t) (rng() % (uint64_t) n);
        for (int32_t s = 0; s < (int32_t) excluded.size(); ++s) {
            if (!excluded[s] && pick-- == 0) {
                return s;
            }
        }
        return -1;
    }

    void reset_sequence(const moetier_policy_ctx & /*ctx*/) override {}

    // random across all layers: no partition, as in the paper's baseline
    bool across_layers() const override { return true; }
};

}  // namespace

moetier_policy_ptr moetier_policy_random_create() {
    return std::make_unique<moetier_policy_random>();
}
