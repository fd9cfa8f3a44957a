#include "policies.h"

#include "moetier.h"

moetier_policy_ptr moetier_policy_create(const std::string & name) {
    if (name == "lru") {
        return moetier_policy_lru_create();
    }
    return nullptr;
}

const char * const * moetier_policy_names(void) {
    static const char * const names[] = { "lru", nullptr };
    return names;
}
