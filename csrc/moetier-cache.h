#pragma once

// The expert cache: slot pools shared by the layers of one pool group, the expert id -> slot maps,
// pins, the read tasks of a layer pass, and the counters. Called from the two custom ops that the
// graph hook inserts per MoE layer (resolve, then load), and from the C API for stats.
//
//   resolve (1 thread):   ids [n_used, n_tokens] + gate weights -> high and low slots; picks the
//                         precision of each miss (HOBBIT eq. 2), victims, queues reads
//   load    (all threads): performs the queued reads, copies the slots to its output
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
};

// one queued read: a projection of one expert into one slot
struct moetier_read_task {
    const moetier_layer * layer = nullptr;
    int32_t proj   = 0;  // -1: every projection of the expert in one vectored read (file_order)
    int32_t prec   = MOETIER_HIGH;
    int32_t expert = 0;
    int32_t slot   = 0;
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

    int32_t n_slots() const { return (int32_t) slot_key.size(); }
};

class moetier_cache {
public:
    // n_slots[prec]: slots per precision (low may be 0). throws std::runtime_error
    moetier_cache(int32_t n_expert, const int32_t n_slots[2], const moetier_precision & rule,
                  const std::string & policy, const moetier_policy_weights & weights,
                  std::vector<moetier_proj> proj_shapes);

    moetier_cache(const moetier_cache &) = delete;
    moetier_cache & operator=(const moetier_cache &) = delete;
    ~moetier_cache();

    //
    // init API
    //

    void add_layer(moetier_layer * layer);
    void set_n_model_layers(int32_t n) { n_model_layers = n; }

    // the pool tensor of projection k in precision prec (nullptr if that precision has no slots)
    ggml_tensor * pool(int32_t prec, size_t k) const { return sets[prec].n_slots() ? sets[prec].tensors[k] : nullptr; }
    bool has_low() const { return sets[MOETIER_LOW].n_slots() > 0; }
    // whether resolve needs the gate weights: the rule can pick low or skip
    bool uses_weights() const { return rule.t2 < 1.0f || (rule.t1 < 1.0f && has_low()); }

    uint64_t slot_bytes(int32_t prec) const; // padded bytes of one slot over all projections
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
    void    init_set(moetier_pool_set & set, int32_t prec, int32_t n_slots, const std::string & policy,
                     const moetier_policy_weights & weights);
    void    finish_previous() noexcept; // accounts the last load and drops slots whose read failed
    int32_t take_slot(moetier_pool_set & set, const moetier_key & key) noexcept; // -1 if every slot is pinned
    bool    queue_load(moetier_layer & layer, int32_t prec, int32_t e) noexcept;
    void    set_error(const std::string & msg) noexcept;
    bool    verify(const moetier_proj & p, const moetier_read_task & t, std::string & err) const noexcept;
    moetier_policy_ctx policy_ctx(int32_t layer) const;

    const int32_t     n_expert_;
    moetier_precision rule;

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
    std::atomic<int64_t>               t_load_end_us{0};
    std::vector<moetier_aligned_buffer> bounce; // per thread index, grown on first use

    mutable std::mutex error_mutex;
    std::string        error_msg;
    std::atomic<bool>  has_error{false};
};
