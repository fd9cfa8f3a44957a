#include "policies.h"

#include "moetier.h"

#include <algorithm>
#include <cstdlib>

const moetier_future::use * moetier_future::next(const moetier_key & k, uint64_t tick) const {
    if ((size_t) k.layer >= uses.size() || (size_t) k.expert >= uses[k.layer].size()) {
        return nullptr;
    }
    const auto & v  = uses[k.layer][k.expert];
    const auto   it = std::upper_bound(v.begin(), v.end(), tick, [](uint64_t t, const use & u) { return t < u.tick; });
    return it == v.end() ? nullptr : &*it;
}

const char * const * moetier_policy_offline_names() {
    static const char * const names[] = { "belady", "belady-cost", nullptr };
    return names;
}

bool moetier_policy_is_offline(const std::string & name) {
    for (const char * const * n = moetier_policy_offline_names(); *n; ++n) {
        if (name == *n) {
            return true;
        }
    }
    return false;
}

static moetier_policy_ptr moetier_policy_named(const std::string &            name,
                                               const moetier_policy_weights & weights,
                                               const moetier_future *         future,
                                               std::string &                  err) {
    if (name == "lru") {
        return moetier_policy_lru_create();
    }
    if (name == "random") {
        return moetier_policy_random_create();
    }
    if (name == "classlru") {
        return moetier_policy_classlru_create();
    }
    if (name == "lfru") {
        return moetier_policy_lfru_create();
    }
    if (name == "least-stale") {
        return moetier_policy_least_stale_create();
    }
    for (const char * base : { "reuse", "reuse-rank", "reuse-learned" }) {
        const std::string b = base;
        if (name.compare(0, b.size(), b) != 0 || (name.size() != b.size() && name[b.size()] != ':')) {
            continue;
        }
        double half_life = b == "reuse" ? 64.0 : 16.0;
        if (name.size() > b.size()) {
            char * end = nullptr;
            half_life  = strtod(name.c_str() + b.size() + 1, &end);
            if (end == name.c_str() + b.size() + 1 || *end != '\0' || !(half_life > 0.0 && half_life < 1e9)) {
                err = "policy '" + name + "': " + b + ":H takes a half-life H > 0 in forward passes";
                return nullptr;
            }
        }
        if (b == "reuse") {
            return moetier_policy_reuse_create(half_life);
        }
        return b == "reuse-rank" ? moetier_policy_reuse_rank_create(half_life) :
                                   moetier_policy_reuse_learned_create(half_life);
    }
    static const std::string flashmoe = "flashmoe:";
    if (name.compare(0, flashmoe.size(), flashmoe) == 0) {
        return moetier_policy_flashmoe_create(name.substr(flashmoe.size()), err);
    }
    if (moetier_policy_is_offline(name)) {
        if (!future) {
            err = "policy '" + name + "' looks into the future: it runs in trace replay only (moetier replay)";
            return nullptr;
        }
        return moetier_policy_belady_create(future, name == "belady-cost");
    }
    moetier_policy_weights w = { 0.0f, 0.0f, 0.0f, 0.0f };
    if (name == "lfu") {
        w.lfu = 1.0f;
    } else if (name == "lhu") {
        w.lhu = 1.0f;
    } else if (name == "fld") {
        w.fld = 1.0f;
    } else if (name == "multi") {
        w = weights;
    } else {
        std::string names;
        for (const char * const * n = moetier_policy_names(); *n; ++n) {
            names += names.empty() ? *n : std::string(", ") + *n;
        }
        err = "unknown policy '" + name + "'; available: " + names +
              ", reuse:HALF_LIFE, reuse-rank:HALF_LIFE, reuse-learned:HALF_LIFE, flashmoe:NETWORK_FILE";
        return nullptr;
    }
    return moetier_policy_weighted_create(w);
}

moetier_policy_ptr moetier_policy_create(const std::string &            name,
                                         const moetier_policy_weights & weights,
                                         const moetier_policy_env &     env,
                                         std::string *                  err) {
    std::string        why;
    moetier_policy_ptr p = moetier_policy_named(name, weights, env.future, why);
    if (p && env.record) {
        if (!env.future) {
            why = "recording eviction decisions needs the trace's future";
            p.reset();
        } else {
            p = moetier_policy_recorder_create(std::move(p), env.future, env.record);
        }
    }
    if (!p && err) {
        *err = why;
    }
    return p;
}

// the online policies (a model can run them); replay also takes the offline ones
const char * const * moetier_policy_names(void) {
    static const char * const names[] = { "lru",        "lfu",           "lhu",  "fld",         "multi",
                                          "random",     "classlru",      "lfru", "least-stale", "reuse",
                                          "reuse-rank", "reuse-learned", nullptr };
    return names;
}
