#include "moetier-impl.h"

#include <chrono>
#include <cstring>

int64_t moetier_time_us() {
    return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

moetier_error_kind moetier_error_kind_of(const std::exception & e) {
    if (const moetier_exception * me = dynamic_cast<const moetier_exception *>(&e)) {
        return me->kind();
    }
    if (dynamic_cast<const std::invalid_argument *>(&e)) {
        return MOETIER_ERROR_CONFIG;
    }
    return MOETIER_ERROR_MODEL;
}

// the C API's last error is per thread, as errno is: loads on different threads do not mix
static thread_local moetier_error g_last_error;

void moetier_set_last_error(moetier_error_kind kind, const std::string & msg) {
    g_last_error.set(msg.empty() ? MOETIER_ERROR_NONE : kind, msg);
}

const char * moetier_last_error(void) {
    return g_last_error.msg.c_str();
}

enum moetier_error_kind moetier_last_error_kind(void) {
    return g_last_error.kind;
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
    uint64_t        h = 0xcbf29ce484222325ull;
    size_t          i = 0;
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
