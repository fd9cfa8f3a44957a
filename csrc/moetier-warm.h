#pragma once

// Warm start: the cache's hot state across launches. The sidecar holds, per served layer and
// expert, how often it was used (counts decayed across launches), when it was last used, and
// whether a slot held it. At load the hottest experts of each pool group get slots (bookkeeping on
// the loading thread, before any decode; the slots are held against eviction) and one background
// thread reads them in layer order, which is the order the first token needs them; a layer that
// resolves before its expert's read is done waits for that read (moetier_cache::resolve).

#include "moetier-impl.h"
#include "moetier-layer.h"

#include <atomic>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

// the sidecar's content
struct moetier_warm_state {
    uint64_t              identity = 0;  // model + store: a sidecar of another one is stale
    int32_t               n_expert = 0;
    std::vector<int32_t>  layers;        // model layer index of each served layer
    // [layer][expert], layers in the order above
    std::vector<uint32_t> uses;
    std::vector<uint64_t> last;
    std::vector<uint8_t>  resident;
};

// Reads path; false + why (missing, corrupt, stale: of another model/store or shape).
bool moetier_warm_load(const std::string &          path,
                       uint64_t                     identity,
                       const std::vector<int32_t> & layers,
                       int32_t                      n_expert,
                       moetier_warm_state &         out,
                       std::string &                why);

// Writes state to path through a temporary file renamed over it; false + err.
bool moetier_warm_save(const std::string & path, const moetier_warm_state & state, std::string & err);

// The background reads of one load's warm start.
class moetier_warm {
  public:
    struct entry {
        const moetier_layer * layer  = nullptr;
        int32_t               expert = 0;
        int32_t               slot   = 0;
    };

    // entries: slots already taken in high-precision pools, in the order to read them
    explicit moetier_warm(std::vector<entry> entries);
    ~moetier_warm();  // stops after the read in progress and joins

    moetier_warm(const moetier_warm &)             = delete;
    moetier_warm & operator=(const moetier_warm &) = delete;

    void start();

    // stops after the read in progress and joins the thread (entries never read stay unfinished)
    void stop();

    int32_t size() const { return (int32_t) entries.size(); }

    const entry & get(int32_t i) const { return entries[i]; }

    // entry i has been read (true) or its read failed (false); blocks until then
    bool wait(int32_t i) const;

    // entry i is done (read or failed), without blocking
    bool finished(int32_t i) const { return state[i].load(std::memory_order_acquire) != 0; }

    bool failed(int32_t i) const { return state[i].load(std::memory_order_acquire) == 2; }

    int32_t n_read() const { return n_read_.load(std::memory_order_relaxed); }

  private:
    void run();

    std::vector<entry>                     entries;
    std::unique_ptr<std::atomic<int8_t>[]> state;  // per entry: 0 pending, 1 read, 2 failed
    std::atomic<int32_t>                   n_read_{ 0 };
    std::atomic<bool>                      stopping{ false };
    std::thread                            worker;
};
