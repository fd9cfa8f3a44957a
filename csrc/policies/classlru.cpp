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

struct moetier_policy_classlru : moetier_policy_decayed_uses {
    moetier_policy_classlru() : moetier_policy_decayed_uses(MOETIER_CLASSLRU_HALF_LIFE) {}

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
            const record & r = records[key[s]];
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
};

}  // namespace

moetier_policy_ptr moetier_policy_classlru_create() {
    return std::make_unique<moetier_policy_classlru>();
}
