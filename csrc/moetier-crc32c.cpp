#include "moetier-crc32c.h"

#include <cstring>

#if defined(__x86_64__)
#    include <nmmintrin.h>
#elif defined(__aarch64__)
#    include <arm_acle.h>
#    include <sys/auxv.h>
#    ifndef HWCAP_CRC32
#        define HWCAP_CRC32 (1 << 7)
#    endif
#endif

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#    error "moetier-crc32c.cpp reads 8-byte words as little-endian"
#endif

namespace {

constexpr uint32_t CRC32C_POLY = 0x82f63b78u;  // Castagnoli, bit-reflected

// The hardware loop runs three independent lanes (the CRC instruction has a latency of 3 cycles and
// a throughput of 1), then joins them: the lane before is shifted over the next lane's length with
// a table (a raw CRC is linear, crc(a || b) = shift(crc(a), |b|) ^ crc(0, b)).
constexpr size_t LANE_LONG  = 8192;
constexpr size_t LANE_SHORT = 256;

struct crc32c_tables {
    uint32_t slice[8][256];        // portable: slicing-by-8, slice[k][v] = byte v followed by k zero bytes
    uint32_t shift_long[4][256];   // a raw CRC followed by LANE_LONG zero bytes, byte by byte
    uint32_t shift_short[4][256];  // ... by LANE_SHORT zero bytes
};

// GF(2) 32x32 matrices as the images of the 32 bits
uint32_t gf2_apply(const uint32_t * mat, uint32_t vec) {
    uint32_t sum = 0;
    for (int i = 0; vec != 0; ++i, vec >>= 1) {
        if (vec & 1) {
            sum ^= mat[i];
        }
    }
    return sum;
}

void gf2_compose(uint32_t * out, const uint32_t * a, const uint32_t * b) {  // out = a after b
    uint32_t tmp[32];
    for (int i = 0; i < 32; ++i) {
        tmp[i] = gf2_apply(a, b[i]);
    }
    memcpy(out, tmp, sizeof(tmp));
}

// the operator that appends n zero bytes to a raw CRC
void zeros_operator(uint32_t * op, size_t n) {
    uint32_t step[32];  // one zero bit, then squared up to one zero byte
    step[0] = CRC32C_POLY;
    for (int i = 1; i < 32; ++i) {
        step[i] = 1u << (i - 1);
    }
    for (int k = 0; k < 3; ++k) {
        gf2_compose(step, step, step);
    }
    for (int i = 0; i < 32; ++i) {
        op[i] = 1u << i;
    }
    for (; n != 0; n >>= 1) {
        if (n & 1) {
            gf2_compose(op, step, op);
        }
        gf2_compose(step, step, step);
    }
}

void shift_table(uint32_t (*table)[256], size_t n) {
    uint32_t op[32];
    zeros_operator(op, n);
    for (int k = 0; k < 4; ++k) {
        for (uint32_t v = 0; v < 256; ++v) {
            table[k][v] = gf2_apply(op, v << (8 * k));
        }
    }
}

crc32c_tables make_tables() {
    crc32c_tables t{};
    for (uint32_t v = 0; v < 256; ++v) {
        uint32_t c = v;
        for (int b = 0; b < 8; ++b) {
            c = (c & 1) ? (c >> 1) ^ CRC32C_POLY : c >> 1;
        }
        t.slice[0][v] = c;
    }
    for (int k = 1; k < 8; ++k) {
        for (uint32_t v = 0; v < 256; ++v) {
            const uint32_t prev = t.slice[k - 1][v];
            t.slice[k][v]       = (prev >> 8) ^ t.slice[0][prev & 0xff];
        }
    }
    shift_table(t.shift_long, LANE_LONG);
    shift_table(t.shift_short, LANE_SHORT);
    return t;
}

const crc32c_tables & tables() {
    static const crc32c_tables t = make_tables();
    return t;
}

inline uint32_t shift(const uint32_t (*table)[256], uint32_t crc) {
    return table[0][crc & 0xff] ^ table[1][(crc >> 8) & 0xff] ^ table[2][(crc >> 16) & 0xff] ^ table[3][crc >> 24];
}

inline uint64_t load64(const uint8_t * p) {
    uint64_t w;
    memcpy(&w, p, 8);
    return w;
}

// raw CRC (no pre/post inversion) with tables
uint32_t raw_portable(uint32_t crc, const uint8_t * p, size_t n) {
    const auto & s = tables().slice;
    for (; n >= 8; p += 8, n -= 8) {
        const uint64_t w = load64(p) ^ crc;
        crc              = s[7][w & 0xff] ^ s[6][(w >> 8) & 0xff] ^ s[5][(w >> 16) & 0xff] ^ s[4][(w >> 24) & 0xff] ^
              s[3][(w >> 32) & 0xff] ^ s[2][(w >> 40) & 0xff] ^ s[1][(w >> 48) & 0xff] ^ s[0][w >> 56];
    }
    for (; n != 0; ++p, --n) {
        crc = (crc >> 8) ^ s[0][(crc ^ *p) & 0xff];
    }
    return crc;
}

#if defined(__x86_64__)
#    define MOETIER_CRC_TARGET  __attribute__((target("sse4.2")))
#    define MOETIER_CRC64(c, w) ((uint32_t) _mm_crc32_u64((c), (w)))
#    define MOETIER_CRC8(c, b)  _mm_crc32_u8((c), (b))
#    define MOETIER_CRC_HW_NAME "sse4.2"

bool cpu_has_crc() {
    return __builtin_cpu_supports("sse4.2");
}
#elif defined(__aarch64__)
#    define MOETIER_CRC_TARGET  __attribute__((target("+crc")))
#    define MOETIER_CRC64(c, w) __crc32cd((c), (w))
#    define MOETIER_CRC8(c, b)  __crc32cb((c), (b))
#    define MOETIER_CRC_HW_NAME "armv8-crc"

bool cpu_has_crc() {
    return (getauxval(AT_HWCAP) & HWCAP_CRC32) != 0;
}
#endif

#ifdef MOETIER_CRC64
template <size_t LANE>
MOETIER_CRC_TARGET inline uint32_t lanes3(uint32_t crc, const uint8_t * p, const uint32_t (*table)[256]) {
    uint32_t c0 = crc, c1 = 0, c2 = 0;
    for (size_t i = 0; i < LANE; i += 8) {
        c0 = MOETIER_CRC64(c0, load64(p + i));
        c1 = MOETIER_CRC64(c1, load64(p + LANE + i));
        c2 = MOETIER_CRC64(c2, load64(p + 2 * LANE + i));
    }
    return shift(table, shift(table, c0) ^ c1) ^ c2;
}

MOETIER_CRC_TARGET uint32_t raw_hw(uint32_t crc, const uint8_t * p, size_t n) {
    const auto & t = tables();
    for (; n >= 3 * LANE_LONG; p += 3 * LANE_LONG, n -= 3 * LANE_LONG) {
        crc = lanes3<LANE_LONG>(crc, p, t.shift_long);
    }
    for (; n >= 3 * LANE_SHORT; p += 3 * LANE_SHORT, n -= 3 * LANE_SHORT) {
        crc = lanes3<LANE_SHORT>(crc, p, t.shift_short);
    }
    for (; n >= 8; p += 8, n -= 8) {
        crc = MOETIER_CRC64(crc, load64(p));
    }
    for (; n != 0; ++p, --n) {
        crc = MOETIER_CRC8(crc, *p);
    }
    return crc;
}
#endif

using raw_fn = uint32_t (*)(uint32_t, const uint8_t *, size_t);

raw_fn hw_or_portable() {
#ifdef MOETIER_CRC64
    if (cpu_has_crc()) {
        return raw_hw;
    }
#endif
    return raw_portable;
}

raw_fn chosen() {
    static const raw_fn fn = hw_or_portable();
    return fn;
}

}  // namespace

uint32_t moetier_crc32c(uint32_t crc, const void * data, size_t n) noexcept {
    return ~chosen()(~crc, (const uint8_t *) data, n);
}

uint32_t moetier_crc32c_with(const char * impl, uint32_t crc, const void * data, size_t n) noexcept {
    const raw_fn fn = strcmp(impl, "portable") == 0 ? raw_portable : hw_or_portable();
    return ~fn(~crc, (const uint8_t *) data, n);
}

const char * moetier_crc32c_impl() noexcept {
#ifdef MOETIER_CRC64
    if (chosen() == raw_hw) {
        return MOETIER_CRC_HW_NAME;
    }
#endif
    return "portable";
}
