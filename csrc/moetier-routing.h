#pragma once

// Routing from a trace, for benchmarks only (MOETIER_ROUTING_TRACE=FILE): each served layer's expert
// choice is taken from a recorded routing trace of a trained MoE instead of the model's router, so a
// random-weight model of the trace's geometry is cached, read and computed as the real model would be
// (its text is meaningless). The file (written by bench/gpu.py from a trace.npz):
//   "MTRT", uint32 version 1, uint32 n_tokens, n_layers, n_used, n_expert, then uint16 ids
//   [n_tokens][n_layers][n_used], little-endian.
// Decode and prompts walk the trace's tokens in order, wrapping around at its end.

#include <cstdint>
#include <string>
#include <vector>

class moetier_routing {
  public:
    // throws std::runtime_error naming the file: unreadable, not a trace, ids out of range
    explicit moetier_routing(const std::string & path);

    const std::string & path() const { return path_; }

    int32_t n_layers() const { return n_layers_; }

    int32_t n_used() const { return n_used_; }

    int32_t n_expert() const { return n_expert_; }

    // the ids of served layer li (0 = the first) for a ubatch of n_tokens: [n_tokens][n_used], valid
    // until the next call. The first served layer of a ubatch moves the trace on by n_tokens first.
    const int32_t * ids(int32_t li, int64_t n_tokens);

  private:
    std::string           path_;
    int32_t               n_tokens_ = 0;
    int32_t               n_layers_ = 0;
    int32_t               n_used_   = 0;
    int32_t               n_expert_ = 0;
    std::vector<uint16_t> data;
    int64_t               cursor = 0;  // the trace token of the current ubatch's first token
    int64_t               next   = 0;  // ... of the next ubatch
    std::vector<int32_t>  scratch;
};
