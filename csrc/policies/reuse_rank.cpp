// Expected reuse distance (reuse.cpp) with a better estimate of the probability q that an expert's
// next chance to be used (its layer's next resolve) uses it. Consecutive tokens route alike, and
// how alike is in the gate: an expert a decode token ranked first by gate weight is routed again by
// the next token far more often than one it ranked last, and one a pass skipped comes back less often
// than one it used (bench/results/routing-locality-1.5b-ernie-c32k.md, six traces: 0.87-0.92 after
// rank 1 of 8, 0.52-0.54 after rank 8, 0.72-0.76 one pass after a use, 0.37-0.42 two passes after).
// reuse.cpp's decayed frequency sees neither. Here
//
//   odds(q) = odds(table[rank at last use][passes since]) x odds(p) / odds(base rate)
//
// with the table counted online from each expert's gaps between uses (decode steps only: a prefill
// ubatch routes nearly every expert), p the decayed use frequency of reuse.cpp and the base rate the
// table's overall share of uses; the two are treated as independent evidence. The victim is, as in
// reuse.cpp, the slot whose next use is expected farthest away: d + n_layers (1 - q) / q resolves.
// Experts a prefetch read that no token used yet have no rank: they take the table's oldest bucket.

#include "policies.h"

#include <algorithm>
#include <cmath>

namespace {

struct moetier_policy_reuse_rank : moetier_policy_decayed_uses {
    static constexpr int32_t max_age = 16;  // passes; older gaps share the last bucket

    // what the table learns from, per expert, beside the use counts of the base
    struct last_use_rank {
        uint64_t pass  = 0;  // 0 = never used by a token
        int32_t  rank  = 0;
        bool     batch = false;
    };

    // q's table: [rank][age] uses and chances, with a prior of one use in two chances
    struct cell {
        double used   = 1.0;
        double chance = 2.0;
    };

    moetier_expert_records<last_use_rank> last;
    std::vector<std::vector<cell>>        table;  // [rank][age], rank n_used (earlier tokens, no rank) last
    double                                n_used_all   = 2.0;
    double                                n_chance_all = 4.0;

    explicit moetier_policy_reuse_rank(double h) : moetier_policy_decayed_uses(h) {}

    cell & at(int32_t rank, uint64_t age) {
        if ((size_t) rank >= table.size()) {
            table.resize(rank + 1, std::vector<cell>(max_age + 1));
        }
        return table[rank][std::min<uint64_t>(std::max<uint64_t>(age, 1), max_age)];
    }

    void use_ranked(int32_t s, const moetier_key & k, const moetier_policy_ctx & ctx) {
        key[s] = k;
        if (ctx.rank < 0) {
            return;  // read for a prediction: no token used it
        }
        last_use_rank & r = last[k];
        if (r.pass != 0 && ctx.pass > r.pass && !r.batch) {
            // chances at ages 1 .. gap - 1 were missed, the one at age gap was taken
            const uint64_t gap = ctx.pass - r.pass;
            for (uint64_t a = 1; a < gap && a < (uint64_t) max_age; ++a) {
                at(r.rank, a).chance += 1.0;
            }
            if (gap > (uint64_t) max_age) {
                at(r.rank, max_age).chance += (double) (gap - max_age);
            }
            cell & c = at(r.rank, gap);
            c.chance += 1.0;
            c.used += 1.0;
            n_chance_all += (double) gap;
            n_used_all += 1.0;
        }
        r.pass  = ctx.pass;
        r.rank  = ctx.rank;
        r.batch = ctx.batch;
        use(s, k, ctx);  // the decayed count and the tick of the last use
    }

    void on_hit(int32_t s, const moetier_key & k, bool /*high*/, const moetier_policy_ctx & ctx) override {
        use_ranked(s, k, ctx);
    }

    void on_load(int32_t s, const moetier_key & k, bool /*high*/, const moetier_policy_ctx & ctx) override {
        use_ranked(s, k, ctx);
    }

    static double odds(double p) { return p / (1.0 - p); }

    int32_t victim(const std::vector<uint8_t> & excluded, const moetier_policy_ctx & ctx) override {
        const double  base_odds = odds(n_used_all / n_chance_all);
        const int32_t no_rank   = table.empty() ? 0 : (int32_t) table.size() - 1;
        auto          q_of      = [&](int32_t s) {
            const last_use_rank & lr   = last[key[s]];
            // its next chance: this pass if its layer has not run yet, else the next one
            const uint64_t        next = key[s].layer > ctx.layer ? ctx.pass : ctx.pass + 1;
            const cell & c = lr.pass == 0 ? at(no_rank, max_age) : at(lr.rank, next > lr.pass ? next - lr.pass : 1);
            const double p = std::clamp(frequency(records[key[s]], ctx.pass), 1e-3, 1.0 - 1e-3);
            const double o = odds(c.used / c.chance) * odds(p) / base_odds;
            return std::clamp(o / (1.0 + o), 1e-4, 1.0);
        };
        return moetier_reuse_victim(key, excluded, ctx, q_of, [&](int32_t s) { return records[key[s]].last_use; });
    }

    // the counts and the table are the model's habits more than the text's: they carry over
    void reset_sequence(const moetier_policy_ctx & /*ctx*/) override {}

    bool across_layers() const override { return true; }
};

}  // namespace

moetier_policy_ptr moetier_policy_reuse_rank_create(double half_life) {
    return std::make_unique<moetier_policy_reuse_rank>(half_life > 0.0 ? half_life : 16.0);
}
