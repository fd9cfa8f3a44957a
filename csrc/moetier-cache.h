#pragma once

// The expert cache of one pool group: the layers whose experts share types and shapes, their slot
// pools (high precision, and low precision with a store), the policies' clocks, the prefetcher and
// the current layer pass. Called from the custom ops that the graph inserts per MoE layer, and from
// the C API for stats.
//
//   resolve (1 thread):   ids [n_used, n_tokens] + gate weights -> high and low slots; picks the
//                         precision of each miss (HOBBIT eq. 2) and victims, opens a pass with the
//                         reads; with io_uring the kernel starts them right away
//   (the graph moves the nodes that do not need the experts, e.g. a shared expert, here: they
//    compute while the reads run)
//   load    (all threads): performs the pass's reads (or, with io_uring, thread 0 waits for them)
//   prefetch (thread 0):  hands the stacked routers' logits to the prefetcher
//   mul_mat_id on the high pools with the high slots (+ on the low pools with the low slots)
//
// Slots are pinned from their layer's resolve until the next resolve of the same group: layers run
// in order, so by then the previous layer's mul_mat_ids are done. The same next resolve finishes
// the pass (or sync() does, between decodes).

#include "ggml-cpp.h"
#include "moetier-budget.h"
#include "moetier-iopool.h"
#include "moetier-layer.h"
#include "moetier-precision.h"
#include "moetier-prefetch.h"
#include "moetier-read.h"
#include "moetier-slots.h"
#include "moetier-warm.h"
#include "policies/policies.h"

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

// One layer pass of a pool group: opened by resolve, carried out by the load op, closed by
// finish(). If the graph stopped before the load op (an abort), `loaded` is false and finish knows
// that no read of this pass was performed or checked.
struct moetier_pass {
    // a read the load op must wait for: a prefetch of a needed expert still in flight
    struct wait {
        int32_t           id     = -1;
        moetier_precision prec   = MOETIER_PRECISION_HIGH;
        int32_t           slot   = -1;
        bool              failed = false;
        int32_t           check  = -1;  // its entry in checks, -1 if none
    };

    // a read of a miss: io_id >= 0 while it is on the io_uring
    struct task {
        moetier_read read;
        int32_t      io_id  = -1;
        bool         failed = false;
        int32_t      check  = -1;  // its entry in checks, -1 if none
    };

    // a slot this layer uses that was read on the io_uring and not checked against the store's
    // checksums yet. The ring's completions are reaped on one thread (in whatever op is running);
    // the check is left to the layer's load op, where every compute thread takes a share, while
    // thread 0 still waits for the reads, and the pass over the bytes leaves them in the CPU's
    // cache for the mul_mat_ids that follow.
    enum check_state : uint8_t {
        CHECK_READING = 0,  // its read is in flight: thread 0 marks it READ when the read ended
        CHECK_READ    = 1,
        CHECK_BUSY    = 2,  // a thread is checking it
        CHECK_OK      = 3,
        CHECK_FAILED  = 4,  // the slot is dropped when the pass is finished
    };

    struct check {
        moetier_precision prec   = MOETIER_PRECISION_HIGH;
        int32_t           slot   = -1;
        int32_t           expert = -1;
        int32_t           io_id  = -1;  // its ring read: once landed, a thread checks it (thread 0 may wait on another)
    };

    moetier_layer *                         layer = nullptr;  // nullptr: no pass open
    std::vector<task>                       tasks;            // sized once to one layer's worth, n_tasks used
    int32_t                                 n_tasks = 0;
    std::vector<wait>                       waits;
    std::vector<check>                      checks;               // sized once to one layer's worth, n_checks used
    int32_t                                 n_checks = 0;
    std::unique_ptr<std::atomic<uint8_t>[]> check_states;         // [checks.size()] check_state
    std::atomic<int32_t>                    n_checks_taken{ 0 };  // entries a thread took (or thread 0 settled)
    std::atomic<int32_t>                    n_checks_done{ 0 };   // entries OK or FAILED

