#pragma once

// One slot pool: the slots of one precision of a pool group, their memory and their bookkeeping,
// as llama_kv_cells is to llama_kv_cache. Every change of what a slot holds goes through take() and
// drop(), which keep the expert -> slot map, the slot -> expert keys, the per-layer counts and the
// policy in agreement. The memory is host memory today; a device tier keeps the same bookkeeping.
//
// A slot is evictable unless it is pinned (the layer being resolved uses it), has a prefetch read
// in flight (reader), or is held for a later layer by a prediction. Unless the policy weighs layer
// distances itself, the slots are softly partitioned: a miss evicts from the layer that holds the
// most slots above its fair share (n_slots / n_layers) and the policy picks among that layer's
// slots. Layers run in a fixed cycle, so a plain global recency order would evict exactly the layer
// that runs next (0% hits whenever one token's experts exceed the cache).

#include "ggml-backend.h"
#include "ggml-cpp.h"
#include "moetier-io.h"
#include "moetier-layer.h"
#include "policies/policies.h"

#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

class moetier_slots {
  public:
    // n_slots slots (0: an empty pool) for layers of n_expert experts. n_capacity > n_slots: an elastic
    // pool, whose memory is reserved (not committed) for n_capacity slots, of which n_slots are in use
    // at first; grow() and shrink() change how many. throws std::runtime_error
    moetier_slots(moetier_precision  prec,
                  int32_t            n_slots,
                  int32_t            n_expert,
                  moetier_policy_ptr policy,
                  int32_t            n_capacity = 0);

    ~moetier_slots();

    moetier_slots(const moetier_slots &)             = delete;
    moetier_slots & operator=(const moetier_slots &) = delete;

    //
    // memory API
    //

    // one pool tensor per projection of shapes. A RAM tier's pool (vram false): [ne0, ne1, n_capacity]
    // with slots padded to 4096 (reads land straight in them), in host memory paged in as slots fill
    // (buft nullptr), or in a GPU backend's pinned host buffer type (which it copies from at full
    // speed). The VRAM tier's pool (vram true) in buft: [ne0, ne1, n_slots + n_zero] unpadded, as
    // CUDA's kernels take them, zeroed, the n_zero extra slots (zero experts) never assigned: the ids
    // of what the GPU does not compute (one per position of a token's experts: CUDA's batched paths
    // need distinct ids within a token), and MMQ reads past the last slot. Again on an allocated pool:
    // the old memory is freed (call before the slots are used). Not called for trace replay.
    // throws std::runtime_error
    void alloc(const std::vector<moetier_proj> & shapes,
               ggml_backend_buffer_type_t        buft   = nullptr,
               bool                              vram   = false,
               int32_t                           n_zero = 1);

    ggml_tensor * tensor(size_t k) const { return k < tensors.size() ? tensors[k] : nullptr; }

    // Computes the pool's experts with llama.cpp's repacked CPU kernels (the CPU_REPACK buffer type
    // repack_buft, whose rows are interleaved by 8: e.g. q4_K 8x8 with AVX2), as stock llama.cpp
    // computes the expert tensors it repacks, so that the output stays equal to stock's. Each
    // projection whose type and shape those kernels take gets their traits; a read into one of its
    // slots is repacked in place once checked (moetier_read_settle). Only for a RAM tier in this
    // process's memory (buft nullptr in alloc): a GPU copies slots as they are. Call after alloc,
    // before a slot is written. Returns how many projections are repacked.
    int32_t use_repacked(ggml_backend_buffer_type_t repack_buft);

    // The pool's memory in transparent huge pages (a RAM pool in this process's memory; false
    // otherwise, or if the kernel refused): the repacked and plain kernels read the slots with fewer
    // TLB misses. Call after alloc. Fresh huge pages can be slow to fault in (in a VM, each may need the
    // host to back it): start_populate faults them in ahead of the misses.
    bool use_huge_pages();

    bool huge_pages() const { return huge_; }

    // With huge pages: commits the memory of the empty slots in use, a window of 256 MiB ahead of the
    // ones take() has handed out, in that order, on a background thread at the lowest priority, so
    // that a miss's read finds its pages in place. shrink() and alloc() stop it first (a slot taken
    // out of use must not be committed again behind them). No-op without huge pages: 4 KiB pages
    // fault in as fast as this would (measured).
    void start_populate();

    // stops the populate thread (waits for its current slot); no-op if none
    void stop_populate() noexcept;

    // bytes the populate thread committed so far
    uint64_t populated_bytes() const { return populated.load(std::memory_order_relaxed); }

    // how many projections use_repacked marked (0: plain layout)
    int32_t n_repacked() const { return n_repacked_; }

    uint64_t mem_bytes() const { return buf_size; }  // 0 until alloc; an elastic pool's whole reservation

    // bytes of one slot over every projection (0 until alloc)
    uint64_t slot_bytes() const { return slot_bytes_; }

    //
    // bookkeeping API
    //

    // a layer whose experts the pool may hold (model layer index)
    void add_layer(int32_t il);

    moetier_precision prec() const { return prec_; }

    // the slots in use now (an elastic pool's grow with it); slot ids run up to n_capacity()
    int32_t n_slots() const { return n_enabled.load(std::memory_order_relaxed); }

    int32_t n_capacity() const { return (int32_t) keys.size(); }

    bool elastic() const { return n_capacity() > n_floor; }

    // the fewest slots shrink() leaves (the slots given at construction)
    int32_t n_slots_floor() const { return n_floor; }

    // slots in use whose memory was never written since they came into use (or since shrink() gave
    // it back): memory the pool may still take without growing
    int32_t n_untouched() const { return n_untouched_; }

