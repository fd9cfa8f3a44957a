#include "moetier-impl.h"

#include "moetier.h"

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdlib>
#include <cstring>

int64_t moetier_time_us() {
    return std::chrono::duration_cast<std::chrono::microseconds>(
        std::chrono::steady_clock::now().time_since_epoch()).count();
}

static thread_local std::string g_last_error;

void moetier_set_last_error(const std::string & msg) {
    g_last_error = msg;
}

const char * moetier_last_error(void) {
    return g_last_error.c_str();
}

std::string moetier_format_bytes(uint64_t n) {
    if (n >= (1ull << 30)) {
        return format("%.2f GiB", n / double(1ull << 30));
    }
    if (n >= (1ull << 20)) {
        return format("%.2f MiB", n / double(1ull << 20));
    }
    if (n >= (1ull << 10)) {
        return format("%.2f KiB", n / double(1ull << 10));
    }
    return format("%llu B", (unsigned long long) n);
}

uint64_t moetier_checksum(const void * data, size_t n) {
    const uint8_t * p = (const uint8_t *) data;
    uint64_t h = 0xcbf29ce484222325ull;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        h ^= w;
        h *= 0x100000001b3ull;
        h ^= h >> 29;
    }
    for (; i < n; ++i) {
        h ^= p[i];
        h *= 0x100000001b3ull;
    }
    return h;
}

bool moetier_parse_size(const char * text, uint64_t * out) {
    if (text == nullptr || out == nullptr) {
        return false;
    }
    std::string s(text);
    while (!s.empty() && isspace((unsigned char) s.back())) {
        s.pop_back();
    }
    size_t i = 0;
    while (i < s.size() && (isdigit((unsigned char) s[i]) || s[i] == '.')) {
        ++i;
    }
    if (i == 0 || std::count(s.begin(), s.begin() + i, '.') > 1) {
        return false;
    }
    const double value = strtod(s.substr(0, i).c_str(), nullptr);
    std::string unit = s.substr(i);
    while (!unit.empty() && unit[0] == ' ') {
        unit.erase(0, 1);
    }
    for (auto & c : unit) {
        c = (char) toupper((unsigned char) c);
    }
    if (unit.size() >= 2 && unit.compare(unit.size() - 2, 2, "IB") == 0) {
        unit.resize(unit.size() - 2);
    } else if (unit.size() >= 2 && unit.back() == 'B') {
        unit.pop_back();
    } else if (unit == "B") {
        unit.clear();
    }
    double mult = 1.0;
    if (unit.empty()) {
        mult = 1.0;
    } else if (unit == "K") {
        mult = 1024.0;
    } else if (unit == "M") {
        mult = 1024.0 * 1024.0;
    } else if (unit == "G") {
        mult = 1024.0 * 1024.0 * 1024.0;
    } else if (unit == "T") {
        mult = 1024.0 * 1024.0 * 1024.0 * 1024.0;
    } else {
        return false;
    }
    const double bytes = value * mult;
    if (!(bytes >= 0.0) || bytes > 1.8e19) {
        return false;
    }
    *out = (uint64_t) bytes;
    return true;
}

const struct moetier_params * moetier_params_from_strings(struct moetier_params * p, const char * store_dir, const char * policy) {
    p->store_dir = store_dir && store_dir[0] ? store_dir : nullptr;
    p->policy    = policy && policy[0] ? policy : "lru";
    return p;
}

// option name -> field, for moetier_params_set_opts
static float * moetier_params_field(struct moetier_params * p, const std::string & key) {
    if (key == "t1")       return &p->t1;
    if (key == "t2")       return &p->t2;
    if (key == "low_frac") return &p->low_frac;
    if (key == "w_lru")    return &p->w_lru;
    if (key == "w_lfu")    return &p->w_lfu;
    if (key == "w_lhu")    return &p->w_lhu;
    if (key == "w_fld")    return &p->w_fld;
    return nullptr;
}

static int32_t * moetier_params_int_field(struct moetier_params * p, const std::string & key) {
    if (key == "prefetch")   return &p->prefetch;
    if (key == "io_threads") return &p->io_threads;
    if (key == "io_uring")   return &p->io_uring;
    return nullptr;
}