    // the prefetches that landed for the next layers, checked in this load op's idle time: while
    // thread 0 waits for this layer's reads, a thread with no entry of this layer to check takes one
    // that has landed, and thread 0 clears the slot's unchecked flag when the op ends (the layer
    // that uses it then has nothing to check). A mismatch is left to that layer (read again there).
    enum ahead_state : uint8_t {
        AHEAD_OPEN = 0,
        AHEAD_BUSY = 1,
        AHEAD_OK   = 2,
        AHEAD_LEFT = 3,  // mismatch: stays unchecked
    };

    std::vector<moetier_landing>            aheads;
    std::unique_ptr<std::atomic<uint8_t>[]> ahead_states;           // [aheads.capacity()] ahead_state
    std::atomic<int32_t>                    n_ahead_open{ 0 };
    std::atomic<int32_t>                    n_ahead_busy{ 0 };      // threads inside check_ahead
    std::atomic<bool>                       reads_waited{ false };  // thread 0 is past its waits
    int32_t                                 n_used = 0;             // selected experts per token
    bool                 loaded = false;  // thread 0 of the load op is done (reads performed or waited for)
    std::atomic<int64_t> t_load_begin_us{ 0 };
    std::atomic<int64_t> t_load_end_us{ 0 };
};

class moetier_cache {
  public:
    // n_slots per precision (low may be 0); shapes: the type and shape of each projection (the
    // group's first layer). n_expert: the expert ids the cache keys; n_route (0: n_expert): the experts
    // one layer routes to, the fewest slots it needs (variants sharing a cache key n_expert = variants
    // * n_route). n_capacity > the high slots: the high pool is elastic (set_elastic), up to that many
    // slots. simulate: no memory, for trace replay (resolve does all the
    // bookkeeping; nothing is read). env: what replay gives the policies (the trace's future, a log
    // of decisions). throws std::runtime_error
    moetier_cache(int32_t                        n_expert,
                  const int32_t                  n_slots[MOETIER_N_PRECISIONS],
                  const moetier_precision_rule & rule,
                  const std::string &            policy,
                  const moetier_policy_weights & weights,
                  std::vector<moetier_proj>      shapes,
                  bool                           simulate   = false,
                  const moetier_policy_env &     env        = {},
                  int32_t                        n_route    = 0,
                  int32_t                        n_capacity = 0);
    ~moetier_cache();

    moetier_cache(const moetier_cache &)             = delete;
    moetier_cache & operator=(const moetier_cache &) = delete;

    //
    // init API
    //

    void add_layer(moetier_layer * layer);

    void set_n_model_layers(int32_t n) { n_model_layers = n; }

    // the model's reads off the compute threads (shared by its groups): with io_uring, a miss's read
    // starts at resolve. nullptr: the compute threads read everything
    void set_io(moetier_io_pool * pool) { io = pool; }

    void set_prefetch(moetier_prefetch_ptr p) { prefetcher = std::move(p); }

    // the elastic budget (the high pool was made with room to grow): each layer pass polls it and
    // grows or shrinks the high pool by what it says
    // reserve: memory its model keeps free beside the margin (moetier_elastic::add_pool)
    void set_elastic(std::shared_ptr<moetier_elastic> e, uint64_t reserve);

    // slots the elastic budget added and took back since load
    uint64_t n_grown() const { return grown.load(std::memory_order_relaxed); }

    uint64_t n_shrunk() const { return shrunk.load(std::memory_order_relaxed); }

    // The VRAM tier, a cache over this one (call before add_layer): n_slots high-precision slots in
    // dev's memory (host: in host memory, computed on the CPU, which checks the tier where no GPU is),
    // with its own policy; the RAM pools move to dev's pinned host memory, which it copies from at full
    // speed. throws std::runtime_error
    // cpu: cooperative compute (moetier_params.vram_cpu), whose costs are measured here. n_slots_low:
    // low-precision slots (mixed precision: the RAM tier has low slots; 0: none), with their own policy.
    // n_used: the model's experts per token (the zero slots, one per position). pin_ram: the RAM pools
    // move to dev's pinned memory (not when the tier holds every expert: preload_vram, then the RAM
    // tier only stages the load).
    void set_vram(ggml_backend_dev_t             dev,
                  bool                           host,
                  bool                           cpu,
                  int32_t                        n_slots,
                  int32_t                        n_slots_low,
                  int32_t                        n_used,
                  bool                           pin_ram,
                  const std::string &            policy,
                  const moetier_policy_weights & weights);

