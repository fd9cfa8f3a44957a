#pragma once

// The expert cache: slot pools shared by the layers of one pool group, the expert id -> slot maps,
// pins, the read tasks of a layer pass, and the counters. Called from the two custom ops that the
// graph hook inserts per MoE layer (resolve, then load), and from the C API for stats.
//
//   resolve (1 thread):   ids [n_used, n_tokens] + gate weights -> high and low slots; picks the
//                         precision of each miss (HOBBIT eq. 2), victims, queues reads; with
//                         io_uring the kernel starts them right away
//   (the graph hook moves the nodes that do not need the experts, e.g. a shared expert, here: they
//    compute while the reads run)
//   load    (all threads): performs the queued reads (or, with io_uring, thread 0 waits for them),
//                         copies the slots to its output
//   mul_mat_id on the high pools with the high slots (+ on the low pools with the low slots)
//
// A group has a high-precision pool set and, with a store and low_frac > 0, a low-precision one;
// each has its own slots, pins and policy. Slots are pinned from their layer's resolve until the
// next resolve of the same group: layers run in order, so by then the previous layer's mul_mat_ids
// are done.
//
// Unless the policy weighs layer distances itself, the slots of a pool are softly partitioned: a
// miss evicts from the layer that holds the most slots above its fair share (n_slots / n_layers),
// and the policy picks the victim among that layer's slots. Layers are visited in a fixed cycle, so
// a plain global recency order would evict exactly the layer that runs next (0% hits whenever one
// token's experts exceed the cache); a prefill ubatch may still borrow slots beyond its share.

#include "moetier-io.h"
#include "moetier-iopool.h"
#include "moetier-store.h"
#include "moetier.h"
#include "policies/policies.h"

#include "ggml-backend.h"
#include "ggml.h"

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

class moetier_cache;

enum moetier_prec : int32_t {
    MOETIER_HIGH = 0,
    MOETIER_LOW  = 1,
};

// one served projection (gate, up, down or gate_up) of one layer
struct moetier_proj {
    std::string   name;
    ggml_tensor * meta  = nullptr;        // the model's tensor, created without data
    ggml_tensor * pool[2] = { nullptr, nullptr }; // the group's pool per precision [ne0, ne1, n_slots]

    const moetier_file       * file  = nullptr; // GGUF or store data file
    const moetier_store_proj * store = nullptr; // per-expert offsets and checksums when reading a store
    uint64_t offset = 0; // GGUF: file offset of expert 0
    uint64_t bytes  = 0; // unpadded bytes of one high-precision expert

    uint64_t expert_offset(int32_t e, int32_t prec) const {
        if (store) {
            return prec == MOETIER_LOW ? store->offset_low[e] : store->offset_high[e];
        }
        return offset + (uint64_t) e * bytes;
    }
    uint64_t expert_bytes(int32_t prec) const {
        return prec == MOETIER_LOW ? store->bytes_low : bytes;
    }
    uint64_t expert_checksum(int32_t e, int32_t prec) const {
        return prec == MOETIER_LOW ? store->checksum_low[e] : store->checksum_high[e];
    }
};

struct moetier_layer_counters {
    uint64_t n_lookups    = 0;
    uint64_t n_hits       = 0;
    uint64_t n_misses     = 0;
    uint64_t n_bytes_read = 0;
    uint64_t read_us      = 0;
    uint64_t n_hits_low   = 0;
    uint64_t n_loads_high = 0;
    uint64_t n_loads_low  = 0;
    uint64_t n_skipped    = 0;
    uint64_t n_bytes_low  = 0;

    moetier_layer_counters & operator+=(const moetier_layer_counters & o) {
        n_lookups    += o.n_lookups;
        n_hits       += o.n_hits;
        n_misses     += o.n_misses;
        n_bytes_read += o.n_bytes_read;
        read_us      += o.read_us;
        n_hits_low   += o.n_hits_low;
        n_loads_high += o.n_loads_high;
        n_loads_low  += o.n_loads_low;
        n_skipped    += o.n_skipped;
        n_bytes_low  += o.n_bytes_low;
        return *this;
    }
};

