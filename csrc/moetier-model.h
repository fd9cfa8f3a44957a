#pragma once

// Which tensors the cache serves, where their bytes are, and how the byte budget becomes slot
// pools. One moetier_model per llama_model, owned by it (llama_model::moetier).

#include "ggml-backend.h"
#include "ggml.h"
#include "moetier-budget.h"
#include "moetier-cache.h"
#include "moetier-io.h"
#include "moetier-iopool.h"
#include "moetier-layer.h"
#include "moetier-precision.h"
#include "moetier-store.h"
#include "moetier-warm.h"
#include "moetier.h"

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

struct llama_model;

struct moetier_model {
    // throws std::runtime_error: bad params, unreadable files, a store that does not match
    moetier_model(const moetier_params & params, const std::vector<std::string> & paths);
    ~moetier_model();

    moetier_model(const moetier_model &)             = delete;
    moetier_model & operator=(const moetier_model &) = delete;

    //
    // load API (called by the patched loader, in order)
    //

    // Creates the data-less tensor of a served expert tensor, or returns nullptr if name is not one.
    // file_idx/offs: where llama.cpp's loader found the tensor.
    // buft: where the loader would put the tensor; an expert tensor on an RPC server is left to it
    ggml_tensor * create_tensor(const std::string &                                 name,
                                const ggml_tensor *                                 cur,
                                uint16_t                                            file_idx,
                                size_t                                              offs,
                                const std::function<ggml_backend_buffer_type *()> & buft);

    // after the weights are loaded: with an automatic budget, chooses cache_bytes from the memory
    // limit and the loaded model's needs; sets budget_note either way
    // (a given budget that leaves the other weights no room under a cgroup limit: a warning)
    // throws if no MoE layer is served (a dense model, or every layer's experts on an RPC server);
    // notes the layers left to an RPC server
    void check_served();
    void choose_budget(const llama_model & model);

    // then, with lock_weights: mlocks the pages of the model's file mappings that hold the resident
    // non-expert weights (a failure: a warning, nothing locked)
    void lock_resident_weights(const llama_model & model);

    // after all tensors exist: forms pool groups and allocates the pools from the budget
    void finish_load(const llama_model & model);

    // benchmarks only: MOETIER_ROUTING_TRACE=FILE replaces the routers' choices by a trace's (a loud
    // warning); throws std::runtime_error if the trace's geometry is not the model's
    void init_routing(const llama_model & model);

    // logs the counters summed over layers (INFO), at model free
    void log_totals() const;

    // Fine-tuned variants of one MoE model, each loaded with its own store, served from one expert
    // cache: ms[0]'s, rebuilt over the budget it was loaded with, keyed by variant * n_expert + expert
    // (each key read from its variant's store). The other models' layers then resolve and load on
    // ms[0]'s layers, their router ids mapped to their own keys (set_expert_keys maps them elsewhere).
    // Before any decode; the models are freed together, ms[0] last, and decode one at a time (the
    // cache is one). throws std::runtime_error naming the model whose file does not fit
    static void share_cache(const std::vector<moetier_model *> & ms);

    // the cache key of each (served layer, expert) of a variant sharing a cache: keys[i * n_expert + e],
    // the same expert of the variant whose copy serves it (key % n_expert == e). throws std::runtime_error
    void set_expert_keys(const int32_t * keys, int64_t n);

    // the caches this model's layers use: its own, or those of the model it shares them with
    const std::vector<std::unique_ptr<moetier_cache>> & served_caches() const {
        return shared_host ? shared_host->caches : caches;
    }

    // held by the thread that computes a graph on served_caches(), from moetier_hook_graph_compute
    // to moetier_hook_graph_computed: a reader of the counters on another thread finishes the open
    // layer passes only when it can take it, never under a running compute (recursive: the computing
    // thread itself may read them)
    std::recursive_mutex & compute_mutex() { return shared_host ? shared_host->compute_mu : compute_mu; }

    // then: starts the I/O pool (none if io_threads is 0: the compute threads read): an io_uring or
    // I/O threads, whose reads go through moetier-read
    void    init_io();
    // io_uring reads from a GGUF: how many staging buffers, and the bytes of one (of precision prec)
    int32_t n_staging() const;
    size_t  staging_bytes(moetier_precision prec) const;

    // after the model's weights are loaded: a stacked-router prefetcher per group; nothing if
    // prefetch is off
    void init_prefetch(const llama_model & model);

    // last: with warm on, reads the sidecar (a missing, stale or corrupt one is ignored with a
    // warning), starts the background reads of its hottest experts and the periodic writer
    void init_warm();

    // after init_warm: every cache commits its empty RAM slots in the background, in the order misses
    // take them (moetier_slots::start_populate)
    void start_populate();

    // says whether huge_pages took (a warning where it cannot)
    void log_huge_pages();

    // what the process needs beside the expert cache, from the loaded model (moetier-budget.h)
    moetier_budget_needs budget_needs(const llama_model & model) const;

    // the weights every token reads: all tensors but the served experts and, unless they are also
    // the output matrix, the token embeddings (get_rows reads a few rows of them)
    static std::vector<const ggml_tensor *> resident_weights(const llama_model & model);

    // writes the sidecar; false + err. Safe while decoding runs (the counters are atomics)
    bool save_state(std::string & err) const;

    //
    // graph API
    //

