#pragma once

// moetier: serve the experts of a llama.cpp MoE model from disk through a bounded expert cache.
//
// The cache is configured per model load with moetier_model_configure (or moetier_model_load);
// llama.h and llama_model_params stay stock llama.cpp's, so programs built against them (such as
// llama-cpp-python's ctypes bindings) run on this library unchanged. Without a configuration, or
// with cache_bytes == 0, a model loads exactly as stock llama.cpp does. Otherwise the expert
// tensors of MoE layers (blk.N.ffn_{gate,up,down,gate_up}_exps) are not loaded; they are read on
// demand, with pread, into slot pools sized from cache_bytes, from the packed store in store_dir or
// straight from the GGUF.

#include "llama.h"

#include <stddef.h>
#include <stdint.h>

#ifdef LLAMA_SHARED
#    if defined(_WIN32) && !defined(__MINGW32__)
#        ifdef LLAMA_BUILD
#            define MOETIER_API __declspec(dllexport)
#        else
#            define MOETIER_API __declspec(dllimport)
#        endif
#    else
#        define MOETIER_API __attribute__((visibility("default")))
#    endif
#else
#    define MOETIER_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

// Expert cache configuration of one model. Every field is a row of the option table
// (moetier_param_info): its name, type, range and help text live there once.
struct moetier_params {
    uint64_t     cache_bytes;  // expert cache budget in bytes; 0 = cache off (stock llama.cpp loading);
                               // MOETIER_CACHE_AUTO = chosen at load from the memory available
    uint64_t     reserve;      // auto budget: memory left free beside the estimated needs (other processes)
    uint64_t     vram;         // VRAM tier: bytes of experts cached in the memory of the GPU each layer runs on,
                               // over the RAM cache (cache_bytes); 0 = off (the experts compute on the CPU)
    const char * store_dir;    // packed expert store (moetier pack); NULL = read experts from the GGUF
    const char * policy;       // eviction policy (moetier_policy_names); NULL = default

    // Precision on a miss (HOBBIT eq. 2): a token's selected experts are ranked by gate weight
    // (normalised over the selected ones); an expert's score is the weight ranked above it. Score
    // <= t1: read the high-precision version; <= t2: the low one (needs a store); above: skip the
    // expert. The top-1 is always high. t1 = t2 = 1 (the default): every expert in high precision (exact).
    float   t1;
    float   t2;
    float   low_frac;  // share of the budget for low-precision slots (with a store)
    float   w_lru;     // weights of the "multi" policy's priority (HOBBIT eq. 3)
    float   w_lfu;
    float   w_lhu;
    float   w_fld;
    int32_t prefetch;        // layers predicted ahead by the stacked routers (HOBBIT sec. 3.3); 0 = off
    int32_t io_threads;      // prefetch lanes: reads in flight on the io_uring, or I/O threads that read
                             // prefetches; a prefetch walk starts at most this many reads. 0: no I/O pool
                             // (no io_uring, no prefetch): the compute threads read every miss
    float   prefetch_waste;  // prefetch byte cap: bytes of prefetch reads that their layer does not use stay
                             // below this share of the bytes the layers need (their misses and used
                             // prefetches); 0: prefetch only holds cached experts, reads none
    int32_t n_ctx;           // auto budget: context tokens whose KV cache is left room for (0: the model's
                             // training context, as llama.cpp allocates for n_ctx 0)
    int32_t grow;            // elastic budget: the cache grows past cache_bytes into memory the limit leaves
                             // free, up to every expert, and gives it back down to cache_bytes when free
                             // memory runs short. -1 (the default): on for MOETIER_CACHE_AUTO, off for a
                             // given size; 1: on; 0: off (cache_bytes is fixed)

