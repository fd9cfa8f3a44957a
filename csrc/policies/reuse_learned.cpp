// Expected reuse distance (reuse.cpp) with the probability q that an expert's next chance (its layer's
// next resolve) uses it learned online, jointly, from what the cache knows of the expert's history:
//
//   - the passes since its last use (age), in half-octave buckets;
//   - its use frequency at two time scales: uses decayed with a half-life of H passes, and of 16 H
//     passes (a prompt's topic keeps a set of experts busy for hundreds of tokens; a token's
//     neighbours for a few), each in half-octave classes;
//   - its rank by gate weight at the last use, when the router gives weights.
//
// q is the share of such chances that were taken, counted from every expert's gaps between uses
// (decode steps only: a prefill ubatch routes nearly every expert). reuse-rank multiplies the odds of
// a rank x age table by those of one decayed frequency as if they were independent evidence; on real
// routing they are not (an expert used often recently is also used recently), and the joint table
// learns how they combine. Detail is added only where the data is: the chances are counted at four
// levels (age; age and fast frequency; both frequencies; and the rank), each cell's estimate starting
// from its parent's worth `prior` chances, so a short run, or a router whose ranks say nothing (a
// trace without weights, where ranks follow the router's order), costs little.
// The victim is the slot whose next use is expected farthest away, d + n_layers (1 - q) / q resolves.

#include "policies.h"

#include <algorithm>
#include <array>
#include <cmath>

namespace {

struct moetier_policy_reuse_learned : moetier_policy_i {
    static constexpr int32_t n_age   = 30;    // half-octave buckets of passes: 1, 2, 3, 4-5, 6-7, 8-11, ...
    static constexpr int32_t n_freq  = 12;    // half-octave classes of a decayed count; 0: below one half
    static constexpr int32_t n_cells = n_age * n_freq * n_freq;
    static constexpr double  prior   = 8.0;   // chances a cell's parent estimate is worth
    static constexpr double  slow    = 16.0;  // the slow count's half-life, in multiples of the fast one's

    struct record {
        double   fast       = 0.0;  // uses decayed with half-life H passes, as of pass count_pass
        double   slow       = 0.0;  // with half-life slow H
        uint64_t count_pass = 0;
        uint64_t last_pass  = 0;    // 0 = never used by a token (a prefetch, a warm start)
        uint64_t load_pass  = 0;    // pass of the read when no token has used it yet
        uint64_t last_use   = 0;    // tick, for ties
        int32_t  rank       = 0;    // gate rank at the last use
        int32_t  cell       = 0;    // the history's cell at the last use, age excluded: f_fast x f_slow
        bool     batch      = false;
    };

    struct cell {
        double used   = 0.0;
        double chance = 0.0;
    };

    const double                   half_life;
    std::vector<moetier_key>       key;  // [n_slots]
    moetier_expert_records<record> records;
    // the same chances counted at four levels of detail, each cell's estimate starting from its
    // parent's: [age], [age][f_fast], [age][f_fast][f_slow], [rank][age][f_fast][f_slow]
    std::vector<cell>              by_age;
    std::vector<cell>              by_fast;
    std::vector<cell>              by_both;
    std::vector<std::vector<cell>> ranked;  // grown with the ranks seen
    cell                           all;

    explicit moetier_policy_reuse_learned(double h) :
        half_life(h),
        by_age(n_age),
        by_fast(n_age * n_freq),
        by_both(n_cells) {}

    static int32_t age_bucket(uint64_t age) {
        if (age <= 1) {
            return 0;
        }
        int32_t b = 0;
        while (b < 62 && (2ull << b) <= age) {
            ++b;
        }
        const uint64_t base = 1ull << b;
        return std::min(2 * b + ((age - base) * 2 >= base ? 1 : 0), n_age - 1);
    }

    // the first age of bucket b (bucket 1 is empty: age 1 is bucket 0, ages 2 and 3 buckets 2 and 3)
    static uint64_t bucket_start(int32_t b) {
        const int32_t k = b / 2;
        const int32_t h = b % 2;
        return k == 0 ? (h ? 2 : 1) : (1ull << k) + (uint64_t) h * (1ull << (k - 1));
    }

    static int32_t freq_class(double c) {
        if (c < 0.5) {
            return 0;
        }
        return std::clamp(1 + (int32_t) std::floor(2.0 * std::log2(c) + 2.0), 1, n_freq - 1);
    }

    static int32_t at(int32_t age, int32_t hist) { return age * n_freq * n_freq + hist; }

    // the cells of one chance, coarsest first
    std::array<cell *, 5> cells(int32_t rank, int32_t age, int32_t hist) {
        return { &all, &by_age[age], &by_fast[age * n_freq + hist / n_freq], &by_both[at(age, hist)],
                 &ranked_cell(rank, at(age, hist)) };
    }