    // cooperative compute's cost model (0 without it): microseconds to copy one expert into VRAM, and
    // for the CPU to compute one expert for one token
    float vram_copy_us() const { return copy_us; }

    float vram_cpu_us() const { return cpu_us; }

    bool vram_cpu() const { return vram != nullptr && cooperative; }

    // cooperative compute splits the misses of ubatches of at most this many tokens (decode); larger
    // ones (prompts) copy every miss, as the GPU computes many tokens at once, and their graphs have no
    // CPU plane
    static constexpr int64_t vram_cpu_max_tokens = 8;

    // whether a ubatch of n_tokens has the CPU plane (the graph's upload op gives two planes)
    bool vram_cpu_plane(int64_t n_tokens) const { return vram_cpu() && n_tokens <= vram_cpu_max_tokens; }

    bool has_vram() const { return vram != nullptr; }

    // the VRAM tier's pool tensor of projection k (nullptr without one)
    ggml_tensor * vram_pool(size_t k) const { return vram ? vram->tensor(k) : nullptr; }

    // the VRAM tier's low-precision pool of projection k (nullptr without one)
    ggml_tensor * vram_pool_low(size_t k) const { return vram_low ? vram_low->tensor(k) : nullptr; }

    // mixed precision under the VRAM tier: low-precision copies live in VRAM as well
    bool has_vram_low() const { return vram_low != nullptr; }

    const moetier_slots * vram_slots() const { return vram.get(); }

    // A VRAM tier with a slot for every expert of the group: reads each (checked) through the RAM tier's
    // first slots and copies it into VRAM, each layer's experts in consecutive slots in expert order;
    // from then on the layers compute from their VRAM slots as stock llama.cpp computes from its expert
    // tensors (vram_static), with no slot choice per layer. throws std::runtime_error naming the file
    void preload_vram();

    // the layers compute straight from their VRAM slots (preload_vram)
    bool vram_static() const { return vram_static_; }

    int32_t vram_zero_slots() const { return n_zero; }

    // the device of the VRAM tier (nullptr without one)
    ggml_backend_dev_t vram_device() const { return vram_dev; }

    // the scheduler's backend that computes on the VRAM tier's device (graph hook, per built graph):
    // with it, the upload op's copies are not waited for on the host; that backend's stream waits for
    // them instead, so the CPU computes its share (cooperative compute) while they run
    void set_vram_compute(ggml_backend_t b) { vram_compute = b; }

    // after a graph computed (graph hook): an event on the compute backend's stream behind its work, which
    // the next copies into VRAM wait for (a copy must not overwrite a slot another context's graph is
    // still reading: within a context, reading each layer's routing already drains its stream)
    void graph_computed() noexcept;

    moetier_slots & slots(moetier_precision prec) { return *sets[prec]; }

    const moetier_slots & slots(moetier_precision prec) const { return *sets[prec]; }

    // warm start: a high-precision slot for expert e of layer, held until its background read is
    // done; -1 if the group has no room left (one layer's experts always stay free for misses)
    int32_t warm_take(const moetier_layer & layer, int32_t e);
    // the background reads of the slots warm_take gave: entry i of warm reads slot s
    void    warm_attach(const moetier_warm * w, int32_t s, int32_t i);
    // after the warm start's thread stopped: slots it never read are dropped, the rest released
    void    end_warm() noexcept;

    const std::vector<moetier_proj> & proj_shapes() const { return shapes; }

    // the pool tensor of projection k in precision prec (nullptr if that precision has no slots)
    ggml_tensor * pool(moetier_precision prec, size_t k) const { return sets[prec]->tensor(k); }

    bool has_low() const { return sets[MOETIER_PRECISION_LOW]->n_slots() > 0; }

    // the RAM pools on llama.cpp's repacked CPU kernels where they take the experts' type and shape
    // (moetier_slots::use_repacked); not with a VRAM tier, which copies RAM slots as they are. Call
    // before a slot is written. Returns how many pools are repacked.
    int32_t use_repacked(ggml_backend_buffer_type_t repack_buft);

    // the RAM pools in this process's memory in transparent huge pages (moetier_slots::use_huge_pages);
    // returns how many pools took them
    int32_t use_huge_pages();

    // pools (projection x precision) in huge pages
    int32_t n_huge() const { return n_huge_; }