    // Keep the booleans together to avoid misalignment during copy-by-value.
    bool io_uring;         // read with io_uring (no I/O threads) where the kernel allows it and reads
                           // are O_DIRECT (a store's into the slots, a GGUF's staged); false: I/O threads
    bool direct_io;        // O_DIRECT reads; refused by the file system -> buffered reads + a warning
    bool warm;             // warm start: the cache's hot state is kept in a sidecar next to the store
                           // (moetier_model_state_path); at load its hottest experts are read in the
                           // background, at model free (and every minute of decoding) it is written
    bool fitted_prefetch;  // prefetch: predict with the fitted predictor of the store or model where
                           // there is one (moetier fit-predictor); false: the next layers' routers
    bool lock_weights;     // mlock the mapped non-expert weights (every token reads them): memory pressure
                           // then takes the page cache and the expert cache's reads, never them
    bool verify_all;       // check every read of a store against its checksums (the default); false: the
                           // first read of each expert copy in this process only
    bool vram_cpu;         // cooperative compute: the CPU computes the VRAM misses that cost it less than a
                           // copy, from the RAM tier, while the GPU computes the rest (results added)
    bool vram_host;        // the VRAM tier's pools in host memory instead of a GPU's (the same bookkeeping,
                           // copies and graph: checks the tier where no GPU is)
    bool prefetch_gate;    // prefetch measures whether it pays: decode steps alternate between windows with
                           // and without prefetch reads, the faster arm runs on and is measured again
                           // later (the default); false: prefetch always reads
    bool huge_pages;       // the RAM tier's slot pools in transparent huge pages (MADV_HUGEPAGE), faulted
                           // in ahead of the misses by a background thread: fewer TLB misses when the
                           // experts compute; off by default (fresh huge pages fault in slowly in VMs)
};

// cache_bytes of an automatic budget: the memory limit (cgroup v2 memory.max, cgroup v1
// memory.limit_in_bytes, else MemAvailable) minus the resident non-expert weights, the KV cache of
// n_ctx tokens, the compute buffers, the process's own memory, reserve and a margin. The load logs
// the chosen size and why (also moetier_model_budget_note).
#define MOETIER_CACHE_AUTO UINT64_MAX

MOETIER_API struct moetier_params moetier_default_params(void);

// Types of the option table's rows.
enum moetier_param_type {
    MOETIER_PARAM_TYPE_SIZE   = 0,  // uint64_t bytes, written as a size ("512M")
    MOETIER_PARAM_TYPE_STRING = 1,  // const char *
    MOETIER_PARAM_TYPE_FLOAT  = 2,  // float
    MOETIER_PARAM_TYPE_INT    = 3,  // int32_t
    MOETIER_PARAM_TYPE_BOOL   = 4,  // bool (KEY=VALUE: 0/1, true/false)
};

// One row of the option table: a field of moetier_params.
struct moetier_param_info {
    const char * name;    // the field's name, also the KEY of --expert-opt
    int32_t      type;    // enum moetier_param_type
    double       min;     // valid range of numbers (inclusive)
    double       max;
    bool         is_opt;  // settable as KEY=VALUE (moetier_params_set_opts, --expert-opt)
    const char * help;    // one line, without the default
    size_t       offset;  // of the field in struct moetier_params
};

// The option table: n_params rows, in field order.
MOETIER_API int32_t                           moetier_param_count(void);
MOETIER_API const struct moetier_param_info * moetier_param_get(int32_t i);

// Help text of the KEY=VALUE options, one "- key: help (default ...)" line each, defaults from
// moetier_default_params(). Valid for the life of the program.
MOETIER_API const char * moetier_params_help(void);

// Fills p's strings: an empty store means none, an empty policy the default. Returns p.
MOETIER_API const struct moetier_params * moetier_params_from_strings(struct moetier_params * p,
                                                                      const char *            store_dir,
                                                                      const char *            policy);

// Sets options of p from a comma-separated list "key=value,key=value" of the table's KEY=VALUE
// options, then checks p. Returns NULL on success, else a message naming the option and what is
// wrong (valid until the next call on this thread).
MOETIER_API const char * moetier_params_set_opts(struct moetier_params * p, const char * opts);

// NULL if p is valid, else a message naming the bad field.
MOETIER_API const char * moetier_params_check(const struct moetier_params * p);

// Parses a byte size: a non-negative number with an optional K, M, G or T suffix (powers of 1024,
// optional trailing B or iB), e.g. "512M", "1.5G", "4096". Returns false if text is not a size.
MOETIER_API bool moetier_parse_size(const char * text, uint64_t * out);

// A cache budget: a size, or "auto" (MOETIER_CACHE_AUTO). Returns false if text is neither.
MOETIER_API bool moetier_parse_cache_size(const char * text, uint64_t * out);

// The memory this process may use, in bytes: the lowest cgroup limit on its path (v2 memory.max,
// v1 memory.limit_in_bytes), else MemAvailable of /proc/meminfo. root: where /proc and /sys are
// found ("" or NULL: "/"; tests point it at a fake tree). source (may be NULL) receives where the
// number comes from, e.g. "cgroup v2 /sys/fs/cgroup/a/memory.max". 0 if nothing could be read.
MOETIER_API uint64_t moetier_memory_limit(const char * root, char * source, size_t source_size);