    // Puts up to n unused slots into use (empty: they fill as misses come); returns how many.
    int32_t grow(int32_t n);

    // Takes up to n slots out of use, never below n_slots_floor() and never so many that fewer than
    // n_keep slots stay free or evictable: empty ones first, then the policy's victims among the
    // evictable slots (as take() would evict them); their memory goes back to the system. Returns how
    // many.
    int32_t shrink(int32_t n, int32_t n_keep, const moetier_policy_ctx & ctx) noexcept;

    // the slot holding expert e of layer il, -1 if none
    int32_t find(int32_t il, int32_t e) const { return slot_of[il][e]; }

    const moetier_key & key(int32_t s) const { return keys[s]; }

    // slots holding an expert (its read may be in flight)
    int32_t n_experts_held() const { return n_slots() - (int32_t) free_slots.size(); }

    // every expert of every layer of the pool has a slot
    bool holds_every_expert() const { return (int64_t) n_experts_held() == (int64_t) n_layers * n_expert; }

    // A slot for key: a never used one, else the policy's victim among the evictable slots (the old
    // expert is forgotten). The policy is told of the load. -1 if no slot is evictable.
    int32_t take(const moetier_key & key, const moetier_policy_ctx & ctx) noexcept;

    // forgets what slot s holds (its data is garbage, or its read was cancelled); no-op if empty
    void drop(int32_t s) noexcept;

    // the layer being resolved uses s: not evictable until unpin_all (its next resolve)
    void pin(int32_t s) { pinned[s] = 1; }

    bool is_pinned(int32_t s) const { return pinned[s] != 0; }

    void unpin_all();

    // a prefetch read in flight into s (io task id, -1 if none)
    int32_t reader(int32_t s) const { return readers[s]; }

    void set_reader(int32_t s, int32_t id) { readers[s] = id; }

    // held for a later layer by a prediction
    bool is_held(int32_t s) const { return holds[s] != 0; }

    void hold(int32_t s, bool h) { holds[s] = h ? 1 : 0; }

    // read on the io_uring and not yet checked against the store's checksums: the load op of the
    // layer that uses it checks it first (take and drop clear it: the slot's content is new)
    bool is_unchecked(int32_t s) const { return unchecked[s] != 0; }

    void set_unchecked(int32_t s, bool u) { unchecked[s] = u ? 1 : 0; }

    //
    // policy
    //

    void on_hit(int32_t s, const moetier_policy_ctx & ctx) {
        policy->on_hit(s, keys[s], prec_ == MOETIER_PRECISION_HIGH, ctx);
    }

    void reset_sequence(const moetier_policy_ctx & ctx) { policy->reset_sequence(ctx); }

  private:
    // the policy's victim among the evictable slots in use, -1 if none (take's eviction order)
    int32_t pick_victim(const moetier_policy_ctx & ctx) noexcept;
    // forgets slot s's expert (the policy keeps its record until the slot's next load)
    void    forget(int32_t s) noexcept;
    // takes empty slot s out of use; the pages it wrote go back to the system
    void    disable(int32_t s) noexcept;

    const moetier_precision prec_;
    const int32_t           n_expert;
    moetier_policy_ptr      policy;
    int32_t                 n_floor      = 0;
    int32_t                 n_untouched_ = 0;
    std::atomic<int32_t>    n_enabled{ 0 };

    // memory
    moetier_mapped_memory      mem;  // the pools' memory without a buffer type, paged in as slots fill
    size_t                     buf_size    = 0;
    uint64_t                   slot_bytes_ = 0;
    ggml_context_ptr           ctx;
    ggml_backend_buffer_ptr    buf;
    std::vector<ggml_tensor *> tensors;  // [proj]
    // use_repacked: a token buffer of the CPU_REPACK type that the repacked pools name as theirs (their
    // memory stays the pool's above), so that ggml-cpu runs their mul_mat_ids with the repacked kernels
    ggml_backend_buffer_ptr    repack_buf;
    int32_t                    n_repacked_ = 0;

    // start_populate's thread, and its stop flag and progress
    std::thread           populate_thread;
    std::atomic<bool>     populate_stop{ false };
    std::atomic<uint64_t> populated{ 0 };
    std::atomic<int64_t>  n_fresh_taken{ 0 };  // slots take() handed out untouched since start_populate
    bool                  huge_ = false;       // use_huge_pages took

    // bookkeeping
    std::vector<moetier_key>          keys;        // [n_capacity] what each slot holds
    std::vector<std::vector<int32_t>> slot_of;     // [model layer][expert] slot holding it, -1 if none
    std::vector<int32_t>              held;        // [model layer] slots holding that layer's experts
    int32_t                           n_layers = 0;
    std::vector<int32_t>              free_slots;  // never used yet (or dropped)
    std::vector<uint8_t>              pinned;      // [n_capacity]
    std::vector<int32_t>              readers;     // [n_capacity]
    std::vector<uint8_t>              holds;       // [n_capacity]
    std::vector<uint8_t>              unchecked;   // [n_capacity]
    std::vector<uint8_t>              enabled;     // [n_capacity] in use
    std::vector<uint8_t>              touched;     // [n_capacity] its memory was written since it came into use

    // scratch of take()
    std::vector<uint8_t> mask;  // [n_capacity] 1 = not a candidate
    std::vector<int32_t> cand;  // [model layer] candidates per layer
};

// The cached version of expert e of layer il that a need would use: a high one always, a low one
// for low and skip needs. false if none.
bool moetier_slots_find_version(const moetier_slots & hi,
                                const moetier_slots & lo,
                                int32_t               il,
                                int32_t               e,
                                moetier_need          need,
                                moetier_precision &   prec,
                                int32_t &             s);
