#include "moetier-configure.h"

#include <map>
#include <mutex>

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

// loads may run on any thread: one lock around the map, held only to insert or take
static std::mutex                                 g_pending_mutex;
static std::map<std::string, moetier_params_copy> g_pending;

void moetier_pending_set(const std::string & path, const moetier_params * params) {
    std::lock_guard<std::mutex> lock(g_pending_mutex);
    if (params == nullptr) {
        g_pending.erase(path);
    } else {
        g_pending[path] = moetier_params_copy(*params);
    }
}

bool moetier_pending_take(const std::string & path, moetier_params_copy & out) {
    std::lock_guard<std::mutex> lock(g_pending_mutex);
    auto                        it = g_pending.find(path);
    if (it == g_pending.end()) {
        return false;
    }
    out = it->second;
    g_pending.erase(it);
    return true;
}