// The memory an elastic cache may still take (moetier_params.grow), in bytes: the lowest cgroup
// limit minus that group's usage plus its inactive page cache (reclaimed first), and MemAvailable,
// whichever is lower. root as for moetier_memory_limit. 0 if nothing could be read.
MOETIER_API uint64_t moetier_memory_free(const char * root);

//
// loading a model with an expert cache
//

// Configures the expert cache of the next load of path_model on this thread
// (llama_model_load_from_file(path_model, ...), or _from_splits with path_model first): that load
// takes the configuration, which is copied here (strings included). params NULL, or cache_bytes 0
// without a store, removes a pending configuration. Returns false if params is invalid
// (moetier_last_error says why; nothing is pending then).
MOETIER_API bool moetier_model_configure(const char * path_model, const struct moetier_params * params);

// moetier_model_configure + llama_model_load_from_file: no configuration is left pending, whether
// the load succeeds or not. NULL on failure (moetier_last_error says why when moetier failed).
MOETIER_API struct llama_model * moetier_model_load(const char *                  path_model,
                                                    struct llama_model_params     mparams,
                                                    const struct moetier_params * params);

//
// devices: llama.cpp's RPC servers, and buffer types by name (as the llama.cpp tools' --rpc and -ot)
//

// Registers llama.cpp RPC servers ("HOST:PORT[,HOST:PORT...]", as --rpc) as devices of this process,
// each endpoint once: a model loaded afterwards may place layers on them (n_gpu_layers, or tensor
// overrides). A layer whose experts an RPC server holds computes them there, as stock; the expert
// cache serves this machine's layers. false: moetier_last_error() says why.
MOETIER_API bool moetier_rpc_add_servers(const char * servers);

// The buffer type named `name` ("CPU", "RPC0[127.0.0.1:50052]", "CUDA0"; as -ot takes it), for
// llama_model_params.tensor_buft_overrides. NULL if no device has it: moetier_last_error() lists
// the names there are.
MOETIER_API ggml_backend_buffer_type_t moetier_buffer_type_by_name(const char * name);

// Writes n as a human-readable size in powers of 1024 ("3.25 MiB") into buf (NUL-terminated,
// truncated to buf_size). Returns the length of the full text.
MOETIER_API int32_t moetier_format_size(uint64_t n, char * buf, size_t buf_size);

// Names of the available eviction policies, NULL-terminated.
MOETIER_API const char * const * moetier_policy_names(void);

// What kind of problem an error is, so that callers can tell a bad store from a bad model.
enum moetier_error_kind {
    MOETIER_ERROR_NONE   = 0,
    MOETIER_ERROR_CONFIG = 1,  // a parameter is invalid (range, unknown name or policy)
    MOETIER_ERROR_STORE  = 2,  // the expert store is missing, incomplete, corrupt or of another model
    MOETIER_ERROR_IO     = 3,  // reading a file failed (the file system, not its content)
    MOETIER_ERROR_MODEL  = 4,  // the model cannot be served (no expert tensors, a budget below one layer's experts)
};

// The message of the last moetier error on this thread ("" if none): set when a model load with a
// cache configured fails, or when moetier_pack fails. Valid until the next moetier call.
MOETIER_API const char * moetier_last_error(void);

// The kind of that error (MOETIER_ERROR_NONE if none).
MOETIER_API enum moetier_error_kind moetier_last_error_kind(void);

//
// expert cache of a loaded model
//

// Per-layer counters, also the cache's own (one schema from the counters to Python). A lookup is
// one distinct expert needed by one layer in one ubatch. hits + misses = lookups; misses =
// loads_high + loads_low + skipped.
struct moetier_layer_stats {
    int32_t  layer;
    uint64_t n_lookups;
    uint64_t n_hits;
    uint64_t n_misses;
    uint64_t n_bytes_read;
    uint64_t read_us;       // wall time this layer's compute waited for its expert reads (the load op)
    uint64_t n_hits_low;    // hits served by a cached low-precision version
    uint64_t n_loads_high;  // misses read in high precision
    uint64_t n_loads_low;   // misses read in low precision
    uint64_t n_skipped;     // misses not computed (score above t2)
    uint64_t n_bytes_low;   // bytes read for low-precision loads (part of n_bytes_read)
    // the VRAM tier (moetier_params.vram): lookups are the experts a ubatch selected (n_lookups), hits
    // the ones found in VRAM; the others were copied there from the RAM tier (read first on a RAM miss)
    uint64_t n_vram_hits;
    uint64_t n_vram_copies;  // experts copied from the RAM tier into VRAM
    uint64_t n_vram_bytes;   // bytes copied into VRAM
    uint64_t vram_copy_us;   // wall time of those copies (this layer's compute waited for them)
    uint64_t n_vram_cpu;     // VRAM misses computed on the CPU from the RAM tier (vram_cpu)
};