    // with huge pages, faults the RAM pools' empty slots in ahead of the misses, in the background
    // (moetier_slots::start_populate); call once the model is loaded for use (not for a memory-fit pass)
    void start_populate();

    // bytes the populate threads committed so far
    uint64_t populated_bytes() const {
        return sets[MOETIER_PRECISION_HIGH]->populated_bytes() + sets[MOETIER_PRECISION_LOW]->populated_bytes();
    }

    // projection pools over both precisions that use the repacked kernels
    int32_t n_repacked() const {
        return sets[MOETIER_PRECISION_HIGH]->n_repacked() + sets[MOETIER_PRECISION_LOW]->n_repacked();
    }

    // whether the reads run on the io_uring (the prefetch op then runs before the load op: with I/O
    // threads, their wakeups during the load would preempt the compute threads reading)
    bool reads_on_ring() const { return io != nullptr && io->uses_uring(); }

    // whether resolve needs the gate weights: the rule can pick low or skip
    bool uses_weights() const { return rule.t2 < 1.0f || (rule.t1 < 1.0f && has_low()); }

    // the prefetcher's input for the prefetch op of layer il, nullptr if none, or if every expert of
    // the group has a high slot: a high copy serves every need and, with no room short, none is
    // evicted, so a prediction has nothing to read and its nodes would only cost time per token
    ggml_tensor * router_stack(int32_t il) const {
        return prefetcher && !sets[MOETIER_PRECISION_HIGH]->holds_every_expert() ? prefetcher->router_stack(il) :
                                                                                   nullptr;
    }

    // bytes of the slots in use (an elastic pool's reservation beyond them is not counted)
    uint64_t pool_bytes() const {
        return sets[0]->slot_bytes() * (uint64_t) sets[0]->n_slots() +
               sets[1]->slot_bytes() * (uint64_t) sets[1]->n_slots();
    }

    uint64_t vram_bytes() const { return (vram ? vram->mem_bytes() : 0) + (vram_low ? vram_low->mem_bytes() : 0); }

    int32_t n_slots_vram() const { return (vram ? vram->n_slots() : 0) + (vram_low ? vram_low->n_slots() : 0); }

    int32_t n_slots(moetier_precision prec) const { return sets[prec]->n_slots(); }

    int32_t n_expert() const { return n_expert_; }

    // layer passes resolved so far (0: the cache has not served a decode)
    uint64_t n_resolves() const { return tick; }

    //
    // graph API: custom op bodies, noexcept
    //

    // Finishes the previous pass and opens one for layer. ids: [n_used, n_tokens] expert ids with row
    // stride ids_nb1 bytes; weights: their gate weights [n_used, n_tokens] with row stride w_nb1
    // (nullptr: all high). out: [n_used, n_tokens, 1 or 2] contiguous: high slots, then (if the group
    // has low slots) low slots; -1 where that precision is not used. During warmup nothing is read:
    // misses map to -1 (a zero row) instead.
    void resolve(moetier_layer & layer,
                 const int32_t * ids,
                 const float *   weights,
                 int64_t         n_used,
                 int64_t         n_tokens,
                 size_t          ids_nb1,
                 size_t          w_nb1,
                 int32_t *       out,
                 bool            warmup) noexcept;

    // the open pass's reads, thread ith of nth; waits for prefetches of experts the layer needs that
    // are still being read
    void load(const moetier_layer & layer, int ith, int nth) noexcept;

    // The upload op (thread 0), after the load op, with a VRAM tier: every expert the layer computes in
    // high precision gets a VRAM slot: a hit, or a copy from its RAM slot (read and checked by the load
    // op) on the tier's own stream, waited for here. With cooperative compute, a decode ubatch's misses
    // are split between copies (the most used experts) and the CPU, so that the copies and the CPU take
    // about the same time. ram: the resolve's high slots [n_used, n_tokens]; out: the VRAM slots, a zero
    // slot (one per position k) where ram is -1 or the CPU computes, then, with cpu_plane (the graph's
    // vram_cpu_plane), a second plane: the RAM slots of the experts the CPU computes, -1 elsewhere; or,
    // with ram_low (mixed precision: the resolve's low slots), a second plane of the VRAM tier's low slots
    // (a low zero slot where the expert is not computed in low precision).
    // During warmup (nothing was read) or after a failed read (the graph is being stopped) nothing is
    // copied: out holds distinct valid slots (and a CPU plane of -1).
    void upload(moetier_layer & layer,
                const int32_t * ram,
                int64_t         n_used,
                int64_t         n_tokens,
                const int32_t * ram_low,
                bool            cpu_plane,
                int32_t *       out,
                bool            warmup) noexcept;

