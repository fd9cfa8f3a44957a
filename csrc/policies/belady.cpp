// Belady's MIN, the offline optimum a replay sets every policy against: evict the slot whose expert
// is used again farthest in the future (never again first). With one pool of equal slots this
// minimises misses, so it bounds every online policy's hits and bytes.
//
// belady-cost weighs the bytes a miss would read: evicting slot s loses the bytes its next use then
// reads (a high copy: the high bytes for a high need, the low bytes for a low need when a low pool
// exists, nothing for a skip; a low copy: the low bytes for a low need, nothing otherwise, as a
// high need reads the high version anyway), and keeping it occupies the slot for the distance to
// that use. The victim has the fewest lost bytes per tick kept. Caching with unequal miss costs has
// no simple optimal rule; this greedy one is a bound to compare mixed precision against, not a proof.

#include "../moetier-layer.h"
#include "policies.h"

#include <limits>

namespace {

struct moetier_policy_belady : moetier_policy_i {
    const moetier_future *   future;
    const bool               cost_aware;
    bool                     high = true;  // the pool's precision, told by on_load
    std::vector<moetier_key> key;          // [n_slots]

    moetier_policy_belady(const moetier_future * f, bool c) : future(f), cost_aware(c) {}

    void init(int32_t n_slots) override { key.assign(n_slots, moetier_key{}); }

    void on_hit(int32_t slot, const moetier_key & k, bool h, const moetier_policy_ctx & /*ctx*/) override {
        key[slot] = k;
        high      = h;
    }

    void on_load(int32_t slot, const moetier_key & k, bool h, const moetier_policy_ctx & /*ctx*/) override {
        key[slot] = k;
        high      = h;
    }

    // bytes the next use reads if this pool's copy is gone
    double loss(uint8_t need) const {
        if (high) {
            if (need == MOETIER_NEED_HIGH || (need == MOETIER_NEED_LOW && !future->has_low)) {
                return (double) future->bytes_high;
            }
            return need == MOETIER_NEED_LOW ? (double) future->bytes_low : 0.0;
        }
        return need == MOETIER_NEED_LOW ? (double) future->bytes_low : 0.0;
    }

    int32_t victim(const std::vector<uint8_t> & excluded, const moetier_policy_ctx & ctx) override {
        int32_t best   = -1;
        double  best_v = 0.0;  // higher is evicted first
        for (int32_t s = 0; s < (int32_t) key.size(); ++s) {
            if (excluded[s]) {
                continue;
            }
            // a use in this very resolve counts: its expert may not be pinned yet
            const moetier_future::use * u = future->next(key[s], ctx.tick - 1);
            double                      v;
            if (u == nullptr) {
                v = std::numeric_limits<double>::infinity();
            } else if (!cost_aware) {
                v = (double) (u->tick - ctx.tick);
            } else {
                const double l = loss(u->need);
                v              = l > 0.0 ? (double) (u->tick - ctx.tick) / l : std::numeric_limits<double>::infinity();
            }
            if (best < 0 || v > best_v) {
                best   = s;
                best_v = v;
            }
        }
        return best;
    }

    void reset_sequence(const moetier_policy_ctx & /*ctx*/) override {}

    // the future already knows which layer runs next
    bool across_layers() const override { return true; }
};

}  // namespace

moetier_policy_ptr moetier_policy_belady_create(const moetier_future * future, bool cost_aware) {
    return std::make_unique<moetier_policy_belady>(future, cost_aware);
}