struct moetier_cache_info {
    int32_t  n_layers;          // MoE layers served by the cache
    int32_t  n_expert;          // experts per layer
    int32_t  n_groups;          // slot pool groups (layers whose experts share types and shapes)
    int32_t  n_slots;           // high-precision slots over all groups
    int32_t  n_slots_low;       // low-precision slots over all groups
    int32_t  n_held;            // high-precision slots holding an expert now (its read may be in flight)
    uint64_t expert_bytes_low;  // bytes of all served experts' low versions (0 without a store)
    uint64_t cache_bytes;       // bytes held by the slot pools
    uint64_t expert_bytes;      // bytes of all served experts (what stock llama.cpp loads)
    uint64_t min_cache_bytes;   // smallest budget accepted: one layer's experts per group
    int32_t  n_slots_vram;      // VRAM tier slots over all groups (0: no VRAM tier)
    uint64_t vram_bytes;        // bytes held by the VRAM tier's pools
    float    vram_copy_us;      // vram_cpu's cost model, measured at load: microseconds to copy one expert into
    float    vram_cpu_us;       // VRAM, and for the CPU to compute one expert for one token (0 without vram_cpu)
    uint64_t weights_locked;    // bytes of mapped non-expert weights locked in RAM (lock_weights)
    uint64_t reads_checked;     // expert reads checked against the store's checksums (verify_all)
    float    t1;                // the precision rule in effect (moetier_params)
    float    t2;
    bool     exact;             // every selected expert is computed in high precision: output equals stock llama.cpp
    bool     from_store;        // experts are read from a packed store, not from the GGUF
    bool     direct_io;         // reads bypass the page cache
    bool     io_uring;          // reads run on an io_uring: they start at routing and overlap compute
    bool     grow;              // the elastic budget is on: n_slots moves between n_slots_budget and n_slots_max
    int32_t  n_slots_budget;    // high-precision slots of the budget (the fewest an elastic cache keeps)
    int32_t  n_slots_max;       // high-precision slots an elastic cache may grow to (n_slots_budget if fixed)
    uint64_t budget_bytes;      // bytes of the budget's slots (cache_bytes of a fixed cache)
    uint64_t n_grown;           // slots the elastic budget added since load ...
    uint64_t n_shrunk;          // ... and took back
    uint64_t free_bytes;        // the memory the limit left free at its last check (0 if fixed)
    uint64_t free_margin;       // the free memory it keeps: between this and twice this (0 if fixed)
    int32_t  n_repacked;        // expert pools (projection x precision x group) on llama.cpp's repacked CPU
                                // kernels (CPU_REPACK), as stock computes the expert tensors it repacks
    int32_t  n_huge;            // slot pools (projection x precision x group) in transparent huge pages
};

// Prefetch counters (all zero without prefetch). Distances d = 1..MOETIER_MAX_PREFETCH: predictions
// made d layers ahead (decode tokens only), checked when the layer runs.
#define MOETIER_MAX_PREFETCH 8

struct moetier_prefetch_stats {
    uint64_t n_issued;      // expert reads queued by prefetch
    uint64_t n_hits;        // needed experts that a prefetch had read (or was reading)
    uint64_t n_waits;       // ... of which the layer had to wait for the read to finish
    uint64_t n_claimed;     // queued prefetches of needed experts taken over by the on-demand load
    uint64_t n_cancelled;   // queued prefetches of experts the layer did not need, dropped unread
    uint64_t n_wasted;      // prefetched experts the layer did not need, read anyway
    uint64_t bytes_read;    // bytes read by prefetch
    uint64_t bytes_wasted;  // ... for experts the layer did not need
    uint64_t n_capped;      // predicted misses not read: the byte cap (prefetch_waste) was spent
    uint64_t n_busy;        // predicted misses not read: the disk was behind (reads still queued)
    uint64_t n_steps_on;    // decode steps with prefetch reading (prefetch_gate: it measured that it pays)
    uint64_t n_steps_off;   // decode steps with prefetch standing back (measured not to pay, or being measured)
    uint64_t step_us_on;    // mean decode step time with prefetch reading, latest measurement (us; 0: none yet)
    uint64_t step_us_off;   // ... standing back
    uint64_t n_pred[MOETIER_MAX_PREFETCH];  // predictions checked per distance
    uint64_t n_top1[MOETIER_MAX_PREFETCH];  // predicted top-1 == actual top-1
    uint64_t n_allk[MOETIER_MAX_PREFETCH];  // predicted set == actual set
    uint64_t n_any[MOETIER_MAX_PREFETCH];   // at least one predicted expert was selected
};