static thread_local std::string g_opts_error;

const char * moetier_params_set_opts(struct moetier_params * p, const char * opts) {
    const std::string all = opts ? opts : "";
    size_t pos = 0;
    while (pos <= all.size()) {
        size_t end = all.find(',', pos);
        if (end == std::string::npos) {
            end = all.size();
        }
        std::string item = all.substr(pos, end - pos);
        pos = end + 1;
        item.erase(0, item.find_first_not_of(' '));
        item.erase(item.find_last_not_of(' ') + 1);
        if (item.empty()) {
            continue;
        }
        const size_t eq = item.find('=');
        const std::string key = item.substr(0, eq);
        float   * f = moetier_params_field(p, key);
        int32_t * n = moetier_params_int_field(p, key);
        if (eq == std::string::npos || (f == nullptr && n == nullptr)) {
            g_opts_error = format("expert cache option '%s': expected KEY=VALUE with KEY one of t1, t2, low_frac, "
                    "w_lru, w_lfu, w_lhu, w_fld, prefetch, io_threads, io_uring", item.c_str());
            return g_opts_error.c_str();
        }
        const std::string value = item.substr(eq + 1);
        if (n) {
            char * rest = nullptr;
            const long v = strtol(value.c_str(), &rest, 10);
            if (value.empty() || rest == nullptr || *rest != '\0') {
                g_opts_error = format("expert cache option %s: '%s' is not an integer", key.c_str(), value.c_str());
                return g_opts_error.c_str();
            }
            *n = (int32_t) std::max(-1L, std::min(v, 1L << 20));
            continue;
        }
        char * rest = nullptr;
        const float v = strtof(value.c_str(), &rest);
        if (value.empty() || rest == nullptr || *rest != '\0' || !(v == v)) {
            g_opts_error = format("expert cache option %s: '%s' is not a number", key.c_str(), value.c_str());
            return g_opts_error.c_str();
        }
        *f = v;
    }
    return moetier_params_check(p);
}

const char * moetier_params_check(const struct moetier_params * p) {
    auto in01 = [](float v) { return v >= 0.0f && v <= 1.0f; };
    if (!in01(p->t1) || !in01(p->t2)) {
        g_opts_error = format("expert cache thresholds t1=%g, t2=%g: both must lie in [0, 1]", p->t1, p->t2);
    } else if (p->t2 < p->t1) {
        g_opts_error = format("expert cache thresholds t1=%g > t2=%g: t1 must not exceed t2", p->t1, p->t2);
    } else if (!(p->low_frac >= 0.0f && p->low_frac < 1.0f)) {
        g_opts_error = format("expert cache low_frac=%g: must lie in [0, 1)", p->low_frac);
    } else if (!(p->w_lru >= 0.0f && p->w_lfu >= 0.0f && p->w_lhu >= 0.0f && p->w_fld >= 0.0f) ||
               p->w_lru + p->w_lfu + p->w_lhu + p->w_fld <= 0.0f) {
        g_opts_error = format("expert cache policy weights (w_lru=%g, w_lfu=%g, w_lhu=%g, w_fld=%g): must be >= 0 "
                "and not all 0", p->w_lru, p->w_lfu, p->w_lhu, p->w_fld);
    } else if (p->prefetch < 0 || p->prefetch > MOETIER_MAX_PREFETCH) {
        g_opts_error = format("expert cache prefetch=%d: must lie in [0, %d]", p->prefetch, MOETIER_MAX_PREFETCH);
    } else if (p->io_threads < 0 || p->io_threads > 64) {
        g_opts_error = format("expert cache io_threads=%d: must lie in [0, 64]", p->io_threads);
    } else if (p->io_uring != 0 && p->io_uring != 1) {
        g_opts_error = format("expert cache io_uring=%d: must be 0 or 1", p->io_uring);
    } else if (p->prefetch > 0 && p->io_threads == 0) {
        g_opts_error = format("expert cache prefetch=%d needs io_threads >= 1", p->prefetch);
    } else {
        return nullptr;
    }
    return g_opts_error.c_str();
}