    // the prefetch op, before layer's load: logits [n_next * n_expert, n_tokens] (row stride nb1) of the
    // stacked routers
    void prefetch(const moetier_layer & layer, const float * logits, int64_t n_tokens, size_t nb1) noexcept;

    //
    // stats / control
    //

    // finishes the open pass (read time, failed reads); call between decodes before reading counters
    void sync() noexcept;
    void reset_sequence();
    void add_prefetch_stats(moetier_prefetch_stats & out) const;
    void reset_prefetch_stats();

    // first read error since clear_error (kind NONE if none)
    moetier_error error() const;
    void          clear_error();

    bool failed() const { return has_error.load(std::memory_order_relaxed); }

    // expert reads that failed (I/O error, short read, checksum) since load; clear_error keeps it
    uint64_t n_read_errors() const { return n_read_errors_.load(std::memory_order_relaxed); }

    // expert reads that failed once and were tried again (whatever the second try gave)
    uint64_t n_read_retries() const { return n_read_retries_.load(std::memory_order_relaxed); }

  private:
    // settles the open pass: accounts its read time; a pass the graph aborted before its load op
    // drops every slot it assigned (nothing was read into them, or checked); failed reads drop theirs
    void    finish(moetier_pass & p) noexcept;
    void    queue_read(moetier_pass & p, moetier_layer & layer, moetier_precision prec, int32_t e, int32_t s) noexcept;
    // a slot for expert e (the policy told of the load with ctx) and its read queued; false if none
    bool    queue_load(moetier_pass &             p,
                       moetier_layer &            layer,
                       moetier_precision          prec,
                       int32_t                    e,
                       const moetier_policy_ctx & ctx) noexcept;
    void    start_reads(moetier_pass & p) noexcept;  // io_uring: the kernel starts the pass's reads now
    // an entry for slot s in the pass's checks if it holds an unchecked ring read; its index, or -1
    int32_t add_check(moetier_pass & p, moetier_precision prec, int32_t s, bool read, int32_t io_id = -1) noexcept;
    // thread 0, after the read behind check entry k ended: ok, it is ready to be checked (if no thread
    // took it already, seeing it landed); not ok,
    // it was read again synchronously (and checked there) with result `settled`
    void    end_check_read(moetier_pass & p, int32_t k, bool ok, bool settled) noexcept;
    // takes and checks entries until every entry is taken (thread ith; thread 0 after its waits): READ
    // ones, and READING ones whose ring read has landed (thread 0 may be waiting on another); the
    // others, with none left, check landed aheads while thread 0 still waits
    void    run_checks(moetier_pass & p, int ith) noexcept;
    // while thread 0 still waits: checks one landed ahead entry; false if none was taken
    bool    check_ahead(moetier_pass & p, int ith) noexcept;
    // the prefetch op after predict: the pass's ahead entries, from the prefetcher (the list is
    // reserved once; what does not fit is left to its own layer)
    void    gather_aheads(moetier_pass & p, const moetier_layer & layer) noexcept;
    // waits for io task id and frees it; true if it was read (false: failed, or never started)
    bool    wait_io(int32_t id) noexcept;
    // reads r on this thread, synchronously, each of its reads tried twice; false + err if one fails
    bool    read_sync(const moetier_read & r, moetier_aligned_buffer & bb, moetier_error & err) noexcept;
    void    wait_prefetched(moetier_pass & p) noexcept;
    // a read that failed (or failed its check) read again into slot s, synchronously (counted as a
    // retry); false + the cache's error if that fails too
    bool    read_again(const moetier_layer &    layer,
                       moetier_precision        prec,
                       int32_t                  e,
                       int32_t                  s,
                       moetier_aligned_buffer & bb) noexcept;
    void    set_error(const moetier_error & err) noexcept;
    // warm slots whose reads ended become ordinary (a failed one is dropped)
    void    settle_warm() noexcept;
    // waits for the warm read of slot s; false if it failed
    bool    claim_warm(int32_t s) noexcept;
    // waits for every pending warm read (a miss found no evictable slot: warm holds them)
    void    wait_warm_all() noexcept;
    moetier_policy_ctx policy_ctx(int32_t layer) const;
    // resolve: grows or shrinks the high pool as the elastic budget says
    void               apply_elastic(const moetier_layer & layer, const moetier_policy_ctx & ctx) noexcept;

