#pragma once

// The automatic budget (MOETIER_CACHE_AUTO): what memory this process may use, and what of it is
// left for the expert cache once the model's other needs are counted. Knows nothing of llama.cpp:
// moetier_model fills the needs from the loaded model.

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

// The memory this process may use: the lowest cgroup limit on its path (v2 memory.max, v1
// memory.limit_in_bytes), and MemAvailable. root: where /proc and /sys are ("" = "/").
struct moetier_memory {
    uint64_t    cgroup_limit = 0;  // 0: no cgroup limit found
    std::string cgroup_source;     // the file it comes from, with "cgroup v1"/"cgroup v2"
    std::string cgroup_dir;        // the directory of that file
    bool        cgroup_v2 = false;
    uint64_t    available = 0;     // MemAvailable (0 if /proc/meminfo has none)
    uint64_t    total     = 0;     // MemTotal
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
// cache then never evicts). 0 if nothing is left. note: the numbers, for the log; room (may be
// nullptr): what is left before the margin is taken.
uint64_t moetier_budget_auto(const moetier_memory &       mem,
                             const moetier_budget_needs & needs,
                             uint64_t                     all_experts,
                             std::string &                note,
                             uint64_t *                   room = nullptr);

// The memory an elastic expert cache may still take, read while it runs (mem: moetier_memory_read
// just before, as a limit may change at run time): the lowest cgroup limit minus that group's usage
// plus its inactive page cache (which the kernel reclaims first), and MemAvailable, whichever is
// lower. false if neither could be read.
bool moetier_memory_headroom(const std::string & root, const moetier_memory & mem, uint64_t & out);

// How far the free memory of an elastic cache lies from its band [margin, 2 margin]: the bytes to
// take (> 0: free - 1.5 margin, when free > 2 margin) or to give back (< 0: free - 1.5 margin, when
// free < margin), 0 inside the band. free = headroom - uncommitted (memory the cache's empty slots
// in use will still take).
int64_t moetier_elastic_delta(uint64_t headroom, uint64_t uncommitted, uint64_t margin);

// the free memory an elastic cache leaves: 1/32 of the cgroup limit or of MemTotal (the lower), at
// least 16 MiB, plus reserve
uint64_t moetier_elastic_margin(const moetier_memory & mem, uint64_t reserve);

// The elastic budget of the expert caches of this process: they take memory the limit leaves free
// beyond their budgets (up to every expert) and give it back, down to their budgets, when free memory
// runs short, keeping the free memory in [margin, 2 margin]. One per process (shared()): the caches
// of several models share the free memory. Polled from the caches' layer passes; reads the memory
// files at most once per interval. Pools are the caches' high-precision slot pools. Thread-safe.
class moetier_elastic {
  public:
    static std::shared_ptr<moetier_elastic> shared();

    explicit moetier_elastic(std::string root = "", int64_t interval_us = 100000);

    // a pool that may take capacity_bytes at most; reserve: memory to keep free beside the margin
    // (its model's reserve, and the KV cache and compute buffers it may still touch). Its index
    int32_t add_pool(uint64_t capacity_bytes, uint64_t reserve);

    void remove_pool(int32_t i);

    // The bytes pool i should take (> 0) or give back (< 0) now, 0 between checks. uncommitted: the
    // bytes of its slots in use whose memory was never written (the pool takes them as it fills).
    int64_t poll(int32_t i, uint64_t uncommitted, int64_t now_us);

    // the free memory kept at the last check: the margin and the pools' reserves
    uint64_t margin() const { return margin_.load(std::memory_order_relaxed); }

    uint64_t last_headroom() const { return headroom.load(std::memory_order_relaxed); }

  private:
    struct pool {
        uint64_t capacity    = 0;
        uint64_t reserve     = 0;
        uint64_t uncommitted = 0;
        int64_t  pending     = 0;
        bool     live        = false;
    };

    std::mutex            mu;
    std::string           root;
    int64_t               interval_us;
    int64_t               next_us = 0;
    std::atomic<uint64_t> margin_{ 0 };
    std::atomic<uint64_t> headroom{ 0 };
    std::vector<pool>     pools;
};