// long-lived per-layer state: the custom ops' userdata
struct moetier_layer {
    int32_t         il    = -1;
    moetier_cache * cache = nullptr;
    std::vector<moetier_proj> projs;         // in the group's projection order
    std::vector<int32_t>      file_order[2]; // per precision: projs in file order when, for every expert, they
                                             // lie back to back in one file (a store): one vectored read per
                                             // expert; else empty
    std::vector<int32_t>      slot_of[2];    // per precision [n_expert]: slot holding the expert, -1 if none
    moetier_layer_counters    counters;

    // prefetch (HOBBIT sec. 3.3): the served layers after this one in the same pool group (at most
    // p, consecutive), their routers stacked [n_embd, next.size() * n_expert] (F32), the slots that
    // earlier layers prefetched or held for this one, and the predictions made for it per distance
    std::vector<moetier_layer *>   next;
    ggml_tensor *                  router_stack = nullptr;
    std::vector<std::pair<int32_t, int32_t>> prefetched; // (prec, slot)
    std::vector<std::vector<uint8_t>> pred_set;  // [distance - 1][n_expert]
    std::vector<uint64_t>             pred_pass; // [distance - 1] pass the prediction was made in
    std::vector<int32_t>              pred_top1; // [distance - 1]
};

// one queued read: a projection of one expert into one slot
struct moetier_read_task {
    const moetier_layer * layer = nullptr;
    int32_t proj   = 0;  // -1: every projection of the expert in one vectored read (file_order)
    int32_t prec   = MOETIER_HIGH;
    int32_t expert = 0;
    int32_t slot   = 0;
    int32_t io_id  = -1; // io_uring task reading it, -1: the load op reads it
    bool    failed = false;
};

// the precision rule of a cache (HOBBIT eq. 2)
struct moetier_precision {
    float t1 = 1.0f;
    float t2 = 1.0f;
};

// What a token needs from each of its selected experts, from their gate weights: level 2 = high,
// 1 = low, 0 = may be skipped. Ranked by weight (ties: the earlier k first); the score of the i-th is
// the normalised weight ranked above it; the top-1 is always high. weights == nullptr or a zero
// sum: all high. Exposed for tests.
void moetier_precision_levels(const moetier_precision & rule, const float * weights, int32_t n_used, uint8_t * levels);

// HOBBIT's unimportance score of each selected expert: the normalised |weight| ranked above it (0 for
// the top-1; ties: the earlier k first; all 0 for a zero sum)
void moetier_precision_scores(const float * weights, int32_t n_used, float * scores);

// the slots of one precision of a pool group
struct moetier_pool_set {
    int32_t                   prec = MOETIER_HIGH;
    std::vector<uint64_t>     stride;     // [proj] padded bytes of one slot [TAG_MOETIER_ALIGN]
    moetier_aligned_buffer    mem;        // the pools' memory, 4096-aligned
    size_t                    buf_size = 0;
    ggml_backend_buffer_t     buf = nullptr;
    std::vector<ggml_tensor *> tensors;   // [proj]

    moetier_policy_ptr           policy;
    std::vector<moetier_key>     slot_key;   // [n_slots] what each slot holds
    std::vector<uint8_t>         pinned;     // [n_slots]
    int32_t                      n_pinned = 0; // slots pinned by the layer being resolved
    std::vector<int32_t>         free_slots; // never used yet
    std::vector<int32_t>         held;       // by model layer index: slots holding that layer's experts
    std::vector<uint8_t>         mask;       // scratch for victim(): 1 = not a candidate
    std::vector<int32_t>         pf_task;    // [n_slots] io task reading into the slot, -1 if none
    std::vector<uint8_t>         pf_hold;    // [n_slots] held for a later layer by a prediction
    std::vector<int32_t>         cand;       // scratch: candidate slots per layer

    int32_t n_slots() const { return (int32_t) slot_key.size(); }
};

class moetier_cache {
public:
    // n_slots[prec]: slots per precision (low may be 0). simulate: no memory and no pool tensors, for
    // trace replay (resolve does all the bookkeeping; nothing is read). throws std::runtime_error
    moetier_cache(int32_t n_expert, const int32_t n_slots[2], const moetier_precision & rule,
                  const std::string & policy, const moetier_policy_weights & weights,
                  std::vector<moetier_proj> proj_shapes, bool simulate = false);

