#pragma once

// Internal helpers shared by csrc/: logging into llama.cpp's log stream, timing, errors with a kind,
// byte sizes, checksums, alignment. No public API is implemented here.

#include "llama-impl.h"
#include "moetier.h"

#include <cstdint>
#include <stdexcept>
#include <string>

// moetier logs through llama.cpp's callback (llama_log_set), so both share one stream
#define MOETIER_LOG_INFO(...)  llama_log_internal(GGML_LOG_LEVEL_INFO, __VA_ARGS__)
#define MOETIER_LOG_WARN(...)  llama_log_internal(GGML_LOG_LEVEL_WARN, __VA_ARGS__)
#define MOETIER_LOG_ERROR(...) llama_log_internal(GGML_LOG_LEVEL_ERROR, __VA_ARGS__)
#define MOETIER_LOG_DEBUG(...) llama_log_internal(GGML_LOG_LEVEL_DEBUG, __VA_ARGS__)

// monotonic microseconds
int64_t moetier_time_us();

// an error and its kind, as the C API reports it (moetier_last_error, moetier_model_error)
struct moetier_error {
    moetier_error_kind kind = MOETIER_ERROR_NONE;
    std::string        msg;

    void set(moetier_error_kind k, std::string m) {
        kind = k;
        msg  = std::move(m);
    }
};

// an exception of csrc/ that carries its kind; a plain std::runtime_error counts as MOETIER_ERROR_MODEL
class moetier_exception : public std::runtime_error {
  public:
    moetier_exception(moetier_error_kind kind, const std::string & msg) : std::runtime_error(msg), kind_(kind) {}

    moetier_error_kind kind() const { return kind_; }

  private:
    moetier_error_kind kind_;
};

// the kind of e: its own for a moetier_exception, CONFIG for std::invalid_argument, else MODEL
moetier_error_kind moetier_error_kind_of(const std::exception & e);

// thread-local error behind moetier_last_error() / moetier_last_error_kind()
void moetier_set_last_error(moetier_error_kind kind, const std::string & msg);

// human-readable byte count in powers of 1024: "3.25 MiB" (moetier_format_size)
std::string moetier_format_bytes(uint64_t n);

// 64-bit checksum of a byte range (FNV-1a over 8-byte words, then the tail bytes): cheap next to
// the read that precedes it, and enough to catch a torn or stale store
uint64_t moetier_checksum(const void * data, size_t n);

// [TAG_MOETIER_ALIGN] store offsets, slot strides and O_DIRECT transfers use this alignment
constexpr size_t MOETIER_ALIGN = 4096;

static inline uint64_t moetier_align_up(uint64_t n, uint64_t a = MOETIER_ALIGN) {
    return (n + a - 1) / a * a;
}