    const int32_t          n_expert_;
    moetier_precision_rule rule;
    bool                   simulate = false;

    std::vector<moetier_proj>      shapes;  // type and shape template per projection
    int32_t                        n_huge_ = 0;
    std::unique_ptr<moetier_slots> sets[MOETIER_N_PRECISIONS];
    int32_t                        n_model_layers = 1;

    moetier_io_pool *    io = nullptr;
    moetier_prefetch_ptr prefetcher;

    // clocks of the policies
    uint64_t tick       = 0;
    uint64_t seq_tick   = 0;
    uint64_t n_pass     = 1;
    uint64_t seq_pass   = 1;
    int32_t  last_layer = -1;

    // scratch of resolve, sized to one layer's experts
    std::vector<moetier_need> need;         // [n_expert]
    std::vector<moetier_need> needs_k;      // [n_used]
    std::vector<int32_t>      rank;         // [n_expert] gate rank at the ubatch's last token (moetier_policy_ctx)
    std::vector<int32_t>      missing;      // the resolve's experts to read, in expert order
    std::vector<int32_t>      missing_low;  // the upload's low-precision experts to copy into VRAM

    moetier_pass pass;

    // the VRAM tier (set_vram): its slots, a backend of its device for the copies (a stream of their
    // own), and per expert the VRAM slot the current upload gave it
    std::unique_ptr<moetier_slots> vram;
    std::unique_ptr<moetier_slots> vram_low;     // the low-precision copies (mixed precision), if any
    ggml_backend_ptr               vram_backend;
    std::vector<int32_t>           vram_of;      // [n_expert]
    std::vector<int32_t>           vram_low_of;  // [n_expert]
    moetier_policy_env             vram_env;     // what the tier's policy sees (replay: the trace's future)
    ggml_backend_dev_t             vram_dev       = nullptr;
    ggml_backend_t                 vram_compute   = nullptr;  // not owned: the scheduler's
    ggml_backend_event_t           vram_event     = nullptr;  // the copies' last event; nullptr: synchronous copies
    bool                           copies_pending = false;    // copies in flight from RAM slots pinned by this pass
    ggml_backend_event_t           vram_consumed  = nullptr;  // behind the last computed graph's GPU work
    bool                           consumed_set   = false;
    bool                           vram_static_   = false;
    ggml_context_ptr               vram_views;       // the layers' vram_view tensors (preload_vram)
    std::vector<moetier_layer *>   layers_;          // the group's layers, in add_layer order
    bool                           cooperative = false;
    int32_t                        n_zero      = 1;  // the VRAM pools' zero slots, after its n_slots
    float                          copy_us     = 0.0f;
    float                          cpu_us      = 0.0f;

    // cooperative compute's costs on this machine (copy_us, cpu_us); MOETIER_VRAM_COSTS=COPY_US,CPU_US
    // sets them instead (tests: each outcome of the rule on purpose)
    void measure_vram_costs();

    // warm start: entry of warm per high slot (-1: none), and how many are still pending
    const moetier_warm *                warm = nullptr;
    std::vector<int32_t>                warm_entry;
    int32_t                             n_warm = 0;
    std::vector<moetier_aligned_buffer> bounce;  // per compute thread index, grown on first use

    mutable std::mutex    error_mutex;
    moetier_error         error_;
    std::atomic<bool>     has_error{ false };
    std::atomic<uint64_t> n_read_errors_{ 0 };
    std::atomic<uint64_t> n_read_retries_{ 0 };

    std::shared_ptr<moetier_elastic> elastic;
    int32_t                          elastic_pool = -1;
    std::atomic<uint64_t>            grown{ 0 };
    std::atomic<uint64_t>            shrunk{ 0 };
};
