#include "policies.h"

#include "moetier.h"

moetier_policy_ptr moetier_policy_create(const std::string & name, const moetier_policy_weights & weights) {
    if (name == "lru") {
        return moetier_policy_lru_create();
    }
    if (name == "random") {
        return moetier_policy_random_create();
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
        return nullptr;
    }
    return moetier_policy_weighted_create(w);
}

const char * const * moetier_policy_names(void) {
    static const char * const names[] = { "lru", "lfu", "lhu", "fld", "multi", "random", nullptr };
    return names;
}
