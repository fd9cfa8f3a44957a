#include "moetier-configure.h"

#include <map>

moetier_params_copy::moetier_params_copy(const moetier_params & from) :
    p(from),
    store_dir(from.store_dir ? from.store_dir : ""),
    policy(from.policy ? from.policy : "") {
    point();
}

moetier_params_copy::moetier_params_copy(const moetier_params_copy & other) :
    p(other.p),
    store_dir(other.store_dir),
    policy(other.policy) {
    point();
}

moetier_params_copy & moetier_params_copy::operator=(const moetier_params_copy & other) {
    p         = other.p;
    store_dir = other.store_dir;
    policy    = other.policy;
    point();
    return *this;
}

void moetier_params_copy::point() {
    p.store_dir = store_dir.empty() ? nullptr : store_dir.c_str();
    p.policy    = policy.empty() ? moetier_default_params().policy : policy.c_str();
}

// per thread: llama_model_load runs on the thread that called it, so a configuration can only be
// taken by the load it was left for, never by another thread's load of the same file
static thread_local std::map<std::string, moetier_params_copy> g_pending;

void moetier_pending_set(const std::string & path, const moetier_params * params) {
    if (params == nullptr) {
        g_pending.erase(path);
    } else {
        g_pending[path] = moetier_params_copy(*params);
    }
}

bool moetier_pending_take(const std::string & path, moetier_params_copy & out) {
    auto it = g_pending.find(path);
    if (it == g_pending.end()) {
        return false;
    }
    out = it->second;
    g_pending.erase(it);
    return true;
}
