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

struct moetier_policy_reuse : moetier_policy_decayed_uses {
    explicit moetier_policy_reuse(double h) : moetier_policy_decayed_uses(h) {}

    int32_t victim(const std::vector<uint8_t> & excluded, const moetier_policy_ctx & ctx) override {
        return moetier_reuse_victim(
            key, excluded, ctx, [&](int32_t s) { return frequency(records[key[s]], ctx.pass); },
            [&](int32_t s) { return records[key[s]].last_use; });
    }

    bool across_layers() const override { return true; }
};

}  // namespace

moetier_policy_ptr moetier_policy_reuse_create(double half_life) {
    return std::make_unique<moetier_policy_reuse>(half_life > 0.0 ? half_life : 64.0);
}
