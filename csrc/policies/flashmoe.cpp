// FlashMoE's learned policy (flashmoe.h), and the recorder that logs a replay's eviction decisions
// with Belady's view of them, the training data of that policy.

#include "flashmoe.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <unordered_map>

moetier_flashmoe_features::record & moetier_flashmoe_features::rec_mut(const moetier_key & k) {
    if ((size_t) k.layer >= records.size()) {
        records.resize(k.layer + 1);
        max_uses.resize(k.layer + 1, 0);
    }
    if ((size_t) k.expert >= records[k.layer].size()) {
        records[k.layer].resize(k.expert + 1);
    }
    return records[k.layer][k.expert];
}

const moetier_flashmoe_features::record & moetier_flashmoe_features::rec(const moetier_key & k) const {
    static const record none;
    if ((size_t) k.layer >= records.size() || (size_t) k.expert >= records[k.layer].size()) {
        return none;
    }
    return records[k.layer][k.expert];
}

void moetier_flashmoe_features::use(const moetier_key & k, const moetier_policy_ctx & ctx) {
    record & r = rec_mut(k);
    if (r.uses == 0 || r.last_pass != ctx.pass) {
        ++r.uses;
        r.last_pass       = ctx.pass;
        max_uses[k.layer] = std::max(max_uses[k.layer], r.uses);
    }
    r.last_tick = ctx.tick;
}

void moetier_flashmoe_features::of(const moetier_key &        k,
                                   const moetier_policy_ctx & ctx,
                                   float                      out[MOETIER_FLASHMOE_N_IN]) const {
    const record & r  = rec(k);
    const int32_t  ln = ctx.n_layers > 0 ? ctx.n_layers : 1;
    out[2]            = (float) (((k.layer - ctx.layer) % ln + ln) % ln) / (float) ln;
    if (r.uses == 0) {
        out[0] = 0.0f;
        out[1] = 0.0f;
        return;
    }
    const uint64_t age = ctx.pass >= r.last_pass ? ctx.pass - r.last_pass : 0;
    out[0]             = 1.0f / (float) (age + 1);
    out[1]             = (float) r.uses / (float) std::max<uint64_t>(1, max_uses[k.layer]);
}

static float moetier_silu(float x) {
    return x / (1.0f + std::exp(-x));
}

float moetier_flashmoe_net::score(const float * x) const {
    const int32_t n = n_hidden;
    // small enough for the stack: n_hidden is at most 1024 (checked at load)
    float         h1[1024];
    float         h2[1024];
    for (int32_t i = 0; i < n; ++i) {
        float s = b1[i];
        for (int32_t j = 0; j < n_in; ++j) {
            s += w1[(size_t) i * n_in + j] * x[j];
        }
        h1[i] = moetier_silu(s);
    }
    for (int32_t i = 0; i < n; ++i) {
        const float * w = &w2[(size_t) i * n];
        float         s = b2[i];
        for (int32_t j = 0; j < n; ++j) {
            s += w[j] * h1[j];
        }
        h2[i] = moetier_silu(s);
    }
    float s = b3;
    for (int32_t i = 0; i < n; ++i) {
        s += w3[i] * h2[i];
    }
    return s;
}