    // the served layer whose projection tensor t is, or nullptr
    static moetier_layer * layer_of(const ggml_tensor * t);

    //
    // state API
    //

    // every selected expert is computed in high precision (nothing read low, nothing skipped): the
    // output equals stock llama.cpp's. Valid after finish_load
    bool exact() const;

    // the elastic budget applies (grow: on for an auto budget by default; never under a VRAM tier)
    bool elastic_on() const { return (grow > 0 || (grow < 0 && budget_auto)) && vram == 0; }

    // a parameter that cannot take effect as given: logged at WARN level and kept for the C API
    void warn(const std::string & msg);

    //
    // state
    //

    std::string                budget_note;       // how cache_bytes was chosen (moetier_model_budget_note)
    bool                       budget_auto  = false;
    uint64_t                   auto_room    = 0;  // the auto budget's memory before its margin (moetier_budget_auto)
    uint64_t                   reserve      = 0;
    int32_t                    n_ctx        = 0;
    uint64_t                   process_anon = 0;  // RssAnon when the load began (auto budget)
    bool                       warm_on      = false;
    bool                       lock_weights = true;
    bool                       verify_all   = true;
    std::atomic<uint64_t>      n_checked{ 0 };    // reads checked against the store's checksums
    bool                       fitted_prefetch = true;
    std::string                prefetch_source;   // what predicts: "stacked routers" or the fitted predictor
    uint64_t                   locked_bytes = 0;  // of the non-expert weights (lock_resident_weights)
    std::string                state_path;        // the warm-start sidecar, "" if warm is off
    uint64_t                   state_identity = 0;
    moetier_latency_hist       read_hist;         // every expert read's latency
    std::string                policy_name;
    moetier_policy_weights     policy_weights;
    moetier_precision_rule     precision;
    float                      low_frac       = 0.0f;
    uint64_t                   cache_bytes    = 0;
    uint64_t                   vram           = 0;      // the VRAM tier's budget (0: none)
    bool                       vram_host      = false;
    bool                       vram_cpu       = false;  // cooperative compute under the VRAM tier
    bool                       direct_io      = true;
    int32_t                    n_model_layers = 0;      // for layer distances (set by the load hook)
    int32_t                    prefetch       = 0;
    int32_t                    io_threads     = 1;
    float                      prefetch_waste = 0.25f;  // the prefetch byte cap's share (moetier-prefetch.h)
    bool                       prefetch_gate  = true;   // prefetch measures whether it pays (moetier_prefetch_gate)
    bool                       huge_pages     = false;  // RAM pools in transparent huge pages
    int32_t                    grow           = -1;     // the elastic budget (moetier_elastic): -1 auto budgets only
    bool                       use_uring      = true;
    // llama.cpp's CPU_REPACK buffer type where stock would place the expert tensors there (repacked
    // weights are on and the CPU has kernels for their type): the RAM pools then compute on those
    // kernels, so the output stays stock's; nullptr: the plain layout
    ggml_backend_buffer_type_t repack_buft    = nullptr;

    std::unique_ptr<moetier_routing>           routing;         // MOETIER_ROUTING_TRACE, else nullptr
    std::vector<std::string>                   warnings;        // of the load, in order (moetier_model_warning)
    std::vector<std::string>                   paths;           // GGUF files, split order
    std::vector<std::unique_ptr<moetier_file>> files;           // opened on demand for GGUF reads
    std::shared_ptr<moetier_store>             store;           // shared: variants sharing a cache keep each
    std::shared_ptr<moetier_file>              store_file;      // other's stores (share_cache)
    std::vector<std::shared_ptr<const void>>   variant_stores;  // the first model of share_cache: the others' stores

    ggml_context * meta_ctx = nullptr;                          // served tensors, no data

    std::vector<int32_t>                        remote_layers;  // MoE layers left to an RPC server (create_tensor)
    std::string                                 remote_device;  // that server's device name, for the note
    std::vector<std::unique_ptr<moetier_layer>> layers;   // served layers, in layer order after finish_load (owned
                                                          // here: the graph's custom ops point at them)
    std::shared_ptr<moetier_elastic>            elastic;  // the process's elastic budget (grow), or nullptr
    std::vector<std::unique_ptr<moetier_cache>> caches;   // one per pool group

    // I/O threads or ring (stopped before the caches go) and their bounce buffers (per I/O thread)
    std::unique_ptr<moetier_io_pool>    io;
    std::vector<moetier_aligned_buffer> io_bounce;

    // warm start: the background reads, and the thread that writes the sidecar every minute
    std::unique_ptr<moetier_warm> warm;
    std::thread                   saver;
    std::mutex                    saver_mutex;
    std::condition_variable       saver_cv;
    bool                          saver_stop = false;
    mutable std::mutex            save_mutex;    // the saver and the C API may write the sidecar at once

    moetier_model *      shared_host = nullptr;  // a variant: the model whose cache serves its layers (share_cache)
    std::recursive_mutex compute_mu;             // see compute_mutex()
    int32_t              n_variants = 0;         // the model whose cache variants share: how many (share_cache)

    int32_t  n_expert         = 0;
    uint64_t expert_bytes     = 0;  // all served experts, unpadded
    uint64_t expert_bytes_low = 0;  // their low versions (store only)
    uint64_t min_cache_bytes  = 0;
    uint64_t min_vram_bytes   = 0;  // smallest VRAM budget accepted: one layer's experts per group on a GPU
};