MOETIER_API int32_t moetier_model_prefetch_stats(const struct llama_model * model, struct moetier_prefetch_stats * out);

// Latency of expert reads (one expert in one precision, from the read's start to its data in the
// slot, on demand or prefetch): count[i] reads took at most le_us[i] microseconds and more than
// le_us[i - 1]; the last bucket is unbounded (le_us = UINT64_MAX).
#define MOETIER_READ_HIST_BUCKETS 16

struct moetier_read_hist {
    uint64_t le_us[MOETIER_READ_HIST_BUCKETS];
    uint64_t count[MOETIER_READ_HIST_BUCKETS];
    uint64_t n;       // reads
    uint64_t sum_us;  // their latencies summed
};

// 0 on success, -1 if the model has no expert cache
MOETIER_API int32_t moetier_model_read_hist(const struct llama_model * model, struct moetier_read_hist * out);

// What an operator watches beyond the counters, in the Prometheus text format with metric names
// prefixed by prefix: the read latency histogram (PREFIXexpert_cache_read_seconds), the cache's
// size in bytes, prefetched experts used and wasted, warm-start reads. Written into buf
// (NUL-terminated, truncated to buf_size); returns the length of the full text (0 without a cache).
MOETIER_API int32_t moetier_model_prometheus(const struct llama_model * model,
                                             const char *               prefix,
                                             char *                     buf,
                                             size_t                     buf_size);

// true if the model serves its experts from the cache
MOETIER_API bool moetier_model_has_cache(const struct llama_model * model);

// The i-th warning of the model's load: a parameter that cannot take effect as given (say, t1 < t2
// without low-precision copies, policy weights on a policy that has none, prefetch with nothing to
// predict, io_uring refused by the kernel). NULL past the last one. Also logged at WARN level.
MOETIER_API const char * moetier_model_warning(const struct llama_model * model, int32_t i);

// How the budget was chosen: for an automatic budget the limit and what was subtracted, else the
// size given. "" if the model has no expert cache. Valid for the life of the model.
MOETIER_API const char * moetier_model_budget_note(const struct llama_model * model);

// 0 on success, -1 if the model has no expert cache
MOETIER_API int32_t moetier_model_cache_info(const struct llama_model * model, struct moetier_cache_info * info);

// Copies up to n_max per-layer counters into out; returns the number of served layers.
MOETIER_API int32_t moetier_model_layer_stats(const struct llama_model *   model,
                                              struct moetier_layer_stats * out,
                                              int32_t                      n_max);

// The counters summed over layers (layer = -1); all zero if the model has no expert cache.
MOETIER_API struct moetier_layer_stats moetier_model_stats_total(const struct llama_model * model);

MOETIER_API void moetier_model_reset_stats(struct llama_model * model);

// Warm start (moetier_params.warm). The sidecar: <store>/cache-state.bin with a store, else
// <first GGUF>.cache-state. Empty if the model has no cache or warm is off.
MOETIER_API const char * moetier_model_state_path(const struct llama_model * model);

// Writes the cache's hot state (per expert: uses and last use; which experts the slots hold) to the
// sidecar: a temporary file renamed over it, so a crash never leaves a torn one. 0 on success, -1 on
// error (moetier_last_error), 1 if the model has no cache or warm is off.
MOETIER_API int32_t moetier_model_save_state(const struct llama_model * model);

// The warm start of this load: experts read from the sidecar's ranking (0 if none: no sidecar, or
// one that was ignored with a warning), and how many of them were read so far.
MOETIER_API int32_t moetier_model_warm_progress(const struct llama_model * model, int32_t * n_read);

// Marks the start of a new sequence for the eviction policy (sequence-level records reset).
MOETIER_API void moetier_model_reset_sequence(struct llama_model * model);