bool moetier_flashmoe_load(const std::string & path, moetier_flashmoe_net & net, std::string & err) {
    std::unique_ptr<FILE, int (*)(FILE *)> f(fopen(path.c_str(), "rb"), fclose);
    if (!f) {
        err = path + ": " + strerror(errno);
        return false;
    }
    char     magic[8];
    uint32_t dims[2];
    if (fread(magic, 1, 8, f.get()) != 8 || memcmp(magic, "MOETFMN1", 8) != 0 || fread(dims, 4, 2, f.get()) != 2) {
        err = path + ": not a flashmoe policy network (no MOETFMN1 header)";
        return false;
    }
    if (dims[0] < 2 || dims[0] > (uint32_t) MOETIER_FLASHMOE_N_IN || dims[1] < 1 || dims[1] > 1024) {
        err = path + ": a network of " + std::to_string(dims[0]) + " inputs and " + std::to_string(dims[1]) +
              " hidden units; expected 2 or 3 inputs and 1-1024 hidden";
        return false;
    }
    const size_t n       = dims[1];
    const size_t n_float = n * dims[0] + n + n * n + n + n + 1;
    if (fseek(f.get(), 0, SEEK_END) != 0 || ftell(f.get()) != (long) (16 + 4 * n_float) ||
        fseek(f.get(), 16, SEEK_SET) != 0) {
        err = path + ": size is not that of a " + std::to_string(n) + "-hidden network (" +
              std::to_string(16 + 4 * n_float) + " bytes)";
        return false;
    }
    net.n_in     = (int32_t) dims[0];
    net.n_hidden = (int32_t) n;
    net.w1.resize(n * dims[0]);
    net.b1.resize(n);
    net.w2.resize(n * n);
    net.b2.resize(n);
    net.w3.resize(n);
    bool ok = true;
    for (std::vector<float> * v : { &net.w1, &net.b1, &net.w2, &net.b2, &net.w3 }) {
        ok = ok && fread(v->data(), 4, v->size(), f.get()) == v->size();
    }
    ok = ok && fread(&net.b3, 4, 1, f.get()) == 1;
    if (!ok) {
        err = path + ": short read";
        return false;
    }
    bool finite = std::isfinite(net.b3);
    for (const std::vector<float> * v : { &net.w1, &net.b1, &net.w2, &net.b2, &net.w3 }) {
        for (float x : *v) {
            finite = finite && std::isfinite(x);
        }
    }
    if (!finite) {
        err = path + ": a weight is not finite";
        return false;
    }
    return true;
}

namespace {

struct moetier_policy_flashmoe : moetier_policy_i {
    std::shared_ptr<const moetier_flashmoe_net> net;
    moetier_flashmoe_features                   feat;
    std::vector<moetier_key>                    key;  // [n_slots]

    // The inputs come from small integers (passes since the last use, use counts, layers), so the
    // same ones recur: a network evaluation is ~2 * hidden^2 multiply-adds on the decode path, a
    // lookup is not. Key: the inputs' bits.
    struct memo_key {
        uint32_t v[MOETIER_FLASHMOE_N_IN];

        bool operator==(const memo_key & o) const { return memcmp(v, o.v, sizeof(v)) == 0; }
    };

    struct memo_hash {
        size_t operator()(const memo_key & k) const {
            uint64_t h = 0xcbf29ce484222325ull;
            for (uint32_t x : k.v) {
                h = (h ^ x) * 0x100000001b3ull;
            }
            return (size_t) h;
        }
    };

    std::unordered_map<memo_key, float, memo_hash> memo;

    float score(float x[MOETIER_FLASHMOE_N_IN]) {
        for (int32_t j = net->n_in; j < MOETIER_FLASHMOE_N_IN; ++j) {
            x[j] = 0.0f;  // inputs the network does not take: out of the key
        }
        memo_key k;
        memcpy(k.v, x, sizeof(k.v));
        const auto it = memo.find(k);
        if (it != memo.end()) {
            return it->second;
        }
        if (memo.size() >= (1u << 16)) {
            memo.clear();
        }
        return memo[k] = net->score(x);
    }

    explicit moetier_policy_flashmoe(std::shared_ptr<const moetier_flashmoe_net> n) : net(std::move(n)) {}

    void init(int32_t n_slots) override { key.assign(n_slots, moetier_key{}); }

    void on_hit(int32_t s, const moetier_key & k, bool /*high*/, const moetier_policy_ctx & ctx) override {
        key[s] = k;
        feat.use(k, ctx);
    }

    void on_load(int32_t s, const moetier_key & k, bool high, const moetier_policy_ctx & ctx) override {
        on_hit(s, k, high, ctx);
    }

    std::vector<int32_t> oldest;  // [layer] scratch of victim: the layer's least recently used candidate
    std::vector<uint8_t> mask;    // [slot] scratch of victim: 1 = not scored

