#pragma once

// Eviction policies of the expert cache. A policy sees the slots of one pool (one precision of one
// pool group) and the expert each holds; the cache tells it about hits and loads and asks it for a
// victim among unpinned slots. A new policy is one file in csrc/policies/ plus one line in
// moetier_policy_create.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

// which expert a slot holds
struct moetier_key {
    int32_t layer  = -1;  // model layer index
    int32_t expert = -1;  // expert index within the layer
};

// the cache's clocks when it calls a policy
struct moetier_policy_ctx {
    uint64_t tick     = 0;  // layer passes of the pool group so far (a resolve is one tick)
    uint64_t seq_tick = 0;  // tick at which the current sequence started
    uint64_t pass     = 0;  // forward passes (ubatches) so far, counting this one
    uint64_t steps    = 1;  // forward passes of the current sequence, counting this one
    int32_t  layer    = 0;  // model layer being resolved
    int32_t  n_layers = 1;  // model layers, for layer distances
    // on_hit/on_load of an expert the resolve needs: its rank by gate weight (0 = the largest) at the
    // last token of the ubatch, n_used if only earlier tokens route it; -1 if no token routed it (a
    // prefetch, a warm start)
    int32_t  rank     = -1;
    bool     batch    = false;  // the pass is a ubatch of several tokens (prefill)
};

// the weights of HOBBIT's multidimensional priority (eq. 3)
struct moetier_policy_weights {
    float lru = 0.25f;
    float lfu = 0.25f;
    float lhu = 0.25f;
    float fld = 0.25f;
};

struct moetier_policy_i {
    virtual ~moetier_policy_i() = default;

    // called once, before any other call, with the number of slots of the pool
    virtual void init(int32_t n_slots) = 0;

    // slot already held key and is used again; high: the pool holds high-precision experts
    virtual void on_hit(int32_t slot, const moetier_key & key, bool high, const moetier_policy_ctx & ctx) = 0;

    // slot was just filled with key
    virtual void on_load(int32_t slot, const moetier_key & key, bool high, const moetier_policy_ctx & ctx) = 0;

    // choose the slot to evict among those with excluded[slot] == 0 (at least one exists)
    virtual int32_t victim(const std::vector<uint8_t> & excluded, const moetier_policy_ctx & ctx) = 0;

    // a new sequence starts: forget sequence-level records
    virtual void reset_sequence(const moetier_policy_ctx & ctx) = 0;

    // true if the policy weighs layer distances itself; otherwise the cache first picks the layer to
    // evict from (the one most above its fair share of slots) and excludes every other layer
    virtual bool across_layers() const { return false; }
};

using moetier_policy_ptr = std::unique_ptr<moetier_policy_i>;

// Per-expert records of a policy, grown on first use: an expert evicted and read again keeps them.
template <typename R> class moetier_expert_records {
  public:
    R & operator[](const moetier_key & k) {
        if ((size_t) k.layer >= rows.size()) {
            rows.resize(k.layer + 1);
        }
        if ((size_t) k.expert >= rows[k.layer].size()) {
            rows[k.layer].resize(k.expert + 1);
        }
        return rows[k.layer][k.expert];
    }

  private:
    std::vector<std::vector<R>> rows;  // [layer][expert]
};

// The per-expert use counts of ClassLRU and reuse: at most one use per forward pass, decayed with a
// half-life of half_life passes, and the tick of the last use. Counts are per expert, so an expert
// read again keeps its history, and they decay instead of resetting with a sequence.
struct moetier_policy_decayed_uses : moetier_policy_i {
    struct record {
        double   count      = 0.0;  // decayed uses, as of pass count_pass
        uint64_t count_pass = 0;
        uint64_t last_use   = 0;    // tick
    };

    const double                   half_life;  // forward passes
    std::vector<moetier_key>       key;        // [n_slots]
    moetier_expert_records<record> records;

    explicit moetier_policy_decayed_uses(double h) : half_life(h) {}

    double decay(uint64_t passes) const { return std::exp2(-(double) passes / half_life); }

    // r's count as of pass
    double decayed(const record & r, uint64_t pass) const { return r.count * decay(pass - r.count_pass); }

    // the passes seen by pass, decayed as the counts are: sum over i < pass of 2^(-i / H)
    double passes_seen(uint64_t pass) const { return (1.0 - decay(pass)) / (1.0 - decay(1)); }

    // r's use frequency per pass by pass (half a use and one pass added: one use is not certainty)
    double frequency(const record & r, uint64_t pass) const {
        return (decayed(r, pass) + 0.5) / (passes_seen(pass) + 1.0);
    }

    void use(int32_t s, const moetier_key & k, const moetier_policy_ctx & ctx) {
        key[s]     = k;
        record & r = records[k];
        if (r.last_use == 0 || r.count_pass != ctx.pass) {  // one use per forward pass
            r.count      = decayed(r, ctx.pass) + 1.0;
            r.count_pass = ctx.pass;
        }
        r.last_use = ctx.tick;
    }

    void init(int32_t n_slots) override { key.assign(n_slots, moetier_key{}); }

    void on_hit(int32_t s, const moetier_key & k, bool /*high*/, const moetier_policy_ctx & ctx) override {
        use(s, k, ctx);
    }

