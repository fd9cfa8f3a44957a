#pragma once

// The served experts as every lower file sees them: the two precisions, what a layer pass needs of
// an expert, one projection's bytes on disk and its slot pools, and one served layer. Plain data:
// the model fills it at load, the cache and the reads use it.

#include "ggml.h"
#include "moetier-io.h"
#include "moetier-store.h"
#include "moetier.h"

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

class moetier_cache;
class moetier_routing;

enum moetier_precision : int32_t {
    MOETIER_PRECISION_HIGH = 0,  // the model's own type
    MOETIER_PRECISION_LOW  = 1,  // the store's low-precision copy
};

static constexpr int32_t MOETIER_N_PRECISIONS = 2;

// what a ubatch needs of one expert: the most any of its tokens needs (HOBBIT eq. 2 per token)
enum moetier_need : uint8_t {
    MOETIER_NEED_NONE = 0,  // not selected
    MOETIER_NEED_SKIP = 1,  // selected, may be skipped on a miss (score above t2)
    MOETIER_NEED_LOW  = 2,  // the low version will do (score above t1)
    MOETIER_NEED_HIGH = 3,
};

// one served projection (gate, up, down or gate_up) of one layer
struct moetier_proj {
    std::string   name;
    ggml_tensor * meta                       = nullptr;  // the model's tensor, created without data
    // the group's pool per precision [ne0, ne1, n_slots]
    ggml_tensor * pool[MOETIER_N_PRECISIONS] = { nullptr, nullptr };
    ggml_tensor * vram_pool     = nullptr;  // the group's VRAM tier pool [ne0, ne1, n_slots + zero slots], if any
    // with every expert in VRAM (preload_vram): this layer's slots of vram_pool [ne0, ne1, n_expert], a
    // view made a leaf of the graph (no op), which the mul_mat_ids take as stock's take its expert tensors
    ggml_tensor * vram_view     = nullptr;
    ggml_tensor * vram_pool_low = nullptr;        // the VRAM tier's low-precision pool (mixed precision), if any

    const moetier_file *       file   = nullptr;  // GGUF or store data file
    const moetier_store_proj * store  = nullptr;  // per-expert offsets and checksums when reading a store
    uint64_t                   offset = 0;        // GGUF: file offset of expert 0
    uint64_t                   bytes  = 0;        // unpadded bytes of one high-precision expert

    // Variants of one model sharing this layer's cache (moetier_models_share_cache): the expert ids
    // the cache sees are keys, variant * n_local + expert, and each variant's copies live in its own
    // store. n_local 0: no variants, a key is the expert.
    int32_t                                 n_local = 0;
    std::vector<const moetier_file *>       variant_file;   // [variant]
    std::vector<const moetier_store_proj *> variant_store;  // [variant]

    const moetier_file * file_of(int32_t key) const { return n_local ? variant_file[key / n_local] : file; }

    const moetier_store_proj * store_of(int32_t key) const { return n_local ? variant_store[key / n_local] : store; }

    uint64_t expert_offset(int32_t key, moetier_precision prec) const {
        if (store) {
            const moetier_store_proj * s = store_of(key);
            const int32_t              e = n_local ? key % n_local : key;
            return prec == MOETIER_PRECISION_LOW ? s->offset_low[e] : s->offset_high[e];
        }
        return offset + (uint64_t) key * bytes;
    }

    uint64_t expert_bytes(moetier_precision prec) const {
        return prec == MOETIER_PRECISION_LOW ? store->bytes_low : bytes;
    }

    uint64_t expert_checksum(int32_t key, moetier_precision prec) const {
        const moetier_store_proj * s = store_of(key);
        const int32_t              e = n_local ? key % n_local : key;
        return prec == MOETIER_PRECISION_LOW ? s->checksum_low[e] : s->checksum_high[e];
    }

    // a store's, per precision and expert: its copy was read back intact once (the checksum matched).
    // Every read is checked by default (verify_all); with verify_all=0 a later read of a verified
    // copy skips the check. Set by whichever thread finishes the read.
    std::shared_ptr<std::atomic<bool>[]> verified[MOETIER_N_PRECISIONS];
};

// one served MoE layer; the custom ops' userdata
struct moetier_layer {
    int32_t                   il    = -1;
    moetier_cache *           cache = nullptr;  // the pool group serving it (set by the cache; not called below it)
    std::vector<moetier_proj> projs;            // in the group's projection order
    moetier_layer_stats       stats      = {};  // this layer's counters (stats.layer = il)
    moetier_latency_hist *    read_hist  = nullptr;  // the model's read latencies (every read of the layer adds one)
    std::atomic<uint64_t> *   n_checked  = nullptr;  // the model's count of reads checked against the store's checksums
    bool                      verify_all = true;     // check every read of a store, not only each copy's first
    // benchmarks only (MOETIER_ROUTING_TRACE): the trace whose choices replace the router's, and this
    // layer's index among the served layers; nullptr: the model's own routing
    moetier_routing *         routing    = nullptr;
    int32_t                   routing_layer = -1;
    // per expert, for the warm-start sidecar: lookups (seeded from the sidecar, halved) and the
    // group's tick of the last one; atomics: the sidecar is also written while decoding runs
    std::unique_ptr<std::atomic<uint32_t>[]> uses;
    std::unique_ptr<std::atomic<uint64_t>[]> last_use;

    // per precision: projs in file order when, for every expert, they lie back to back in one file (a
    // store): one vectored read per expert; else empty
    std::vector<int32_t> file_order[MOETIER_N_PRECISIONS];

    // a variant's layer whose experts another model's cache serves (moetier_models_share_cache): the
    // ops resolve and load on target, the layer of the same index of the first model, with this
    // layer's router ids mapped through keys (keys[e]: the cache key of expert e; also set on the
    // first model's layers by moetier_model_set_expert_keys). nullptr / empty: none
    moetier_layer *      target = nullptr;
    std::vector<int32_t> keys;
    std::vector<int32_t> key_ids;  // scratch of the resolve op: the ids mapped through keys
};

// the counters of b added to a (a.layer is kept)
static inline void moetier_stats_add(moetier_layer_stats & a, const moetier_layer_stats & b) {
    a.n_lookups += b.n_lookups;
    a.n_hits += b.n_hits;
    a.n_misses += b.n_misses;
    a.n_bytes_read += b.n_bytes_read;
    a.read_us += b.read_us;
    a.n_hits_low += b.n_hits_low;
    a.n_loads_high += b.n_loads_high;
    a.n_loads_low += b.n_loads_low;
    a.n_skipped += b.n_skipped;
    a.n_bytes_low += b.n_bytes_low;
    a.n_vram_hits += b.n_vram_hits;
    a.n_vram_copies += b.n_vram_copies;
    a.n_vram_bytes += b.n_vram_bytes;
    a.vram_copy_us += b.vram_copy_us;
    a.n_vram_cpu += b.n_vram_cpu;
}