    int32_t victim(const std::vector<uint8_t> & excluded, const moetier_policy_ctx & ctx) override {
        const std::vector<uint8_t> * cand = &excluded;
        if (net->n_in > 2) {
            // Across layers, one candidate per layer is scored: its least recently used slot. Scoring
            // every slot of the cache at every eviction made a replay of the 1.5B take hours.
            oldest.assign(std::max(ctx.n_layers, 1), -1);
            for (int32_t s = 0; s < (int32_t) key.size(); ++s) {
                const int32_t l = key[s].layer;
                if (excluded[s] || l < 0) {
                    continue;
                }
                if ((size_t) l >= oldest.size()) {
                    oldest.resize(l + 1, -1);
                }
                if (oldest[l] < 0 || feat.last_use(key[s]) < feat.last_use(key[oldest[l]])) {
                    oldest[l] = s;
                }
            }
            mask.assign(key.size(), 1);
            for (int32_t s : oldest) {
                if (s >= 0) {
                    mask[s] = 0;
                }
            }
            cand = &mask;
        }
        int32_t best   = -1;
        float   best_v = 0.0f;
        for (int32_t s = 0; s < (int32_t) key.size(); ++s) {
            if ((*cand)[s]) {
                continue;
            }
            float x[MOETIER_FLASHMOE_N_IN];
            feat.of(key[s], ctx, x);
            const float v = score(x);
            if (best < 0 || v > best_v || (v == best_v && feat.last_use(key[s]) < feat.last_use(key[best]))) {
                best   = s;
                best_v = v;
            }
        }
        return best;
    }

    // frequencies count over the whole run, as the paper's do
    void reset_sequence(const moetier_policy_ctx & /*ctx*/) override {}

    bool across_layers() const override { return net->n_in > 2; }
};

// Wraps the policy a replay runs and logs each of its eviction decisions: every candidate's inputs
// and the distance to its next use, from the trace's future.
struct moetier_policy_recorder : moetier_policy_i {
    moetier_policy_ptr                  inner;
    const moetier_future *              future;
    std::vector<moetier_decision_row> * log;
    moetier_flashmoe_features           feat;
    std::vector<moetier_key>            key;

    moetier_policy_recorder(moetier_policy_ptr p, const moetier_future * f, std::vector<moetier_decision_row> * l) :
        inner(std::move(p)),
        future(f),
        log(l) {}

    void init(int32_t n_slots) override {
        key.assign(n_slots, moetier_key{});
        inner->init(n_slots);
    }

    void on_hit(int32_t s, const moetier_key & k, bool high, const moetier_policy_ctx & ctx) override {
        key[s] = k;
        feat.use(k, ctx);
        inner->on_hit(s, k, high, ctx);
    }

    void on_load(int32_t s, const moetier_key & k, bool high, const moetier_policy_ctx & ctx) override {
        key[s] = k;
        feat.use(k, ctx);
        inner->on_load(s, k, high, ctx);
    }

    int32_t victim(const std::vector<uint8_t> & excluded, const moetier_policy_ctx & ctx) override {
        // a log shared by several pools: this call's rows carry one decision index of their own
        const int64_t        d     = log->empty() ? 0 : log->back().decision + 1;
        const size_t         first = log->size();
        std::vector<int32_t> slots;
        for (int32_t s = 0; s < (int32_t) key.size(); ++s) {
            if (excluded[s]) {
                continue;
            }
            moetier_decision_row row;
            row.decision = d;
            feat.of(key[s], ctx, row.x);
            const moetier_future::use * u = future->next(key[s], ctx.tick - 1);
            row.next_use                  = u ? u->tick - ctx.tick : UINT64_MAX;
            row.chosen                    = false;
            log->push_back(row);
            slots.push_back(s);
        }
        const int32_t v = inner->victim(excluded, ctx);
        for (size_t i = 0; i < slots.size(); ++i) {
            (*log)[first + i].chosen = slots[i] == v;
        }
        return v;
    }

    void reset_sequence(const moetier_policy_ctx & ctx) override { inner->reset_sequence(ctx); }

    bool across_layers() const override { return inner->across_layers(); }
};

}  // namespace

moetier_policy_ptr moetier_policy_flashmoe_create(const std::string & path, std::string & err) {
    auto net = std::make_shared<moetier_flashmoe_net>();
    if (!moetier_flashmoe_load(path, *net, err)) {
        return nullptr;
    }
    return std::make_unique<moetier_policy_flashmoe>(std::move(net));
}

moetier_policy_ptr moetier_policy_recorder_create(moetier_policy_ptr                  inner,
                                                  const moetier_future *              future,
                                                  std::vector<moetier_decision_row> * log) {
    return std::make_unique<moetier_policy_recorder>(std::move(inner), future, log);
}