    void on_load(int32_t s, const moetier_key & k, bool /*high*/, const moetier_policy_ctx & ctx) override {
        use(s, k, ctx);
    }

    void reset_sequence(const moetier_policy_ctx & /*ctx*/) override {}
};

// Belady's rule with the future estimated (reuse, reuse-rank, reuse-learned): among the slots not
// excluded, the one whose next use is expected farthest away, d + n_layers (1 - q) / q resolves, with
// d the layers until its layer runs again and q = q_of(slot) the probability that run uses it; ties
// to the smaller last_use_of(slot); an empty slot first
template <typename Q, typename T>
int32_t moetier_reuse_victim(const std::vector<moetier_key> & key,
                             const std::vector<uint8_t> &     excluded,
                             const moetier_policy_ctx &       ctx,
                             Q                                q_of,
                             T                                last_use_of) {
    const int32_t ln     = ctx.n_layers > 0 ? ctx.n_layers : 1;
    int32_t       best   = -1;
    double        best_v = -1.0;
    uint64_t      best_t = 0;
    for (int32_t s = 0; s < (int32_t) key.size(); ++s) {
        if (excluded[s]) {
            continue;
        }
        if (key[s].layer < 0) {
            return s;  // an empty slot
        }
        const double   q = q_of(s);
        const uint64_t t = last_use_of(s);
        const int32_t  d = ((key[s].layer - ctx.layer) % ln + ln) % ln;
        const double   v = (d == 0 ? ln : d) + ln * (1.0 - std::min(q, 1.0)) / q;
        if (best < 0 || v > best_v || (v == best_v && t < best_t)) {
            best   = s;
            best_v = v;
            best_t = t;
        }
    }
    return best;
}

// What a recorded trace will ask for, known only to a replay: the offline policies (Belady) look
// ahead in it. Ticks count resolves as the cache does (the first is 1).
struct moetier_future {
    struct use {
        uint64_t tick;
        uint8_t  need;  // moetier_need of that resolve
    };

    std::vector<std::vector<std::vector<use>>> uses;  // [layer][expert] ascending ticks
    uint64_t                                   bytes_high = 0;
    uint64_t                                   bytes_low  = 0;
    bool                                       has_low    = false;  // a low pool serves low needs

    // the first use of (layer, expert) after tick, nullptr if none
    const use * next(const moetier_key & k, uint64_t tick) const;
};

struct moetier_decision_row;

// what some policies need beyond their name: replay's look-ahead, and a log of decisions to train on
struct moetier_policy_env {
    const moetier_future *              future = nullptr;  // offline policies need it
    std::vector<moetier_decision_row> * record = nullptr;  // set: log every eviction decision (needs future)
};

// The policy called name: one of moetier_policy_names(), an offline one (with env.future), or
// "flashmoe:PATH" (FlashMoE's learned policy, its network read from PATH). nullptr if there is no
// such policy, with the reason in *err when err is given. weights are used by "multi" only.
moetier_policy_ptr moetier_policy_create(const std::string &            name,
                                         const moetier_policy_weights & weights,
                                         const moetier_policy_env &     env = {},
                                         std::string *                  err = nullptr);

// the offline policies (they need the future: replay only), nullptr-terminated
const char * const * moetier_policy_offline_names();
bool                 moetier_policy_is_offline(const std::string & name);

// one factory per policy file
moetier_policy_ptr moetier_policy_lru_create();
moetier_policy_ptr moetier_policy_random_create();
// lfu, lhu, fld and multi: a weighted sum of the four HOBBIT priorities (one-hot weights for the
// single ones)
moetier_policy_ptr moetier_policy_weighted_create(const moetier_policy_weights & weights);
// the field's policies, for the replay report card (one file each)
moetier_policy_ptr moetier_policy_classlru_create();
moetier_policy_ptr moetier_policy_lfru_create();
moetier_policy_ptr moetier_policy_least_stale_create();
// expected reuse distance (layer distance and decayed use frequency, in resolves); half_life in
// forward passes
moetier_policy_ptr moetier_policy_reuse_create(double half_life);
// expected reuse distance with the next use's probability learned online from the gate rank at the
// last use and the passes since, and the decayed use frequency (half_life in forward passes)
moetier_policy_ptr moetier_policy_reuse_rank_create(double half_life);
// expected reuse distance with the next use's probability learned online, jointly, from the passes
// since the last use, the use frequency at two time scales (half_life and 16 x half_life passes) and
// the gate rank at the last use
moetier_policy_ptr moetier_policy_reuse_learned_create(double half_life);
// Belady's MIN (cost_aware false) and its byte-weighted variant; future must outlive the policy
moetier_policy_ptr moetier_policy_belady_create(const moetier_future * future, bool cost_aware);
// FlashMoE's learned policy (flashmoe.h); nullptr with err set if the network file is bad
moetier_policy_ptr moetier_policy_flashmoe_create(const std::string & path, std::string & err);
// inner, logging each eviction decision with the future's view of it into log
moetier_policy_ptr moetier_policy_recorder_create(moetier_policy_ptr                  inner,
                                                  const moetier_future *              future,
                                                  std::vector<moetier_decision_row> * log);
