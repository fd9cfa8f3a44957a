#pragma once

// The automatic budget (MOETIER_CACHE_AUTO): what memory this process may use, and what of it is
// left for the expert cache once the model's other needs are counted. Knows nothing of llama.cpp:
// moetier_model fills the needs from the loaded model.

#include <cstdint>
#include <string>

// The memory this process may use: the lowest cgroup limit on its path (v2 memory.max, v1
// memory.limit_in_bytes), and MemAvailable. root: where /proc and /sys are ("" = "/").
struct moetier_memory {
    uint64_t    cgroup_limit = 0;  // 0: no cgroup limit found
    std::string cgroup_source;     // the file it comes from, with "cgroup v1"/"cgroup v2"
    uint64_t    available = 0;     // MemAvailable (0 if /proc/meminfo has none)
};

moetier_memory moetier_memory_read(const std::string & root);

// RssAnon of /proc/self/status under root: memory of this process that no page-out frees
uint64_t moetier_process_anon_bytes(const std::string & root);

// what the process needs beside the expert cache
struct moetier_budget_needs {
    uint64_t weights = 0;  // resident non-expert weights
    uint64_t kv      = 0;  // KV cache of n_ctx tokens
    int32_t  n_ctx   = 0;
    uint64_t compute = 0;  // compute buffers (estimate)
    uint64_t process = 0;  // the process's own memory before the model loaded
    uint64_t reserve = 0;  // asked for by the user
    uint64_t io      = 0;  // staging buffers of io_uring reads from a GGUF
};

// The budget: the usable memory (the cgroup limit minus the process's own memory, or MemAvailable,
// whichever is lower) minus the needs and a margin (1/32, at least 64 MiB), at most all_experts (the
// cache then never evicts). 0 if nothing is left. note: the numbers, for the log.
uint64_t moetier_budget_auto(const moetier_memory &       mem,
                             const moetier_budget_needs & needs,
                             uint64_t                     all_experts,
                             std::string &                note);