    moetier_cache(const moetier_cache &) = delete;
    moetier_cache & operator=(const moetier_cache &) = delete;
    ~moetier_cache();

    //
    // init API
    //

    void add_layer(moetier_layer * layer);
    void set_n_model_layers(int32_t n) { n_model_layers = n; }
    // the model's reads off the compute threads (shared by its groups): with io_uring, on-demand
    // reads start at resolve; I/O threads or io_uring serve prefetch. nullptr: none
    void set_io(moetier_io_pool * pool) {
        io = pool;
        io_bounce.resize(pool ? pool->n_threads() : 0);
    }

    // the pool tensor of projection k in precision prec (nullptr if that precision has no slots)
    ggml_tensor * pool(int32_t prec, size_t k) const { return k < sets[prec].tensors.size() ? sets[prec].tensors[k] : nullptr; }
    bool has_low() const { return sets[MOETIER_LOW].n_slots() > 0; }
    // whether resolve needs the gate weights: the rule can pick low or skip
    bool uses_weights() const { return rule.t2 < 1.0f || (rule.t1 < 1.0f && has_low()); }

    uint64_t slot_bytes(int32_t prec) const; // padded bytes of one slot over all projections
    uint64_t slot_bytes_unpadded(int32_t prec) const; // bytes of one expert over all projections
    uint64_t pool_bytes() const { return sets[0].buf_size + sets[1].buf_size; }
    int32_t  n_slots(int32_t prec) const { return sets[prec].n_slots(); }
    int32_t  n_expert() const { return n_expert_; }

    //
    // compute API: custom op bodies, noexcept
    //

    // ids: [n_used, n_tokens] expert ids with row stride ids_nb1 bytes; weights: their gate weights
    // [n_used, n_tokens] with row stride w_nb1 (nullptr: all high). out: [n_used, n_tokens, 1 or 2]
    // contiguous: high slots, then (if the group has low slots) low slots; -1 where that precision
    // is not used. During warmup nothing is read: misses map to -1 (a zero row) instead.
    void resolve(moetier_layer & layer, const int32_t * ids, const float * weights, int64_t n_used, int64_t n_tokens,
                 size_t ids_nb1, size_t w_nb1, int32_t * out, bool warmup) noexcept;

    // performs the reads queued by the last resolve, thread ith of nth; waits for prefetches of
    // experts the layer needs that are still being read
    void load(int ith, int nth) noexcept;

    // Layer-level adaptive prefetch, after layer's load: logits [next.size() * n_expert, n_tokens]
    // (row stride nb1) are the stacked routers of the next layers on this layer's gate input. Walks
    // forward while the predicted experts are cached (holding them), and queues background reads for
    // the first layer with a missing one, in the precision the rule gives the predicted weights.
    void prefetch(moetier_layer & layer, const float * logits, int64_t n_tokens, size_t nb1) noexcept;

    // an I/O thread's read of a task (a prefetch, or a read queued by resolve)
    bool io_read(const moetier_io_task & task, int thread_id, std::string & err) noexcept;
    // io_uring: the task as one vectored read into its slot, and the checks once it is read
    bool io_prep(const moetier_io_task & task, moetier_io_vec_read & rd, std::string & err) const noexcept;
    bool io_finish(const moetier_io_task & task, std::string & err) noexcept;

    void add_prefetch_stats(moetier_prefetch_stats & out) const;
    void reset_prefetch_stats();

    //
    // stats / control
    //

    void reset_sequence();

    // accounts the last layer pass (read time, failed reads); call between decodes before reading counters
    void sync() noexcept;

