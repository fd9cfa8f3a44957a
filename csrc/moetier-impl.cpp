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