// An abort callback for llama_set_abort_callback(ctx, moetier_abort_callback, model): stops the
// graph after a failed expert read, so that llama_decode returns 2 instead of computing with a
// slot that holds no data. moetier_model_error() then tells why.
MOETIER_API bool moetier_abort_callback(void * model);

// The first expert read error since the last moetier_model_clear_error ("" if none), and its kind
// (a checksum mismatch is MOETIER_ERROR_STORE, a failed read MOETIER_ERROR_IO).
MOETIER_API const char *            moetier_model_error(const struct llama_model * model);
MOETIER_API enum moetier_error_kind moetier_model_error_kind(const struct llama_model * model);
MOETIER_API void                    moetier_model_clear_error(struct llama_model * model);

// Expert reads that failed since load (each made its decode return 2); moetier_model_clear_error
// does not reset it. llama-server's /metrics shows it as expert_cache_read_errors_total.
MOETIER_API uint64_t moetier_model_read_errors(const struct llama_model * model);
// Expert reads that failed once and were tried again (a transient fault passes on the second try;
// what fails twice is also a read error). /metrics: expert_cache_read_retries_total.
MOETIER_API uint64_t moetier_model_read_retries(const struct llama_model * model);

// Fine-tuned variants of one MoE model (one architecture and shape; each loaded with an expert cache
// over its own store, prefetch=0, warm=0, exact) served from one expert cache: models[0]'s, rebuilt
// over the budget it was loaded with. The cache keys variant * n_expert + expert and reads each key
// from its variant's store; the other models' own caches are freed, and their cache counters
// (moetier_model_stats_total, ...) are models[0]'s, all variants together. Call before any decode;
// decode one model at a time (one cache); free the other models before models[0] (it keeps their
// stores). false + the reason in moetier_last_error (the file that does not fit).
MOETIER_API bool moetier_models_share_cache(struct llama_model ** models, int32_t n);
// Consolidation: the cache key of every (MoE layer, expert) of a model sharing a cache,
// keys[layer * n_expert + e] = v * n_expert + e: the copy of variant v serves it (its own by default).
// n = MoE layers * n_expert. false + moetier_last_error for a key that names another expert.
MOETIER_API bool moetier_model_set_expert_keys(struct llama_model * model, const int32_t * keys, int64_t n);

//
// expert store
//

// Called with bytes done / total; return false to cancel.
typedef bool (*moetier_progress_callback)(uint64_t done, uint64_t total, void * user_data);

struct moetier_pack_params {
    // ggml type name of the low-precision copy, e.g. "q4_0", or a list "q2_K,q4_0": each projection
    // takes the first type whose block size divides its rows; "auto" (the default): q4_0, and q2_K
    // (rows allowing) for experts of 5 bits per weight or fewer, whose q4_0 copy would be no smaller
    const char *              low_type;
    moetier_progress_callback progress_callback;
    void *                    progress_callback_user_data;
};

MOETIER_API struct moetier_pack_params moetier_pack_default_params(void);

// Writes the expert store of model_path into out_dir (created if missing): experts.bin holding each
// expert's projections in the model's precision and in low_type at 4096-aligned offsets, and
// manifest.json. Written to temporary names, fsynced, then renamed, so a failed pack never leaves a
// store that looks complete. Returns 0 on success, -1 on error (moetier_last_error and its kind),
// -2 if cancelled.
MOETIER_API int32_t moetier_pack(const char * model_path, const char * out_dir, struct moetier_pack_params params);

//
// fitted prefetch predictors (moetier-predictor.h)
//

// Where the prefetcher looks for the fitted predictor of model_path (and store_dir, NULL or "" for
// none), and the model identity such a file must name (key). Each writes a NUL-terminated string
// into out (out_size bytes) and returns its length, or -1 on error (moetier_last_error).
MOETIER_API int32_t moetier_predictor_path(const char * model_path,
                                           const char * store_dir,
                                           char *       out,
                                           size_t       out_size);
MOETIER_API int32_t moetier_predictor_model_key(const char * model_path, char * out, size_t out_size);

// What predicts the prefetches of a loaded model: "stacked routers", "fitted predictor PATH (N of M
// maps)", or "" (no prefetch, or no expert cache). Valid for the life of the model.
MOETIER_API const char * moetier_model_prefetch_source(const struct llama_model * model);

#ifdef __cplusplus
}
#endif
