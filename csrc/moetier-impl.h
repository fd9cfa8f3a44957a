#pragma once

// Internal helpers shared by csrc/: logging into llama.cpp's log stream, timing, errors.

#include "llama-impl.h"

#include <cstdint>
#include <string>

// moetier logs through llama.cpp's callback (llama_log_set), so both share one stream
#define MOETIER_LOG_INFO(...)  llama_log_internal(GGML_LOG_LEVEL_INFO , __VA_ARGS__)
#define MOETIER_LOG_WARN(...)  llama_log_internal(GGML_LOG_LEVEL_WARN , __VA_ARGS__)
#define MOETIER_LOG_ERROR(...) llama_log_internal(GGML_LOG_LEVEL_ERROR, __VA_ARGS__)
#define MOETIER_LOG_DEBUG(...) llama_log_internal(GGML_LOG_LEVEL_DEBUG, __VA_ARGS__)

// monotonic microseconds
int64_t moetier_time_us();

// thread-local message behind moetier_last_error()
void moetier_set_last_error(const std::string & msg);

// human-readable byte count: "3.25 MiB"
std::string moetier_format_bytes(uint64_t n);

// 64-bit checksum of a byte range (FNV-1a over 8-byte words, then the tail bytes): cheap next to
// the read that precedes it, and enough to catch a torn or stale store
uint64_t moetier_checksum(const void * data, size_t n);

// [TAG_MOETIER_ALIGN] store offsets, slot strides and O_DIRECT transfers use this alignment
constexpr size_t MOETIER_ALIGN = 4096;

static inline uint64_t moetier_align_up(uint64_t n, uint64_t a = MOETIER_ALIGN) {
    return (n + a - 1) / a * a;
}