    void count(int32_t rank, int32_t age, int32_t hist, double chances, double used) {
        for (cell * c : cells(rank, age, hist)) {
            c->chance += chances;
            c->used += used;
        }
    }

    cell & ranked_cell(int32_t rank, int32_t i) {
        if ((size_t) rank >= ranked.size()) {
            ranked.resize(rank + 1, std::vector<cell>(n_cells));
        }
        return ranked[rank][i];
    }

    // chances at ages [a0, a1) of an expert last used with rank and hist, none taken
    void missed(int32_t rank, int32_t hist, uint64_t a0, uint64_t a1) {
        for (uint64_t a = a0; a < a1;) {
            const int32_t  b = age_bucket(a);
            const uint64_t e = b == n_age - 1 ? a1 : std::min(a1, bucket_start(b + 1));
            count(rank, b, hist, (double) (e - a), 0.0);
            a = e;
        }
    }

    void use(int32_t s, const moetier_key & k, const moetier_policy_ctx & ctx) {
        key[s]     = k;
        record & r = records[k];
        if (ctx.rank < 0) {
            r.load_pass = r.last_pass == 0 ? ctx.pass : r.load_pass;
            return;  // read for a prediction: no token used it
        }
        if (r.last_pass != 0 && ctx.pass == r.last_pass) {
            r.last_use = ctx.tick;
            return;  // one use per forward pass
        }
        // a gap learns only between decode steps: a prefill ubatch routes nearly every expert, at either end
        if (r.last_pass != 0 && !r.batch && !ctx.batch) {
            const uint64_t gap = ctx.pass - r.last_pass;
            missed(r.rank, r.cell, 1, gap);
            count(r.rank, age_bucket(gap), r.cell, 1.0, 1.0);
        }
        const double f = std::exp2(-(double) (ctx.pass - r.count_pass) / half_life);
        r.fast         = r.fast * f + 1.0;
        r.slow         = r.slow * std::pow(f, 1.0 / slow) + 1.0;
        r.count_pass   = ctx.pass;
        r.last_pass    = ctx.pass;
        r.last_use     = ctx.tick;
        r.rank         = ctx.rank;
        r.batch        = ctx.batch;
        // the slow count runs 16x longer: divided by 8 before its class is taken (at a steady rate its
        // class is two above the fast one's; the classes were chosen so on the design prompts)
        r.cell         = freq_class(r.fast) * n_freq + freq_class(r.slow / (slow / 2.0));
    }

    void init(int32_t n_slots) override { key.assign(n_slots, moetier_key{}); }

    void on_hit(int32_t s, const moetier_key & k, bool /*high*/, const moetier_policy_ctx & ctx) override {
        use(s, k, ctx);
    }

    void on_load(int32_t s, const moetier_key & k, bool /*high*/, const moetier_policy_ctx & ctx) override {
        use(s, k, ctx);
    }

    // q of a chance at age of an expert last used with rank and hist: each level's share of chances
    // taken, starting from the coarser level's estimate worth `prior` chances (the coarsest from one
    // use in two chances)
    double probability(int32_t rank, int32_t age, int32_t hist) {
        double q = 0.5;
        double w = 2.0;
        for (const cell * c : cells(rank, age, hist)) {
            q = (c->used + w * q) / (c->chance + w);
            w = prior;
        }
        return q;
    }

    // q of the slot's expert at its next chance: this pass if its layer has not run yet, else the next
    double next_chance(const moetier_key & k, const moetier_policy_ctx & ctx) {
        const record & r    = records[k];
        const uint64_t next = k.layer > ctx.layer ? ctx.pass : ctx.pass + 1;
        if (r.last_pass != 0) {
            return std::clamp(probability(r.rank, age_bucket(next > r.last_pass ? next - r.last_pass : 1), r.cell),
                              1e-6, 1.0);
        }
        // read ahead, not used yet: as an expert used once, with no rank, when it was read
        const int32_t once = freq_class(1.0) * n_freq + freq_class(1.0 / (slow / 2.0));
        return std::clamp(probability(ranked.empty() ? 0 : (int32_t) ranked.size() - 1,
                                      age_bucket(next > r.load_pass ? next - r.load_pass : 1), once),
                          1e-6, 1.0);
    }

    int32_t victim(const std::vector<uint8_t> & excluded, const moetier_policy_ctx & ctx) override {
        return moetier_reuse_victim(
            key, excluded, ctx, [&](int32_t s) { return next_chance(key[s], ctx); },
            [&](int32_t s) { return records[key[s]].last_use; });
    }

    // the table is the model's habits more than the text's: it carries over
    void reset_sequence(const moetier_policy_ctx & /*ctx*/) override {}

    bool across_layers() const override { return true; }
};

}  // namespace

moetier_policy_ptr moetier_policy_reuse_learned_create(double half_life) {
    return std::make_unique<moetier_policy_reuse_learned>(half_life > 0.0 ? half_life : 16.0);
}
