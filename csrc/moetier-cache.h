#pragma once

// The expert cache: slot pools shared by the layers of one pool group, the expert id -> slot map,
// pins, the read tasks of a layer pass, and the counters. Called from the two custom ops that the
// graph hook inserts per MoE layer (resolve, then load), and from the C API for stats.
//
//   resolve (1 thread):   ids [n_expert_used, n_tokens] -> slots; picks victims, queues reads
//   load    (all threads): performs the queued reads, copies the slots to its output
//   mul_mat_id on the pool tensors with the slots as ids
//
// Slots are pinned from their layer's resolve until the next resolve of the same group: layers run
// in order, so by then the previous layer's mul_mat_ids are done.
//
// Slots are shared by the group's layers but softly partitioned: a miss evicts from the layer that
// holds the most slots above its fair share (n_slots / n_layers), and the policy picks the victim
// among that layer's slots. Layers are visited in a fixed cycle, so a plain global recency order
// would evict exactly the layer that runs next (0% hits whenever one token's experts exceed the
// cache); a prefill ubatch may still borrow slots beyond its share.

#include "moetier-io.h"
#include "moetier-store.h"
#include "policies/policies.h"

#include "ggml-backend.h"
#include "ggml.h"

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

class moetier_cache;

// one served projection (gate, up, down or gate_up) of one layer
struct moetier_proj {
    std::string   name;
    ggml_tensor * meta  = nullptr; // the model's tensor, created without data
    ggml_tensor * pool  = nullptr; // the group's pool for this projection [ne0, ne1, n_slots]

    const moetier_file       * file  = nullptr; // GGUF or store data file
    const moetier_store_proj * store = nullptr; // per-expert offsets and checksums when reading a store
    uint64_t offset = 0; // GGUF: file offset of expert 0
    uint64_t bytes  = 0; // unpadded bytes of one expert

    uint64_t expert_offset(int32_t e) const {
        return store ? store->offset_high[e] : offset + (uint64_t) e * bytes;
    }
};

struct moetier_layer_counters {
    uint64_t n_lookups    = 0;
    uint64_t n_hits       = 0;
    uint64_t n_misses     = 0;
    uint64_t n_bytes_read = 0;
    uint64_t read_us      = 0;
};

// long-lived per-layer state: the custom ops' userdata
struct moetier_layer {
    int32_t         il    = -1;
    moetier_cache * cache = nullptr;
    std::vector<moetier_proj> projs;   // in the group's projection order
    std::vector<int32_t>      file_order; // projs in file order when, for every expert, they lie back to back
                                          // in one file (a store): one vectored read per expert; else empty
    std::vector<int32_t>      slot_of; // [n_expert] slot holding the expert, -1 if not cached
    moetier_layer_counters    counters;
};

// one queued read: a projection of one expert into one slot
struct moetier_read_task {
    const moetier_layer * layer = nullptr;
    int32_t proj   = 0;  // -1: every projection of the expert in one vectored read (file_order)
    int32_t expert = 0;
    int32_t slot   = 0;
    bool    failed = false;
};

class moetier_cache {
public:
    // throws std::runtime_error
    moetier_cache(int32_t n_expert, int32_t n_slots, moetier_policy_ptr policy, std::vector<moetier_proj> proj_shapes);

    moetier_cache(const moetier_cache &) = delete;
    moetier_cache & operator=(const moetier_cache &) = delete;

    //
    // init API
    //

    void add_layer(moetier_layer * layer);

    // the pool tensor of projection k, for the graph
    ggml_tensor * pool(size_t k) const { return pools[k]; }

    uint64_t slot_bytes() const; // padded bytes of one slot over all projections
    uint64_t pool_bytes() const { return buf_size; }
    int32_t  n_slots()    const { return (int32_t) slot_key.size(); }
    int32_t  n_expert()   const { return n_expert_; }

    //
    // compute API: custom op bodies, noexcept
    //

    // ids: [n_used, n_tokens] expert ids with row stride ids_nb1 bytes; out: slots, contiguous.
    // During warmup nothing is read: misses map to -1 (a zero row) instead.
    void resolve(moetier_layer & layer, const int32_t * ids, int64_t n_used, int64_t n_tokens, size_t ids_nb1,
                 int32_t * out, bool warmup) noexcept;

    // performs the reads queued by the last resolve, thread ith of nth
    void load(int ith, int nth) noexcept;

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
    void    finish_previous() noexcept; // accounts the last load and drops slots whose read failed
    int32_t take_slot(const moetier_key & key) noexcept;
    void    set_error(const std::string & msg) noexcept;
    bool    verify(const moetier_proj & p, const moetier_read_task & t, std::string & err) const noexcept;

    const int32_t n_expert_;

    moetier_policy_ptr policy;

    std::vector<moetier_proj> shapes;        // type and shape template per projection
    std::vector<uint64_t>     slot_stride;   // [proj] padded bytes of one slot [TAG_MOETIER_ALIGN]

    moetier_aligned_buffer       mem;       // the pools' memory, 4096-aligned
    size_t                       buf_size = 0;
    ggml_backend_buffer_t        buf = nullptr;
    ggml_context               * ctx = nullptr;
    std::vector<ggml_tensor *>   pools;      // [proj]

    std::vector<moetier_key>     slot_key;   // [n_slots] what each slot holds
    std::vector<uint8_t>         pinned;     // [n_slots]
    int32_t                      n_pinned = 0; // slots pinned by the layer being resolved
    std::vector<int32_t>         free_slots; // never used yet
    std::vector<moetier_layer *> layers;     // by model layer index, nullptr if not in this group
    std::vector<int32_t>         held;       // by model layer index: slots holding that layer's experts
    int32_t                      n_layers = 0;
    std::vector<uint8_t>         mask;       // scratch for victim(): 1 = not a candidate

    uint64_t tick = 0;

    // the last resolve's reads; sized up front to one layer's worth
    std::vector<moetier_read_task>     tasks;
    int32_t                            n_tasks = 0;
    moetier_layer                    * task_layer = nullptr;
    int64_t                            t_resolve_us = 0;
    std::atomic<int64_t>               t_load_end_us{0};
    std::vector<moetier_aligned_buffer> bounce; // per thread index, grown on first use

    mutable std::mutex error_mutex;
    std::string        error_msg;
    std::atomic<bool>  has_error{false};

    friend struct moetier_model;
public:
    ~moetier_cache();
};