    // first read error since clear_error, "" if none
    std::string error() const;
    void        clear_error();
    bool        failed() const { return has_error.load(std::memory_order_relaxed); }

private:
    void    init_set(moetier_pool_set & set, int32_t prec, int32_t n_slots, const std::string & policy,
                     const moetier_policy_weights & weights);
    void    init_slots(moetier_pool_set & set, int32_t n_slots);
    void    finish_previous() noexcept; // accounts the last load and drops slots whose read failed
    int32_t take_slot(moetier_pool_set & set, const moetier_key & key) noexcept; // -1 if every slot is pinned
    bool    queue_load(moetier_layer & layer, int32_t prec, int32_t e) noexcept;
    void    queue_read(moetier_layer & layer, int32_t prec, int32_t e, int32_t s) noexcept;
    void    start_reads() noexcept; // hands the queued reads to the I/O threads, if any
    void    wait_prefetched() noexcept; // load op, thread 0: prefetches of this layer still being read
    void    mark_load_end() noexcept;
    bool    read_task(const moetier_read_task & t, moetier_aligned_buffer & bb, std::string & err) const noexcept;
    // every projection of expert e into slot s (one vectored read when the store allows)
    bool    read_expert(const moetier_layer & l, int32_t prec, int32_t e, int32_t s, moetier_aligned_buffer & bb,
                        std::string & err) const noexcept;
    bool    use_prefetched(moetier_layer & layer, int32_t prec, int32_t e, int32_t s) noexcept; // false: read it now
    // the cached version of expert e that a need (see resolve) would use: a high one always, a low
    // one for low and skip needs; false if none
    static bool cached_version(const moetier_layer & layer, int32_t e, uint8_t need, int32_t & prec, int32_t & s) noexcept;
    void    settle_prefetched(moetier_layer & layer) noexcept;  // after the needs of layer are resolved
    void    settle_zombies() noexcept;
    void    drop_slot(moetier_pool_set & set, int32_t s) noexcept; // forget what the slot holds
    void    check_predictions(const moetier_layer & layer, const int32_t * ids, int64_t n_used) noexcept;
    void    set_error(const std::string & msg) noexcept;
    bool    verify(const moetier_proj & p, const moetier_read_task & t, std::string & err) const noexcept;
    moetier_policy_ctx policy_ctx(int32_t layer) const;

    const int32_t     n_expert_;
    moetier_precision rule;
    bool              simulate = false;

    std::vector<moetier_proj>    shapes;   // type and shape template per projection (from the first layer)
    ggml_context               * ctx = nullptr;
    moetier_pool_set             sets[2];
    std::vector<moetier_layer *> layers;   // by model layer index, nullptr if not in this group
    int32_t                      n_layers = 0;
    int32_t                      n_model_layers = 1;

    // clocks of the policies
    uint64_t tick       = 0;
    uint64_t seq_tick   = 0;
    uint64_t pass       = 1;
    uint64_t seq_pass   = 1;
    int32_t  last_layer = -1;

    // scratch of resolve, sized to one layer's experts
    std::vector<uint8_t> need;   // [n_expert] 0 not selected, 1 skip-level, 2 low, 3 high
    std::vector<uint8_t> levels; // [n_used]

    // the last resolve's reads; sized up front to one layer's worth per precision
    std::vector<moetier_read_task>     tasks;
    int32_t                            n_tasks = 0;
    moetier_layer                    * task_layer = nullptr;
    int64_t                            t_resolve_us = 0;
    std::atomic<int64_t>               t_load_begin_us{0};
    bool                               load_done = false; // the load op ran for the last resolve (thread 0)
    std::atomic<int64_t>               t_load_end_us{0};
    std::vector<moetier_aligned_buffer> bounce; // per thread index, grown on first use

    // prefetch
    moetier_io_pool *                  io = nullptr;
    struct moetier_wait { int32_t id; int32_t prec; int32_t slot; bool failed; };
    std::vector<moetier_wait>          wait_ids;  // io tasks the current layer's load must wait for
    int32_t                            n_used_last = 0;
    std::vector<std::pair<int32_t, int32_t>> zombies; // (prec, slot) unneeded prefetches still being read
    std::vector<moetier_aligned_buffer> io_bounce; // per I/O thread
    std::vector<uint8_t>               pred_need; // scratch [n_expert]
    std::vector<float>                 pred_w;    // scratch [n_expert]: highest predicted weight
    std::vector<int32_t>               pred_rank; // scratch: predicted experts, surest first
    moetier_prefetch_stats             pf = {};   // resolve-side counters (thread 0)
    std::atomic<uint64_t>              pf_bytes_read{0};

    mutable std::mutex error_mutex;
    std::string        error_msg;
    std::atomic<bool>  has_error{false};
};
