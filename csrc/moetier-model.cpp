#include "moetier-model.h"

#include "llama-model.h"
#include "moetier-budget.h"
#include "moetier-impl.h"
#include "moetier-predictor.h"
#include "moetier-prefetch.h"
#include "moetier-read.h"
#include "moetier-routing.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <stdexcept>

// [TAG_MOETIER_EXTRA] served tensors carry their layer in ggml_tensor::extra: they are never
// allocated in a backend buffer, so no backend owns that field for them
static constexpr uint32_t MOETIER_LAYER_MAGIC = 0x4d4f4554;  // "MOET"

struct moetier_layer_tag {
    uint32_t        magic = MOETIER_LAYER_MAGIC;
    moetier_layer * layer = nullptr;
};

moetier_model::moetier_model(const moetier_params & params, const std::vector<std::string> & paths_) : paths(paths_) {
    cache_bytes     = params.cache_bytes;
    budget_auto     = params.cache_bytes == MOETIER_CACHE_AUTO;
    reserve         = params.reserve;
    n_ctx           = params.n_ctx;
    warm_on         = params.warm;
    lock_weights    = params.lock_weights;
    verify_all      = params.verify_all;
    fitted_prefetch = params.fitted_prefetch;
    process_anon    = moetier_process_anon_bytes("");
    direct_io       = params.direct_io;
    policy_name     = params.policy && params.policy[0] ? params.policy : moetier_default_params().policy;
    vram            = params.vram;
    vram_host       = params.vram_host;
    vram_cpu        = params.vram_cpu;
    if (const char * bad = moetier_params_check(&params)) {
        throw moetier_exception(MOETIER_ERROR_CONFIG, bad);
    }
    if (vram_cpu && (params.t1 < 1.0f || params.t2 < 1.0f)) {
        throw moetier_exception(
            MOETIER_ERROR_CONFIG,
            format("vram_cpu=1 (cooperative compute) serves exact modes only (t1 = t2 = 1), but t1=%g t2=%g ask "
                   "for low-precision or skipped experts; drop vram_cpu, or the thresholds",
                   params.t1, params.t2));
    }
    if (vram == 0 && (vram_host || vram_cpu)) {
        throw moetier_exception(
            MOETIER_ERROR_CONFIG,
            format("%s works on the VRAM tier, but vram=0 turns the tier off; give vram a budget",
                   vram_host ? "vram_host=1 (the tier in host memory)" : "vram_cpu=1 (the CPU computing VRAM misses)"));
    }
    // fault injection for tests (moetier-io.h); unset, no read is touched
    std::string fault_err;
    if (!moetier_faults_configure(getenv("MOETIER_FAULTS"), fault_err)) {
        throw moetier_exception(MOETIER_ERROR_CONFIG, fault_err);
    }
    precision.t1   = params.t1;
    precision.t2   = params.t2;
    low_frac       = params.low_frac;
    prefetch       = params.prefetch;
    io_threads     = params.io_threads;
    prefetch_waste = params.prefetch_waste;
    prefetch_gate  = params.prefetch_gate;
    huge_pages     = params.huge_pages;
    grow           = params.grow;
    use_uring      = params.io_uring;
    policy_weights = { params.w_lru, params.w_lfu, params.w_lhu, params.w_fld };
    std::string policy_err;
    if (!moetier_policy_create(policy_name, policy_weights, {}, &policy_err)) {
        throw moetier_exception(MOETIER_ERROR_CONFIG, "expert cache: " + policy_err);
    }
    const moetier_params defaults = moetier_default_params();
    if (policy_name != "multi" && (params.w_lru != defaults.w_lru || params.w_lfu != defaults.w_lfu ||
                                   params.w_lhu != defaults.w_lhu || params.w_fld != defaults.w_fld)) {
        warn(
            format("w_lru, w_lfu, w_lhu, w_fld weigh the priority of policy multi; policy %s has no weights and "
                   "ignores them",
                   policy_name.c_str()));
    }
    if (paths.empty()) {
        throw std::runtime_error("no model file");
    }

    if (params.store_dir && params.store_dir[0]) {
        if (paths.size() > 1) {
            throw std::runtime_error("expert stores of split GGUF models are not supported; merge the splits first");
        }
        const moetier_model_identity id = moetier_model_identity_compute(paths[0]);
        try {
            store      = std::make_shared<moetier_store>(params.store_dir, id, paths[0]);
            store_file = std::make_shared<moetier_file>(store->data_path(), direct_io);
            store_file->set_fault_injection(true);
        } catch (const std::runtime_error & e) {
            throw moetier_exception(MOETIER_ERROR_STORE, e.what());
        }
        if (store->checksum() != MOETIER_STORE_CHECKSUM_CRC32C) {
            warn(
                format("%s: a store of an earlier version: every read is verified with its %s hash, a few GB/s "
                       "on one core; re-run `moetier pack` for CRC32C, at memory speed",
                       store->manifest_path().c_str(), moetier_store_checksum_name(store->checksum())));
        }
    } else {
        for (const auto & p : paths) {
            files.push_back(std::make_unique<moetier_file>(p, direct_io));
            files.back()->set_fault_injection(true);
        }
    }

    if (direct_io) {
        std::vector<const moetier_file *> opened = { store_file.get() };
        for (const auto & f : files) {
            opened.push_back(f.get());
        }
        for (const moetier_file * f : opened) {
            if (f && !f->direct()) {
                warn(
                    format("direct_io: O_DIRECT refused for %s; reads go through the page cache (dropped after each "
                           "read)",
                           f->path().c_str()));
            }
        }
    }

    ggml_init_params ip = {
        /*.mem_size   =*/ggml_tensor_overhead() * 4096,
        /*.mem_buffer =*/nullptr,
        /*.no_alloc   =*/true,
    };
    meta_ctx = ggml_init(ip);
    if (!meta_ctx) {
        throw std::runtime_error("failed to create the expert metadata context");
    }
}

moetier_model::~moetier_model() {
    if (saver.joinable()) {
        {
            std::lock_guard<std::mutex> lock(saver_mutex);
            saver_stop = true;
        }
        saver_cv.notify_all();
        saver.join();
    }
    if (warm) {
        // stop the background reads (none may outlive the pools); the slots they never filled must
        // not be saved as resident
        warm->stop();
        for (auto & c : caches) {
            c->end_warm();
        }
        warm.reset();
    }
    if (!state_path.empty()) {
        std::string err;
        if (!save_state(err)) {
            MOETIER_LOG_WARN("moetier: warm start: %s\n", err.c_str());
        }
    }
    io.reset();  // joins the I/O threads: no read may outlive the pools
    log_totals();
    caches.clear();
    if (meta_ctx) {
        for (ggml_tensor * t = ggml_get_first_tensor(meta_ctx); t; t = ggml_get_next_tensor(meta_ctx, t)) {
            delete (moetier_layer_tag *) t->extra;
            t->extra = nullptr;
        }
        ggml_free(meta_ctx);
    }
}

void moetier_model::init_routing(const llama_model & model) {
    const char * path = getenv("MOETIER_ROUTING_TRACE");
    if (path == nullptr || path[0] == '\0') {
        return;
    }
    routing              = std::make_unique<moetier_routing>(path);
    const int32_t n_used = (int32_t) model.hparams.n_expert_used((uint32_t) layers[0]->il);
    if (routing->n_layers() != (int32_t) layers.size() || routing->n_expert() != n_expert ||
        routing->n_used() != n_used) {
        throw std::runtime_error(
            format("MOETIER_ROUTING_TRACE=%s: the trace routes %d MoE layers, top-%d of %d experts; "
                   "the model has %zu, top-%d of %d: write a model of the trace's geometry",
                   path, routing->n_layers(), routing->n_used(), routing->n_expert(), layers.size(), n_used, n_expert));
    }
    for (const auto & c : caches) {
        if (c->vram_static()) {
            throw std::runtime_error(
                format("MOETIER_ROUTING_TRACE=%s: a VRAM tier that holds every expert computes them "
                       "as the router chose, with no slot choice to route through; give vram "
                       "less than every expert",
                       path));
        }
    }
    for (size_t i = 0; i < layers.size(); ++i) {
        layers[i]->routing       = routing.get();
        layers[i]->routing_layer = (int32_t) i;
    }
    warn(
        format("MOETIER_ROUTING_TRACE=%s: every MoE layer's experts are taken from this routing trace, not from the "
               "model's router: speed and cache figures are those of the traced model's routing, and the output is "
               "meaningless (a benchmark mode)",
               path));
}

void moetier_model::log_totals() const {
    // the counters of the whole run, for the tools that print no stats of their own (llama-cli,
    // llama-perplexity, llama-batched-bench)
    moetier_layer_stats t = {};
    for (const auto & l : layers) {
        moetier_stats_add(t, l->stats);
    }
    if (t.n_lookups == 0) {
        return;
    }
    MOETIER_LOG_INFO("moetier: expert cache totals: %" PRIu64 " lookups, RAM tier %" PRIu64 " hits (%.1f%%), %" PRIu64
                     " misses, %s read\n",
                     t.n_lookups, t.n_hits, 100.0 * (double) t.n_hits / (double) t.n_lookups, t.n_misses,
                     moetier_format_bytes(t.n_bytes_read).c_str());
    if (t.n_vram_hits + t.n_vram_copies > 0) {
        MOETIER_LOG_INFO("moetier: expert cache totals: VRAM tier %" PRIu64 " hits (%.1f%%), %" PRIu64
                         " copies from RAM, %s copied in %.1f ms\n",
                         t.n_vram_hits, 100.0 * (double) t.n_vram_hits / (double) t.n_lookups, t.n_vram_copies,
                         moetier_format_bytes(t.n_vram_bytes).c_str(), (double) t.vram_copy_us / 1000.0);
    }
}

moetier_layer * moetier_model::layer_of(const ggml_tensor * t) {
    if (t == nullptr || t->extra == nullptr || t->buffer != nullptr) {
        return nullptr;
    }
    const moetier_layer_tag * tag = (const moetier_layer_tag *) t->extra;
    return tag->magic == MOETIER_LAYER_MAGIC ? tag->layer : nullptr;
}

// whether buft is an RPC server's memory (llama.cpp's --rpc devices, as -ngl or -ot place layers there)
// "RPC0 (10.0.0.2:50052)": a device's name and what it is
static std::string moetier_dev_label(ggml_backend_dev_t dev) {
    return std::string(ggml_backend_dev_name(dev)) + " (" + ggml_backend_dev_description(dev) + ")";
}

// whether dev is an RPC server's (llama.cpp's --rpc devices)
static bool moetier_dev_is_rpc(ggml_backend_dev_t dev) {
    ggml_backend_reg_t reg = dev ? ggml_backend_dev_backend_reg(dev) : nullptr;
    return reg != nullptr && strcmp(ggml_backend_reg_name(reg), "RPC") == 0;
}

ggml_tensor * moetier_model::create_tensor(const std::string &                                 name,
                                           const ggml_tensor *                                 cur,
                                           uint16_t                                            file_idx,
                                           size_t                                              offs,
                                           const std::function<ggml_backend_buffer_type *()> & buft) {
    int32_t           il   = -1;
    const std::string proj = moetier_expert_tensor_proj(name, &il);
    if (proj.empty() || ggml_n_dims(cur) != 3) {
        return nullptr;
    }
    // a layer whose experts an RPC server holds computes them there, from its own memory, as stock:
    // the cache serves this machine's layers (its slots, reads and graph ops are local)
    ggml_backend_buffer_type_t where = buft ? buft() : nullptr;
    ggml_backend_dev_t         dev   = where ? ggml_backend_buft_get_device(where) : nullptr;
    if (moetier_dev_is_rpc(dev)) {
        if (std::find(remote_layers.begin(), remote_layers.end(), il) == remote_layers.end()) {
            remote_layers.push_back(il);
        }
        remote_device = moetier_dev_label(dev);
        return nullptr;
    }
    if (where != nullptr && std::string(ggml_backend_buft_name(where)) == "CPU_REPACK") {
        repack_buft = where;  // stock would compute these experts on the repacked kernels: so do the pools
    }
    if (n_expert == 0) {
        n_expert = (int32_t) cur->ne[2];
    } else if (n_expert != cur->ne[2]) {
        throw std::runtime_error(format("tensor %s has %" PRId64
                                        " experts, other layers have %d; per-layer expert counts are not supported",
                                        name.c_str(), cur->ne[2], n_expert));
    }

    moetier_layer * layer = nullptr;
    for (auto & l : layers) {
        if (l->il == il) {
            layer = l.get();
        }
    }
    if (!layer) {
        layers.push_back(std::make_unique<moetier_layer>());
        layer              = layers.back().get();
        layer->il          = il;
        layer->stats.layer = il;
    }

    moetier_proj p;
    p.name  = proj;
    p.bytes = cur->nb[2];
    if (store) {
        p.store = store->find(il, proj);
        if (!p.store) {
            throw moetier_exception(MOETIER_ERROR_STORE,
                                    format("%s: the store has no entry for %s; re-run `moetier pack` on this model",
                                           store->manifest_path().c_str(), name.c_str()));
        }
        if (p.store->type_high != cur->type || p.store->ne0 != cur->ne[0] || p.store->ne1 != cur->ne[1] ||
            (int64_t) p.store->offset_high.size() != cur->ne[2] || p.store->bytes_high != p.bytes) {
            throw moetier_exception(
                MOETIER_ERROR_STORE,
                format("%s: entry for %s does not match the model (type %s %" PRId64 "x%" PRId64 " vs %s %" PRId64
                       "x%" PRId64 "); "
                       "re-run `moetier pack` on this model",
                       store->manifest_path().c_str(), name.c_str(), ggml_type_name(p.store->type_high), p.store->ne0,
                       p.store->ne1, ggml_type_name(cur->type), cur->ne[0], cur->ne[1]));
        }
        p.file = store_file.get();
    } else {
        if (file_idx >= files.size()) {
            throw std::runtime_error(format("tensor %s is in split %u, but only %zu files were given", name.c_str(),
                                            file_idx, files.size()));
        }
        p.file   = files[file_idx].get();
        p.offset = offs;
    }

    ggml_tensor * t = ggml_dup_tensor(meta_ctx, cur);
    ggml_set_name(t, name.c_str());
    t->extra = new moetier_layer_tag{ MOETIER_LAYER_MAGIC, layer };
    p.meta   = t;
    layer->projs.push_back(p);
    expert_bytes += ggml_nbytes(cur);
    if (p.store) {
        expert_bytes_low += p.store->bytes_low * (uint64_t) cur->ne[2];
    }
    return t;
}

// the device a VRAM tier serving layer il lives on: the GPU the layer runs on (the CPU device with
// vram_host); nullptr where the layer runs on the CPU or no tier is asked for
// The CUDA kernels (mmvq, mmq) find a slot of a pool in 32-bit counts of quant blocks: in a pool of
// 2^31 blocks or more, a slot's offset wraps into another slot's weights or outside the buffer. Stock
// tensors hold one layer and never get there; a pool holds a whole group's slots. The most slots (zero
// slots apart) each projection's pool of this precision can hold.
static int64_t moetier_vram_slot_cap(const std::vector<moetier_proj> & projs, moetier_precision prec, int64_t n_zero) {
    int64_t cap = INT64_MAX;
    for (const auto & p : projs) {
        const ggml_type type   = prec == MOETIER_PRECISION_LOW ? p.store->type_low : p.meta->type;
        const int64_t   blocks = std::max<int64_t>(1, (int64_t) (p.expert_bytes(prec) / ggml_type_size(type)));
        cap                    = std::min(cap, (int64_t) INT32_MAX / blocks - n_zero);
    }
    return cap;
}

static ggml_backend_dev_t moetier_vram_device(const llama_model & model, int32_t il, uint64_t vram, bool host) {
    if (vram == 0) {
        return nullptr;
    }
    if (host) {
        return ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    }
    ggml_backend_dev_t d = model.dev_layer(il);
    if (d == nullptr) {
        return nullptr;
    }
    if (moetier_dev_is_rpc(d)) {
        // its copies need a local device's streams and events; an RPC device has neither
        throw std::runtime_error(
            format("layer %d runs on the RPC server %s, whose memory cannot hold a VRAM tier; "
                   "drop vram, or keep the layers the cache serves on this machine",
                   il, moetier_dev_label(d).c_str()));
    }
    const enum ggml_backend_dev_type t = ggml_backend_dev_type(d);
    return t == GGML_BACKEND_DEVICE_TYPE_GPU || t == GGML_BACKEND_DEVICE_TYPE_IGPU ? d : nullptr;
}

void moetier_model::check_served() {
    if (layers.empty() && !remote_layers.empty()) {
        throw std::runtime_error(
            format("every MoE layer's experts are on the RPC server %s: the expert cache serves this machine's layers "
                   "only; keep some layers here (a smaller -ngl, or -ot) or drop the expert cache option",
                   remote_device.c_str()));
    }
    if (layers.empty()) {
        throw std::runtime_error(
            "the model has no expert tensors (blk.N.ffn_*_exps.weight): the expert cache needs a MoE model; "
            "drop the expert cache option for dense models");
    }
    for (const auto & l : layers) {
        // a layer computes its experts where they are: some on the RPC server and the others here
        // would send the server slot ids, or compute here with the server's tensors missing
        if (std::find(remote_layers.begin(), remote_layers.end(), l->il) != remote_layers.end()) {
            throw std::runtime_error(
                format("layer %d's expert tensors are split between the RPC server %s and this machine: the "
                       "expert cache needs all of a layer's ffn_*_exps on one side; place them together (-ot)",
                       l->il, remote_device.c_str()));
        }
    }
    if (!remote_layers.empty()) {
        std::sort(remote_layers.begin(), remote_layers.end());
        MOETIER_LOG_INFO(
            "moetier: %zu MoE layers (%d to %d) compute their experts on the RPC server %s, as stock; "
            "the expert cache serves the other %zu\n",
            remote_layers.size(), remote_layers.front(), remote_layers.back(), remote_device.c_str(), layers.size());
    }
}

void moetier_model::finish_load(const llama_model & model) {
    std::sort(layers.begin(), layers.end(), [](const auto & a, const auto & b) { return a->il < b->il; });
    for (auto & l : layers) {
        l->read_hist  = &read_hist;
        l->n_checked  = &n_checked;
        l->verify_all = verify_all;
        for (auto & p : l->projs) {
            for (int32_t prec = 0; prec < MOETIER_N_PRECISIONS && p.store; ++prec) {
                p.verified[prec].reset(new std::atomic<bool>[n_expert]);
                for (int32_t e = 0; e < n_expert; ++e) {
                    p.verified[prec][e].store(false, std::memory_order_relaxed);
                }
            }
        }
        l->uses.reset(new std::atomic<uint32_t>[n_expert]);
        l->last_use.reset(new std::atomic<uint64_t>[n_expert]);
        for (int32_t e = 0; e < n_expert; ++e) {
            l->uses[e].store(0, std::memory_order_relaxed);
            l->last_use[e].store(0, std::memory_order_relaxed);
        }
    }

    // pool groups: layers whose projections agree in name, type and shape share slots
    std::map<std::string, std::vector<moetier_layer *>> groups;
    for (auto & l : layers) {
        std::sort(l->projs.begin(), l->projs.end(),
                  [](const moetier_proj & a, const moetier_proj & b) { return a.name < b.name; });
        std::string              sig;
        const ggml_backend_dev_t dev = moetier_vram_device(model, l->il, vram, vram_host);
        if (dev != nullptr) {
            sig += std::string("@") + ggml_backend_dev_name(dev) + ";";  // a VRAM tier per device
        }
        for (const auto & p : l->projs) {
            sig += format("%s:%s:%" PRId64 "x%" PRId64 ";", p.name.c_str(), ggml_type_name(p.meta->type), p.meta->ne[0],
                          p.meta->ne[1]);
            if (p.store != nullptr && p.store->type_low != GGML_TYPE_COUNT) {
                // a group's low-precision slots are sized and typed from its first layer: a store
                // whose layers hold other low types (or sizes) gives them groups of their own
                sig += format("low:%s:%" PRIu64 ";", ggml_type_name(p.store->type_low), p.store->bytes_low);
            }
        }
        groups[sig].push_back(l.get());
    }

    // every group needs one layer's experts in high precision (a ubatch may route to all of them);
    // low_frac of the budget goes to low-precision slots when a miss can be read in low precision
    // (a store, and t1 < min(t2, 1)); the rest is split in proportion to each group's expert bytes
    struct plan {
        std::vector<moetier_layer *> layers;
        uint64_t                     slot_bytes[2];
        int64_t                      n_slots[2];
        ggml_backend_dev_t           dev        = nullptr;  // of its VRAM tier
        uint64_t                     vram_bytes = 0;        // of one expert there (unpadded)
        int64_t                      n_vram     = 0;
        uint64_t vram_bytes_low = 0;  // of one expert's low-precision copy there (mixed precision; 0: none)
        int64_t  n_vram_low     = 0;
        int32_t  n_used         = 1;  // experts a token selects (the VRAM tier's zero slots)
    };

    std::vector<plan> plans;
    uint64_t          group_bytes[2] = { 0, 0 };
    min_cache_bytes                  = 0;
    for (auto & [sig, ls] : groups) {
        plan pl = {
            ls, { 0,        0 },
             { n_expert, 0 }
        };
        for (const auto & p : ls[0]->projs) {
            pl.slot_bytes[MOETIER_PRECISION_HIGH] += moetier_align_up(p.bytes);
            pl.slot_bytes[MOETIER_PRECISION_LOW] += p.store ? moetier_align_up(p.store->bytes_low) : 0;
        }
        min_cache_bytes += pl.slot_bytes[MOETIER_PRECISION_HIGH] * (uint64_t) n_expert;
        for (int prec = 0; prec < 2; ++prec) {
            group_bytes[prec] += pl.slot_bytes[prec] * (uint64_t) n_expert * ls.size();
        }
        plans.push_back(pl);
    }
    if (budget_auto && cache_bytes < min_cache_bytes && auto_room >= min_cache_bytes && elastic_on()) {
        // the margin covers estimates (compute buffers, code pages): one layer's experts may come out of
        // it when an elastic cache would give back, under pressure, anything it grows to
        budget_note += format("; raised to the minimum %s (one layer's experts%s) out of the margin",
                              moetier_format_bytes(min_cache_bytes).c_str(), plans.size() > 1 ? " per pool group" : "");
        cache_bytes = min_cache_bytes;
        MOETIER_LOG_INFO("%s: %s\n", paths[0].c_str(), budget_note.c_str());
    }
    if (cache_bytes < min_cache_bytes) {
        if (budget_auto) {
            throw std::runtime_error(
                format("%s: below the minimum %s (one layer's %d experts%s): not enough memory "
                       "for an expert cache; lower -c/n_ctx or give a budget",
                       budget_note.c_str(), moetier_format_bytes(min_cache_bytes).c_str(), n_expert,
                       plans.size() > 1 ? " per pool group" : ""));
        }
        throw std::runtime_error(
            format("expert cache budget %s is below the minimum %s (one layer's %d experts%s); "
                   "use a budget of at least %" PRIu64 " bytes",
                   moetier_format_bytes(cache_bytes).c_str(), moetier_format_bytes(min_cache_bytes).c_str(), n_expert,
                   plans.size() > 1 ? " per pool group" : "", min_cache_bytes));
    }
    const bool use_low = store && low_frac > 0.0f && precision.t1 < std::min(precision.t2, 1.0f) &&
                         group_bytes[MOETIER_PRECISION_LOW] > 0;
    if (precision.t1 < std::min(precision.t2, 1.0f) && !use_low) {
        warn(format("t1=%g < t2=%g asks for low-precision reads, but %s: those misses read the high version",
                    precision.t1, precision.t2,
                    !store           ? "no expert store is given (the low copies live in one)" :
                    low_frac <= 0.0f ? "low_frac=0 leaves no low-precision slots" :
                                       "the store has no low copies"));
    } else if (!use_low && low_frac != moetier_default_params().low_frac) {
        warn(format("low_frac=%g has no effect: no miss is read in low precision (t1=%g is not below t2=%g)", low_frac,
                    precision.t1, precision.t2));
    }
    uint64_t budget[2];
    budget[MOETIER_PRECISION_LOW] =
        use_low ? std::min<uint64_t>((uint64_t) ((double) cache_bytes * low_frac), cache_bytes - min_cache_bytes) : 0;
    budget[MOETIER_PRECISION_HIGH] = cache_bytes - min_cache_bytes - budget[MOETIER_PRECISION_LOW];
    for (auto & pl : plans) {
        const int64_t max_slots = (int64_t) n_expert * (int64_t) pl.layers.size();
        for (int prec = 0; prec < 2; ++prec) {
            if (pl.slot_bytes[prec] == 0 || group_bytes[prec] == 0) {
                continue;
            }
            const double share = (double) budget[prec] * (double) (pl.slot_bytes[prec] * n_expert * pl.layers.size()) /
                                 (double) group_bytes[prec];
            pl.n_slots[prec] =
                std::min<int64_t>(max_slots, pl.n_slots[prec] + (int64_t) (share / (double) pl.slot_bytes[prec]));
        }
    }

    // the VRAM tier: groups whose layers run on a GPU, one layer's experts each, the rest of the budget
    // split as the RAM tier's
    if (vram > 0) {
        const bool        auto_vram = vram == MOETIER_CACHE_AUTO;
        const std::string vram_text = auto_vram ? "auto" : moetier_format_bytes(vram);
        uint64_t          all_vram  = 0;
        min_vram_bytes              = 0;
        for (auto & pl : plans) {
            pl.dev = moetier_vram_device(model, pl.layers[0]->il, vram, vram_host);
            if (pl.dev == nullptr) {
                continue;
            }
            for (const auto & p : pl.layers[0]->projs) {
                pl.vram_bytes += p.bytes;
                // mixed precision: low-precision copies live in VRAM as well, in a pool of their own
                pl.vram_bytes_low += pl.n_slots[MOETIER_PRECISION_LOW] > 0 ? p.store->bytes_low : 0;
            }
            // one layer's experts, and the zero slots (one per expert a token selects)
            pl.n_used = 1;
            for (const moetier_layer * l : pl.layers) {
                pl.n_used = std::max<int32_t>(pl.n_used, (int32_t) model.hparams.n_expert_used((uint32_t) l->il));
            }
            min_vram_bytes += (pl.vram_bytes + pl.vram_bytes_low) * (uint64_t) (n_expert + pl.n_used);
            all_vram += (pl.vram_bytes + pl.vram_bytes_low) * (uint64_t) n_expert * pl.layers.size();
        }
        if (all_vram == 0) {
            const bool has_gpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_GPU) != nullptr ||
                                 ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_IGPU) != nullptr;
            throw moetier_exception(
                MOETIER_ERROR_CONFIG,
                has_gpu ? format("vram=%s: no MoE layer runs on a GPU; offload the layers (-ngl 99, n_gpu_layers) "
                                 "or drop vram",
                                 vram_text.c_str()) :
                          format("vram=%s: this build has no GPU backend (build with -C cmake.define.MOETIER_CUDA=ON); "
                                 "drop vram, or set vram_host=1 to run the tier in host memory",
                                 vram_text.c_str()));
        }
        std::string                            vram_note;
        std::map<ggml_backend_dev_t, uint64_t> dev_avail;  // auto: what each device has for the tier
        std::map<ggml_backend_dev_t, uint64_t> dev_min;    // the groups' minimum per device
        std::map<ggml_backend_dev_t, uint64_t> dev_all;    // the groups' expert bytes per device
        for (const auto & pl : plans) {
            if (pl.dev != nullptr) {
                dev_min[pl.dev] += (pl.vram_bytes + pl.vram_bytes_low) * (uint64_t) (n_expert + pl.n_used);
                dev_all[pl.dev] += (pl.vram_bytes + pl.vram_bytes_low) * (uint64_t) n_expert * pl.layers.size();
            }
        }
        if (auto_vram) {
            // each GPU's free memory now (the dense layers are on it) less what the context will put there:
            // the KV cache of its layers, the compute buffers (a prompt ubatch's logits too), a margin
            const moetier_budget_needs      needs = budget_needs(model);
            const uint32_t                  n_lay = std::max<uint32_t>(1, model.hparams.n_layer());
            std::vector<ggml_backend_dev_t> devs;
            for (const auto & pl : plans) {
                if (pl.dev != nullptr && std::find(devs.begin(), devs.end(), pl.dev) == devs.end()) {
                    devs.push_back(pl.dev);
                }
            }
            vram = 0;
            for (ggml_backend_dev_t d : devs) {
                size_t free = 0, total = 0;
                ggml_backend_dev_memory(d, &free, &total);
                uint32_t n_on = 0;
                for (uint32_t il = 0; il < n_lay; ++il) {
                    n_on += vram_host || model.dev_layer((int) il) == d;
                }
                const uint64_t kv      = needs.kv * n_on / n_lay;
                const uint64_t compute = needs.compute + (uint64_t) 4 * 512 * model.vocab.n_tokens();
                const uint64_t margin  = std::max<uint64_t>((uint64_t) 512 << 20, free / 32);
                const uint64_t need    = kv + compute + margin;
                const uint64_t avail   = free > need ? free - need : 0;
                vram += avail;
                dev_avail[d] = avail;
                vram_note +=
                    format("%s%s: %s free - KV cache %s - compute buffers %s - margin %s = %s",
                           vram_note.empty() ? "" : "; ", ggml_backend_dev_name(d), moetier_format_bytes(free).c_str(),
                           moetier_format_bytes(kv).c_str(), moetier_format_bytes(compute).c_str(),
                           moetier_format_bytes(margin).c_str(), moetier_format_bytes(avail).c_str());
            }
        }
        if (vram < min_vram_bytes) {
            throw moetier_exception(
                MOETIER_ERROR_CONFIG,
                format("vram=%s%s is below the minimum %s (one layer's %d experts and a zero slot per expert a token "
                       "selects%s); use at least %" PRIu64 " bytes",
                       vram_text.c_str(),
                       auto_vram ? (" (" + moetier_format_bytes(vram) + ": " + vram_note + ")").c_str() : "",
                       moetier_format_bytes(min_vram_bytes).c_str(), n_expert,
                       plans.size() > 1 ? " per group on a GPU" : "", min_vram_bytes));
        }
        for (const auto & [d, avail] : dev_avail) {
            if (avail < dev_min[d]) {
                throw moetier_exception(
                    MOETIER_ERROR_CONFIG,
                    format("vram=auto: %s has %s for the VRAM tier (%s), below the minimum %s of the layers it runs; "
                           "give a smaller context, fewer layers on it, or vram=0",
                           ggml_backend_dev_name(d), moetier_format_bytes(avail).c_str(), vram_note.c_str(),
                           moetier_format_bytes(dev_min[d]).c_str()));
            }
        }
        // the budget beyond the minimum, in proportion to each group's expert bytes: per device with auto
        // (each device has its own free memory), over all groups with a given size
        for (auto & pl : plans) {
            if (pl.dev == nullptr) {
                continue;
            }
            const uint64_t pool      = auto_vram ? dev_avail[pl.dev] - dev_min[pl.dev] : vram - min_vram_bytes;
            const uint64_t of        = auto_vram ? dev_all[pl.dev] : all_vram;
            const int64_t  max_slots = (int64_t) n_expert * (int64_t) pl.layers.size();
            const double   share     = (double) pool *
                                 (double) ((pl.vram_bytes + pl.vram_bytes_low) * n_expert * pl.layers.size()) /
                                 (double) of;
            // mixed precision: low_frac of it for low-precision copies, as in the RAM tier
            const double low = pl.vram_bytes_low > 0 ? share * (double) low_frac : 0.0;
            pl.n_vram = std::min<int64_t>(max_slots, n_expert + (int64_t) ((share - low) / (double) pl.vram_bytes));
            if (pl.vram_bytes_low > 0 && pl.n_vram < max_slots) {
                pl.n_vram_low = std::min<int64_t>(max_slots, n_expert + (int64_t) (low / (double) pl.vram_bytes_low));
            }
            const std::vector<moetier_proj> & projs = pl.layers[0]->projs;
            for (const moetier_precision prec : { MOETIER_PRECISION_HIGH, MOETIER_PRECISION_LOW }) {
                int64_t & n = prec == MOETIER_PRECISION_HIGH ? pl.n_vram : pl.n_vram_low;
                if (n == 0) {
                    continue;
                }
                const int64_t cap = moetier_vram_slot_cap(projs, prec, pl.n_used);
                if (cap < n_expert) {  // one layer's experts are the least the tier works with
                    throw moetier_exception(MOETIER_ERROR_CONFIG,
                                            format("the VRAM tier cannot hold one layer's %d experts of layer %d in "
                                                   "one tensor (ggml's CUDA kernels index it in 32 bits); use vram=0",
                                                   n_expert, pl.layers.front()->il));
                }
                if (n > cap) {
                    MOETIER_LOG_WARN("%s: VRAM tier: %" PRId64 " %s-precision slots of layers %d-%d capped at %" PRId64
                                     ": ggml's CUDA kernels index one tensor's quant blocks in 32 bits\n",
                                     __func__, n, prec == MOETIER_PRECISION_HIGH ? "high" : "low",
                                     pl.layers.front()->il, pl.layers.back()->il, cap);
                    n = std::max<int64_t>(cap, 0);
                }
            }
        }
        if (auto_vram) {
            MOETIER_LOG_INFO("%s: vram auto: %s\n", __func__, vram_note.c_str());
        }
    }

    // store reads: one vectored read per expert when its projections lie back to back in the file
    for (auto & l : layers) {
        if (!store || l->projs.size() > 8) {
            continue;
        }
        for (int32_t prec = 0; prec < 2; ++prec) {
            std::vector<int32_t> order(l->projs.size());
            for (size_t k = 0; k < order.size(); ++k) {
                order[k] = (int32_t) k;
            }
            std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
                return l->projs[a].expert_offset(0, (moetier_precision) prec) <
                       l->projs[b].expert_offset(0, (moetier_precision) prec);
            });
            bool contiguous = true;
            for (int32_t e = 0; e < n_expert && contiguous; ++e) {
                for (size_t k = 1; k < order.size(); ++k) {
                    const moetier_proj &    a  = l->projs[order[k - 1]];
                    const moetier_proj &    b  = l->projs[order[k]];
                    const moetier_precision pr = (moetier_precision) prec;
                    if (b.expert_offset(e, pr) != a.expert_offset(e, pr) + moetier_align_up(a.expert_bytes(pr))) {
                        contiguous = false;
                        break;
                    }
                }
            }
            if (contiguous) {
                l->file_order[prec] = order;
            }
        }
    }

    // the elastic budget: each RAM-only group's high pool may grow to every expert of the group (its
    // memory is reserved, and committed as its slots fill)
    for (auto & pl : plans) {
        std::vector<moetier_proj> shapes        = pl.layers[0]->projs;
        const int32_t             n_slots[2]    = { (int32_t) pl.n_slots[MOETIER_PRECISION_HIGH],
                                                    (int32_t) pl.n_slots[MOETIER_PRECISION_LOW] };
        const int64_t             max_slots     = (int64_t) n_expert * (int64_t) pl.layers.size();
        bool                      elastic_group = elastic_on() && pl.n_slots[MOETIER_PRECISION_HIGH] < max_slots;
        try {
            caches.push_back(std::make_unique<moetier_cache>(n_expert, n_slots, precision, policy_name, policy_weights,
                                                             shapes, false, moetier_policy_env{}, 0,
                                                             elastic_group ? (int32_t) max_slots : 0));
        } catch (const std::bad_alloc &) {
            if (!elastic_group) {
                throw;
            }
            // strict overcommit (vm.overcommit_memory=2) or an address-space limit (ulimit -v) refuses
            // the room to grow into: the budget is fixed
            warn(
                format("grow: reserving address space for every expert (%s) was refused (vm.overcommit_memory=2 "
                       "or ulimit -v); the expert cache keeps its budget",
                       moetier_format_bytes(pl.slot_bytes[MOETIER_PRECISION_HIGH] * (uint64_t) max_slots).c_str()));
            elastic_group = false;
            caches.push_back(
                std::make_unique<moetier_cache>(n_expert, n_slots, precision, policy_name, policy_weights, shapes));
        }
        moetier_cache * c = caches.back().get();
        if (elastic_group) {
            const bool first = !elastic;
            if (first) {
                elastic = moetier_elastic::shared();
            }
            // the model's reserve and its KV cache (allocated at load, written as the context fills; the
            // compute buffers are written by the first decodes), once per model
            const moetier_budget_needs needs = budget_needs(model);
            c->set_elastic(elastic, first ? reserve + needs.kv : 0);
        }
        c->set_n_model_layers(std::max<int32_t>(n_model_layers, layers.back()->il + 1));
        if (pl.dev != nullptr) {
            const bool all_of_them = pl.n_vram == (int64_t) n_expert * (int64_t) pl.layers.size();
            c->set_vram(pl.dev, vram_host, vram_cpu, (int32_t) pl.n_vram, (int32_t) pl.n_vram_low, pl.n_used,
                        !all_of_them, policy_name, policy_weights);
        }
        c->use_repacked(repack_buft);
        if (huge_pages) {
            c->use_huge_pages();
        }
        for (moetier_layer * l : pl.layers) {
            c->add_layer(l);
            for (size_t k = 0; k < l->projs.size(); ++k) {
                l->projs[k].pool[MOETIER_PRECISION_HIGH] = c->pool(MOETIER_PRECISION_HIGH, k);
                l->projs[k].pool[MOETIER_PRECISION_LOW]  = c->pool(MOETIER_PRECISION_LOW, k);
                l->projs[k].vram_pool                    = c->vram_pool(k);
                l->projs[k].vram_pool_low                = c->vram_pool_low(k);
            }
        }
        if (pl.dev != nullptr && pl.n_vram == (int64_t) n_expert * (int64_t) pl.layers.size()) {
            // every expert fits: loaded now, computed as stock computes its experts
            c->preload_vram();
            if (precision.t1 < 1.0f || precision.t2 < 1.0f) {
                warn(
                    format("t1=%g t2=%g: every expert of %d layers fits in VRAM in high precision, where they "
                           "compute as the router chose: no expert of theirs is read in low precision or skipped",
                           precision.t1, precision.t2, (int) pl.layers.size()));
            }
            MOETIER_LOG_INFO(
                "%s: VRAM tier holds every expert of its %d layers: read at load; they compute from "
                "VRAM with no per-layer slot choice\n",
                __func__, (int) pl.layers.size());
        }
        if (pl.dev != nullptr) {
            MOETIER_LOG_INFO("%s: VRAM tier on %s%s: %" PRId64 " slots of %d layers x %d experts (%s), policy %s\n",
                             __func__, ggml_backend_dev_name(pl.dev), vram_host ? " (host memory, vram_host)" : "",
                             pl.n_vram, (int) pl.layers.size(), n_expert, moetier_format_bytes(c->vram_bytes()).c_str(),
                             policy_name.c_str());
            if (c->vram_cpu()) {
                MOETIER_LOG_INFO(
                    "%s: cooperative compute: one expert costs %.0f us to copy into VRAM, %.0f us on the "
                    "CPU per token\n",
                    __func__, c->vram_copy_us(), c->vram_cpu_us());
            }
        }
    }

    uint64_t pool_bytes = 0;
    int64_t  n_slots    = 0;
    int64_t  n_slots_lo = 0;
    for (auto & c : caches) {
        pool_bytes += c->pool_bytes();
        n_slots += c->n_slots(MOETIER_PRECISION_HIGH);
        n_slots_lo += c->n_slots(MOETIER_PRECISION_LOW);
    }
    MOETIER_LOG_INFO("%s: expert cache: %zu MoE layers x %d experts (%s), %" PRId64 " high + %" PRId64
                     " low slots in %zu group(s) = %s, "
                     "%s (t1 %.2f t2 %.2f), policy %s, reading %s%s\n",
                     __func__, layers.size(), n_expert, moetier_format_bytes(expert_bytes).c_str(), n_slots, n_slots_lo,
                     caches.size(), moetier_format_bytes(pool_bytes).c_str(),
                     exact() ? "exact: every expert in high precision" : "mixed precision", precision.t1, precision.t2,
                     policy_name.c_str(), store ? store->dir().c_str() : paths[0].c_str(),
                     (store ? store_file->direct() : files[0]->direct()) ? " (O_DIRECT)" : "");
    int32_t n_repacked = 0;
    for (auto & c : caches) {
        n_repacked += c->n_repacked();
    }
    if (n_repacked > 0) {
        MOETIER_LOG_INFO(
            "%s: %d expert pools compute on llama.cpp's repacked CPU kernels (CPU_REPACK), as stock's "
            "expert tensors do: each read is repacked once checked\n",
            __func__, (int) n_repacked);
    }
    if (huge_pages) {
        log_huge_pages();
    }
    if (reserve > 0 && !budget_auto && !elastic) {
        // the reserve is what an auto or elastic budget leaves free; a fixed size given is the cache's size
        warn(
            format("reserve=%s has no effect: the budget is given and fixed (it shapes an auto budget, or one "
                   "that grows: grow=1)",
                   moetier_format_bytes(reserve).c_str()));
    }
    if (elastic) {
        int64_t n_max = 0;
        for (auto & c : caches) {
            n_max += c->slots(MOETIER_PRECISION_HIGH).n_capacity();
        }
        MOETIER_LOG_INFO("%s: elastic budget: the high slots grow up to %" PRId64
                         " (every expert) into memory the limit leaves free, keeping %s free, and give it back "
                         "down to %" PRId64 " when it runs short\n",
                         __func__, n_max,
                         moetier_format_bytes(moetier_elastic_margin(moetier_memory_read(""), reserve)).c_str(),
                         n_slots);
    }
    if (!exact()) {
        // a lossy mode the user chose: said where the tools print it by default (INFO lines are not)
        MOETIER_LOG_WARN(
            "moetier: mixed precision (t1 %.2f, t2 %.2f): misses may be read in low precision or skipped, "
            "so the output differs from stock llama.cpp's (t1 = t2 = 1 is exact)\n",
            precision.t1, precision.t2);
    }
}

int32_t moetier_model::n_staging() const {
    // staged reads in flight at once: two per prefetch lane (urgent reads go first; more in flight
    // than that does not read faster)
    return 2 * io_threads;
}

size_t moetier_model::staging_bytes(moetier_precision prec) const {
    // the largest expert of prec, each projection with the blocks around it
    size_t out = 0;
    for (const auto & l : layers) {
        size_t need = 0;
        for (const auto & pr : l->projs) {
            need += moetier_align_up(pr.expert_bytes(prec)) + MOETIER_ALIGN;
        }
        out = std::max(out, need);
    }
    return out;
}

void moetier_model::init_io() {
    if (io_threads <= 0) {
        return;
    }
    // one layer's on-demand reads per group (a read per projection at most, both precisions), a
    // read per predicted expert of up to p layers, and room for reads still in flight
    size_t n_proj   = 0;
    bool   vectored = store != nullptr && store_file->direct_fd() >= 0;
    // a GGUF read with O_DIRECT: each projection as the blocks around it, staged, then copied
    bool   staged   = store == nullptr;
    for (const auto & l : layers) {
        n_proj = std::max(n_proj, l->projs.size());
        for (int32_t prec = 0; prec < MOETIER_N_PRECISIONS; ++prec) {
            if (l->cache->n_slots((moetier_precision) prec) == 0) {
                continue;
            }
            vectored = vectored && !l->file_order[prec].empty();
            for (const auto & pr : l->projs) {
                staged = staged && pr.file->direct_fd() >= 0;
            }
        }
    }
    staged                = staged && n_proj <= MOETIER_IO_MAX_PARTS;
    const size_t capacity = caches.size() * 2 * n_proj * n_expert + (size_t) 4 * prefetch * n_expert + 64;
    const int    n_stage  = staged ? n_staging() : 0;
    const size_t stage    = staged ? staging_bytes(MOETIER_PRECISION_HIGH) : 0;  // a GGUF has no low copies

    // io_uring when every read is an O_DIRECT read (of the store, straight into the slots; of a
    // GGUF, staged): the kernel reads while the compute threads run; else I/O threads
    if (use_uring && (vectored || staged)) {
        auto ring = std::make_unique<moetier_uring>((unsigned) std::min<size_t>(capacity, 4096));
        if (ring->ok()) {
            try {
                io = std::make_unique<moetier_io_pool>(std::move(ring), io_threads, capacity, moetier_read_io_prep,
                                                       moetier_read_io_finish, vectored ? 0 : n_stage, stage);
            } catch (const std::bad_alloc &) {
                throw std::runtime_error(format("out of memory for %d io_uring staging buffers of %s", n_stage,
                                                moetier_format_bytes(stage).c_str()));
            }
            for (auto & c : caches) {
                c->set_io(io.get());
            }
            MOETIER_LOG_INFO(
                "%s: io_uring: expert reads start at routing and overlap the compute that does not need them "
                "(prefetch: %d reads in flight%s)\n",
                __func__, io_threads,
                vectored ? "" :
                           format("; from the GGUF through %d staging buffers, %s", n_stage,
                                  moetier_format_bytes((uint64_t) n_stage * stage).c_str())
                               .c_str());
            return;
        }
        warn(format("io_uring: %s; using %d I/O threads instead", ring->error().c_str(), io_threads));
    }
    // I/O threads serve prefetch only (on-demand reads go to them only in io_uring mode): every
    // projection of the expert, into the thread's own bounce buffer
    io_bounce.resize(io_threads);
    io = std::make_unique<moetier_io_pool>(io_threads, capacity,
                                           [this](const moetier_io_task & task, int thread_id, std::string & err) {
                                               return moetier_read_io(task, io_bounce[thread_id], err);
                                           });
    for (auto & c : caches) {
        c->set_io(io.get());
    }
    MOETIER_LOG_INFO(
        "%s: %d I/O threads: expert reads start at routing and overlap the compute that does not need them\n", __func__,
        io_threads);
}

// a layer's selection bias (exp_probs_b, [n_expert]) as floats, or empty where it has none
static std::vector<float> moetier_read_selection_bias(const ggml_tensor * t) {
    std::vector<float> out;
    if (t == nullptr) {
        return out;
    }
    std::vector<uint8_t> raw(ggml_nbytes(t));
    ggml_backend_tensor_get(t, raw.data(), 0, raw.size());
    out.resize(ggml_nelements(t));
    if (t->type == GGML_TYPE_F32) {
        memcpy(out.data(), raw.data(), out.size() * sizeof(float));
    } else {
        const auto * traits = ggml_get_type_traits(t->type);
        if (traits->to_float == nullptr) {
            throw std::runtime_error(format("the selection bias %s has type %s, which cannot be read back", t->name,
                                            ggml_type_name(t->type)));
        }
        traits->to_float(raw.data(), out.data(), (int64_t) out.size());
    }
    return out;
}

void moetier_model::init_prefetch(const llama_model & model) {
    if (prefetch > 0 && io_threads <= 0) {
        // prefetch is on by default: io_threads=0 alone turns it off, said once
        warn(format("prefetch=%d is off: io_threads=0 leaves it no lanes to read on", prefetch));
    }
    if (prefetch <= 0 && !prefetch_gate) {
        warn("prefetch_gate=0 has no effect: prefetch is off");
    }
    if (prefetch <= 0 && prefetch_waste != moetier_default_params().prefetch_waste) {
        warn(format("prefetch_waste=%g has no effect: prefetch is off", prefetch_waste));
    }
    if (prefetch <= 0 || io == nullptr) {
        return;
    }
    // a fitted predictor replaces the routers where it has a map (a stale or broken one: a warning)
    std::unique_ptr<moetier_predictor_file> fitted;
    const std::string                       path = moetier_predictor_path(paths[0], store ? store->dir() : "");
    if (fitted_prefetch && access(path.c_str(), F_OK) == 0) {
        try {
            const ggml_tensor * r = model.layers[layers.front()->il].ffn_gate_inp;
            if (r == nullptr) {
                throw std::runtime_error("the model has no router to size it by");
            }
            fitted = std::make_unique<moetier_predictor_file>(path, moetier_predictor_model_key(paths[0]), r->ne[0],
                                                              (int64_t) n_expert);
        } catch (const std::exception & e) {
            warn(format("prefetch predictor ignored, the routers predict: %s", e.what()));
        }
    }
    // the probabilities a selection bias is added to: softmax where the arch sets none (ernie4_5-moe),
    // sigmoid (GLM-4.5, DeepSeek-V3); other functions are not modelled: the logits alone predict
    const uint32_t gating     = model.hparams.expert_gating_func;
    const bool     bias_known = gating == LLAMA_EXPERT_GATING_FUNC_TYPE_NONE ||
                            gating == LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX ||
                            gating == LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID;
    bool bias_ignored = false;
    if (model.hparams.n_expert_groups > 1) {
        warn(
            format("prefetch predicts without the model's expert groups (%u): its group-limited choice is not "
                   "modelled",
                   model.hparams.n_expert_groups));
    }
    int32_t n_fitted = 0, n_maps = 0;
    // per group: each served layer with the next ones of the same group (at most p, consecutive
    // among the served layers) and their routers
    bool    any = false;
    for (auto & c : caches) {
        std::vector<moetier_prefetch_layer> pl;
        for (size_t i = 0; i < layers.size(); ++i) {
            if (layers[i]->cache != c.get()) {
                continue;
            }
            moetier_prefetch_layer x;
            x.layer   = layers[i].get();
            x.sigmoid = gating == LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID;
            for (size_t k = i + 1; k < layers.size() && x.next.size() < (size_t) prefetch; ++k) {
                if (layers[k]->cache != c.get()) {
                    break;
                }
                const int32_t       d = layers[k]->il - x.layer->il;
                const ggml_tensor * w = fitted ? fitted->weight(x.layer->il, d) : nullptr;
                x.next.push_back(layers[k].get());
                x.routers.push_back(w ? w : model.layers[layers[k]->il].ffn_gate_inp);
                x.biases.push_back(w ? fitted->bias(x.layer->il, d) : nullptr);
                const ggml_tensor * b = model.layers[layers[k]->il].ffn_exp_probs_b;
                x.probs_biases.push_back(bias_known ? moetier_read_selection_bias(b) : std::vector<float>());
                bias_ignored = bias_ignored || (b != nullptr && !bias_known);
                n_fitted += w != nullptr;
                n_maps += 1;
            }
            any = any || !x.next.empty();
            pl.push_back(std::move(x));
        }
        c->set_prefetch(std::make_unique<moetier_prefetch_stacked>(
            pl, prefetch, n_expert, c->slots(MOETIER_PRECISION_HIGH), c->slots(MOETIER_PRECISION_LOW), *io, precision,
            prefetch_waste, prefetch_gate));
    }
    if (bias_ignored) {
        warn(
            format("prefetch predicts from the logits alone: the selection bias of gating function %u is not "
                   "modelled",
                   gating));
    }
    if (any && fitted) {
        prefetch_source = format("fitted predictor %s (%d of %d maps)", path.c_str(), n_fitted, n_maps);
        MOETIER_LOG_INFO("%s: prefetch: %d layers ahead by the %s\n", __func__, prefetch, prefetch_source.c_str());
    } else if (any) {
        prefetch_source = "stacked routers";
        MOETIER_LOG_INFO("%s: prefetch: %d layers ahead by stacked routers\n", __func__, prefetch);
    } else {
        warn(format("prefetch=%d has nothing to predict: no served layer has a successor in its pool group", prefetch));
    }
}

bool moetier_model::exact() const {
    int64_t n_low = 0;
    for (const auto & c : caches) {
        n_low += c->n_slots(MOETIER_PRECISION_LOW);
    }
    return precision.t2 >= 1.0f && (precision.t1 >= 1.0f || n_low == 0);
}

void moetier_model::warn(const std::string & msg) {
    MOETIER_LOG_WARN("moetier: warning: %s\n", msg.c_str());
    warnings.push_back(msg);
}

//
// automatic budget
//

moetier_budget_needs moetier_model::budget_needs(const llama_model & model) const {
    const llama_hparams & hp = model.hparams;
    moetier_budget_needs  needs;
    // resident non-expert weights: every tensor but the served experts; the token embeddings only
    // if they are also the output matrix (else get_rows touches a few rows of them)
    for (const ggml_tensor * t : resident_weights(model)) {
        needs.weights += ggml_nbytes(t);
    }
    needs.n_ctx = n_ctx > 0 ? n_ctx : (int32_t) hp.n_ctx_train;
    for (uint32_t il = 0; il < hp.n_layer(); ++il) {
        needs.kv += (uint64_t) needs.n_ctx * (hp.n_embd_k_gqa(il) + hp.n_embd_v_gqa(il)) * 2;  // f16
    }
    // compute buffers: llama.cpp reserves them for a 512-token ubatch with every position's logits
    // (4 * 512 * n_vocab bytes: 297 MiB for Qwen2.5's 151936 tokens), but generation asks for the last
    // position's logits only, and ggml-alloc reuses the memory of a layer's dead activations for
    // the next ones: the pages touched are about one layer's live activations of a full ubatch
    // (measured: ~100 MiB of anonymous memory for the 1.5B MoE after a 645-token prompt). Tools
    // that compute every position's logits (llama-perplexity) need 4 * 512 * n_vocab bytes more
    // (reserve).
    const uint64_t n_ubatch = 512;
    uint64_t       n_ff     = hp.n_ff_shexp;
    uint64_t       n_ff_moe = 0;
    for (uint32_t il = 0; il < hp.n_layer(); ++il) {
        n_ff     = std::max<uint64_t>(n_ff, hp.n_ff(il));
        n_ff_moe = std::max<uint64_t>(n_ff_moe, (uint64_t) hp.n_ff_exp(il) * hp.n_expert_used(il));
    }
    needs.compute = 4 * n_ubatch * (8 * (uint64_t) hp.n_embd + 3 * n_ff + 2 * n_ff_moe) +
                    4 * 16 * (uint64_t) model.vocab.n_tokens() + ((uint64_t) 16 << 20);
    needs.process = process_anon;
    needs.reserve = reserve;
    if (store == nullptr && use_uring && io_threads > 0 && direct_io) {
        needs.io = (uint64_t) n_staging() * staging_bytes(MOETIER_PRECISION_HIGH);
    }
    return needs;
}

std::vector<const ggml_tensor *> moetier_model::resident_weights(const llama_model & model) {
    const bool tied = model.output == nullptr || model.tok_embd == nullptr ||
                      strcmp(ggml_get_name(model.output), ggml_get_name(model.tok_embd)) == 0;
    std::vector<const ggml_tensor *> out;
    for (const auto & [name, t] : model.tensors_by_name) {
        if (layer_of(t) == nullptr && (tied || t != model.tok_embd)) {
            out.push_back(t);
        }
    }
    return out;
}

void moetier_model::choose_budget(const llama_model & model) {
    const moetier_budget_needs needs = budget_needs(model);
    const moetier_memory       mem   = moetier_memory_read("");
    // the cache never needs more than every expert (padded to the slot alignment)
    uint64_t                   all   = 0;
    for (const auto & l : layers) {
        for (const auto & p : l->projs) {
            all += moetier_align_up(p.bytes) * (uint64_t) n_expert;
        }
    }
    std::string    fit_note;
    const uint64_t fits = moetier_budget_auto(mem, needs, all, fit_note, &auto_room);
    if (budget_auto) {
        cache_bytes = fits;
        budget_note = fit_note;
        MOETIER_LOG_INFO("%s: %s\n", paths[0].c_str(), budget_note.c_str());
        return;
    }
    budget_note = format("expert cache: %s (given)", moetier_format_bytes(cache_bytes).c_str());
    // a given budget is kept; one that leaves the other weights no room under a memory limit gets
    // a warning, as it makes the kernel page those weights (read from disk again every token)
    if (mem.cgroup_limit > 0 && cache_bytes > fits && fits < all) {
        warn(
            format("expert cache %s is more than the memory limit leaves for it (%s): %s; the non-expert weights "
                   "may be paged from disk every token. Use cache auto, or a budget of at most %s",
                   moetier_format_bytes(cache_bytes).c_str(), mem.cgroup_source.c_str(), fit_note.c_str(),
                   moetier_format_bytes(fits).c_str()));
    }
}

// sorts address ranges [first, second) and joins the ones that overlap or touch
static void merge_ranges(std::vector<std::pair<uintptr_t, uintptr_t>> & r) {
    std::sort(r.begin(), r.end());
    size_t n = 0;
    for (const auto & x : r) {
        if (n > 0 && x.first <= r[n - 1].second) {
            r[n - 1].second = std::max(r[n - 1].second, x.second);
        } else {
            r[n++] = x;
        }
    }
    r.resize(n);
}

void moetier_model::lock_resident_weights(const llama_model & model) {
    if (!lock_weights) {
        return;
    }
    // the mappings of the model's files: only their pages can be paged out and read back (weights
    // in anonymous buffers, e.g. repacked ones, stay without a lock as there is no swap to go to)
    std::vector<std::string> real;
    for (const auto & p : paths) {
        char buf[PATH_MAX];
        if (realpath(p.c_str(), buf) != nullptr) {
            real.emplace_back(buf);
        }
    }
    std::vector<std::pair<uintptr_t, uintptr_t>> maps;
    std::ifstream                                f("/proc/self/maps");
    std::string                                  line;
    while (std::getline(f, line)) {
        unsigned long long a = 0, b = 0;
        char               path[4096] = { 0 };
        if (sscanf(line.c_str(), "%llx-%llx %*s %*s %*s %*s %4095[^\n]", &a, &b, path) == 3 &&
            std::find(real.begin(), real.end(), std::string(path)) != real.end()) {
            maps.emplace_back((uintptr_t) a, (uintptr_t) b);
        }
    }
    // the loader's madvise calls split a mapping into many areas: a tensor may span two of them
    merge_ranges(maps);
    const uintptr_t                              page = (uintptr_t) sysconf(_SC_PAGESIZE);
    std::vector<std::pair<uintptr_t, uintptr_t>> ranges;
    for (const ggml_tensor * t : resident_weights(model)) {
        const uintptr_t a = (uintptr_t) t->data, b = a + ggml_nbytes(t);
        for (const auto & m : maps) {
            if (t->data != nullptr && a >= m.first && b <= m.second) {
                ranges.emplace_back(a / page * page, std::min(m.second, (b + page - 1) / page * page));
                break;
            }
        }
    }
    merge_ranges(ranges);
    uint64_t total = 0;
    for (const auto & r : ranges) {
        if (mlock((const void *) r.first, r.second - r.first) != 0) {
            const int e = errno;
            for (const auto & u : ranges) {
                if (u.first >= r.first) {
                    break;
                }
                munlock((const void *) u.first, u.second - u.first);
            }
            warn(
                format("lock_weights: mlock of the non-expert weights (%s) failed: %s; they stay paged (raise the "
                       "locked-memory limit, ulimit -l, or set lock_weights=0)",
                       moetier_format_bytes(total + (r.second - r.first)).c_str(), strerror(e)));
            return;
        }
        total += r.second - r.first;
    }
    // the locks go with the mapping: llama_model unmaps it when it is freed
    locked_bytes = total;
    MOETIER_LOG_INFO("%s: non-expert weights locked in RAM: %s\n", paths[0].c_str(),
                     moetier_format_bytes(total).c_str());
}

//
// warm start
//

bool moetier_model::save_state(std::string & err) const {
    std::lock_guard<std::mutex> lock(save_mutex);
    moetier_warm_state          st;
    st.identity = state_identity;
    st.n_expert = n_expert;
    for (const auto & l : layers) {
        st.layers.push_back(l->il);
        const moetier_slots & hi = l->cache->slots(MOETIER_PRECISION_HIGH);
        for (int32_t e = 0; e < n_expert; ++e) {
            st.uses.push_back(l->uses[e].load(std::memory_order_relaxed));
            st.last.push_back(l->last_use[e].load(std::memory_order_relaxed));
            // which slots hold what changes while decoding runs: only a final save (no decode) records it
            st.resident.push_back(saver_stop || !saver.joinable() ? (uint8_t) (hi.find(l->il, e) >= 0) : 0);
        }
    }
    return moetier_warm_save(state_path, st, err);
}

void moetier_model::init_warm() {
    if (!warm_on) {
        return;
    }
    state_path                      = store ? store->dir() + "/cache-state.bin" : paths[0] + ".cache-state";
    // the sidecar belongs to this model and store: their identity, and the served shapes
    const moetier_model_identity id = moetier_model_identity_compute(paths[0]);
    std::string key                 = format("%" PRIu64 ":%" PRIu64 ":%" PRIu64 ":%s", id.file_size, id.header_checksum,
                                             id.sample_checksum, store ? store->id().c_str() : "gguf");
    state_identity                  = moetier_checksum(key.data(), key.size());

    std::vector<int32_t> ils;
    for (const auto & l : layers) {
        ils.push_back(l->il);
    }
    moetier_warm_state st;
    std::string        why;
    if (!moetier_warm_load(state_path, state_identity, ils, n_expert, st, why)) {
        if (why == "no sidecar yet") {
            MOETIER_LOG_INFO("moetier: warm start: no sidecar yet at %s (written at exit)\n", state_path.c_str());
        } else {
            warn(format("warm start: %s ignored: %s", state_path.c_str(), why.c_str()));
        }
    } else {
        // seed the counters (halved: recent launches weigh more) and rank each group's experts:
        // the ones the policy held at exit first, then by use and recency
        struct cand {
            moetier_layer * layer;
            int32_t         e;
            uint8_t         resident;
            uint32_t        uses;
            uint64_t        last;
        };

        std::map<moetier_cache *, std::vector<cand>> by_cache;
        for (size_t li = 0; li < layers.size(); ++li) {
            moetier_layer * l = layers[li].get();
            for (int32_t e = 0; e < n_expert; ++e) {
                const size_t i = li * n_expert + e;
                l->uses[e].store(st.uses[i] / 2, std::memory_order_relaxed);
                if (st.uses[i] > 0 || st.resident[i]) {
                    by_cache[l->cache].push_back({ l, e, st.resident[i], st.uses[i], st.last[i] });
                }
            }
        }
        std::vector<moetier_warm::entry> entries;
        for (auto & [c, cands] : by_cache) {
            if (c->vram_static()) {
                continue;  // every expert of the group is in VRAM already; its RAM tier only staged the load
            }
            std::sort(cands.begin(), cands.end(), [](const cand & a, const cand & b) {
                if (a.resident != b.resident) {
                    return a.resident > b.resident;
                }
                return a.uses != b.uses ? a.uses > b.uses : a.last > b.last;
            });
            for (const cand & x : cands) {
                const int32_t s = c->warm_take(*x.layer, x.e);
                if (s >= 0) {
                    entries.push_back({ x.layer, x.e, s });
                }
            }
        }
        // read in layer order: the order the first token needs them
        std::stable_sort(
            entries.begin(), entries.end(),
            [](const moetier_warm::entry & a, const moetier_warm::entry & b) { return a.layer->il < b.layer->il; });
        warm = std::make_unique<moetier_warm>(entries);
        for (int32_t i = 0; i < warm->size(); ++i) {
            const moetier_warm::entry & en = warm->get(i);
            en.layer->cache->warm_attach(warm.get(), en.slot, i);
        }
        MOETIER_LOG_INFO("moetier: warm start: reading %d experts of %s in the background\n", warm->size(),
                         state_path.c_str());
        warm->start();
    }
    // the sidecar is also written every minute, so a killed server loses at most a minute of it
    saver = std::thread([this] {
        std::unique_lock<std::mutex> lock(saver_mutex);
        while (!saver_cv.wait_for(lock, std::chrono::seconds(60), [this] { return saver_stop; })) {
            std::string err;
            if (!save_state(err)) {
                // a read-only directory fails every time: say it once, then stop trying
                MOETIER_LOG_WARN("moetier: warm start: %s; no more periodic saves\n", err.c_str());
                return;
            }
        }
    });
}

void moetier_model::log_huge_pages() {
    int32_t n_huge = 0;
    for (auto & c : caches) {
        n_huge += c->n_huge();
    }
    if (n_huge == 0) {
        warn(
            "huge_pages=1 has no effect: no slot pool is in this process's memory (a VRAM tier's RAM pools are "
            "pinned host memory), or the kernel refused MADV_HUGEPAGE");
        return;
    }
    // THP "never" takes the advice and ignores it
    std::ifstream f("/sys/kernel/mm/transparent_hugepage/enabled");
    std::string   mode;
    std::getline(f, mode);
    if (mode.find("[never]") != std::string::npos) {
        warn(
            "huge_pages=1 has no effect: transparent huge pages are off (/sys/kernel/mm/transparent_hugepage/"
            "enabled is never; set it to madvise)");
        return;
    }
    MOETIER_LOG_INFO("%s: %d expert pools in transparent huge pages, faulted in ahead of the misses\n", __func__,
                     (int) n_huge);
}

void moetier_model::start_populate() {
    for (auto & c : caches) {
        c->start_populate();
    }
}

void moetier_model::share_cache(const std::vector<moetier_model *> & ms) {
    if (ms.size() < 2) {
        throw std::runtime_error("sharing an expert cache needs at least two variants");
    }
    moetier_model & host = *ms[0];
    const int32_t   E    = host.n_expert;
    const int32_t   V    = (int32_t) ms.size();
    for (int32_t v = 0; v < V; ++v) {
        moetier_model &     m    = *ms[v];
        const std::string & name = m.paths[0];
        for (int32_t u = 0; u < v; ++u) {
            if (ms[u] == ms[v]) {
                throw std::runtime_error(format("%s: given twice; each variant is a model of its own", name.c_str()));
            }
        }
        for (const auto & c : m.caches) {
            if (c->n_resolves() > 0) {
                throw std::runtime_error(format(
                    "%s: has decoded already; variants share a cache from before their first decode", name.c_str()));
            }
        }
        if (m.shared_host != nullptr || m.n_variants > 0) {
            throw std::runtime_error(format("%s: already shares an expert cache", name.c_str()));
        }
        if (!m.store) {
            throw std::runtime_error(
                format("%s: variants sharing a cache read their experts from a store; give "
                       "each one its store (moetier pack)",
                       name.c_str()));
        }
        if (m.prefetch > 0 || m.warm_on || m.vram > 0 || !m.exact() || !m.remote_layers.empty() || m.elastic) {
            throw std::runtime_error(
                format("%s: variants sharing a cache run without prefetch, warm start, an elastic budget, a "
                       "VRAM tier, RPC layers or mixed precision (prefetch=0 warm=0 grow=0)",
                       name.c_str()));
        }
        if (m.caches.size() != 1) {
            throw std::runtime_error(
                format("%s: %zu pool groups; variants sharing a cache need one", name.c_str(), m.caches.size()));
        }
        if (v == 0) {
            continue;
        }
        if (m.n_expert != E || m.layers.size() != host.layers.size()) {
            throw std::runtime_error(
                format("%s: %zu MoE layers of %d experts, %s has %zu of %d: variants of one "
                       "model have one shape",
                       name.c_str(), m.layers.size(), m.n_expert, host.paths[0].c_str(), host.layers.size(), E));
        }
        for (size_t i = 0; i < m.layers.size(); ++i) {
            const moetier_layer & a    = *host.layers[i];
            const moetier_layer & b    = *m.layers[i];
            bool                  same = a.il == b.il && a.projs.size() == b.projs.size();
            for (size_t k = 0; same && k < a.projs.size(); ++k) {
                const moetier_proj & pa = a.projs[k];
                const moetier_proj & pb = b.projs[k];
                same = pa.name == pb.name && pa.meta->type == pb.meta->type && pa.meta->ne[0] == pb.meta->ne[0] &&
                       pa.meta->ne[1] == pb.meta->ne[1] && pa.store->bytes_high == pb.store->bytes_high &&
                       a.file_order[0] == b.file_order[0];
            }
            if (!same) {
                throw std::runtime_error(
                    format("%s: layer %d's experts differ in type or shape from %s's: variants "
                           "of one model have one shape",
                           name.c_str(), b.il, host.paths[0].c_str()));
            }
        }
        if (m.store_file->direct() != host.store_file->direct()) {
            throw std::runtime_error(
                format("%s: read %s O_DIRECT, %s's store %s; put the stores on file systems "
                       "that agree (the first model's reads decide how every store is read)",
                       m.store->data_path().c_str(), m.store_file->direct() ? "with" : "without", host.paths[0].c_str(),
                       host.store_file->direct() ? "with" : "without"));
        }
        if (m.store->checksum() != host.store->checksum()) {
            throw std::runtime_error(format("%s: its store's checksum differs from %s's; re-pack both",
                                            m.store->manifest_path().c_str(), host.store->manifest_path().c_str()));
        }
    }

    const int32_t n_keys     = V * E;
    // one cache over the host's budget, as many slots as it buys (one layer's experts at least)
    uint64_t      slot_bytes = 0;
    for (const auto & p : host.layers[0]->projs) {
        slot_bytes += moetier_align_up(p.bytes);
    }
    const int64_t fit        = E + (int64_t) ((host.cache_bytes - host.min_cache_bytes) / slot_bytes);
    const int32_t n_high     = (int32_t) std::min<int64_t>((int64_t) n_keys * (int64_t) host.layers.size(), fit);
    const int32_t n_slots[2] = { n_high, 0 };
    auto c = std::make_unique<moetier_cache>(n_keys, n_slots, host.precision, host.policy_name, host.policy_weights,
                                             host.layers[0]->projs, false, moetier_policy_env{}, E);
    // the host's layers: every variant's copies, keyed
    for (size_t i = 0; i < host.layers.size(); ++i) {
        moetier_layer & h = *host.layers[i];
        for (size_t k = 0; k < h.projs.size(); ++k) {
            moetier_proj & p = h.projs[k];
            p.n_local        = E;
            p.variant_file.resize(V);
            p.variant_store.resize(V);
            for (int32_t v = 0; v < V; ++v) {
                p.variant_file[v]  = ms[v]->layers[i]->projs[k].file;
                p.variant_store[v] = ms[v]->layers[i]->projs[k].store;
            }
            for (int32_t prec = 0; prec < MOETIER_N_PRECISIONS; ++prec) {
                p.verified[prec].reset(new std::atomic<bool>[n_keys]);
                for (int32_t e = 0; e < n_keys; ++e) {
                    p.verified[prec][e].store(false, std::memory_order_relaxed);
                }
            }
        }
        h.uses.reset(new std::atomic<uint32_t>[n_keys]);
        h.last_use.reset(new std::atomic<uint64_t>[n_keys]);
        for (int32_t e = 0; e < n_keys; ++e) {
            h.uses[e].store(0, std::memory_order_relaxed);
            h.last_use[e].store(0, std::memory_order_relaxed);
        }
    }

    c->set_n_model_layers(std::max<int32_t>(host.n_model_layers, host.layers.back()->il + 1));
    c->use_repacked(host.vram == 0 ? host.repack_buft : nullptr);
    if (host.huge_pages) {
        c->use_huge_pages();
    }
    c->set_io(host.io.get());
    for (auto & l : host.layers) {
        c->add_layer(l.get());
        for (size_t k = 0; k < l->projs.size(); ++k) {
            l->projs[k].pool[MOETIER_PRECISION_HIGH] = c->pool(MOETIER_PRECISION_HIGH, k);
            l->projs[k].pool[MOETIER_PRECISION_LOW]  = c->pool(MOETIER_PRECISION_LOW, k);
        }
    }
    for (auto & old : host.caches) {
        old->sync();  // nothing may be in flight into the pools about to go
    }
    host.caches.clear();
    host.caches.push_back(std::move(c));
    host.caches.back()->start_populate();
    host.n_variants = V;
    for (int32_t v = 1; v < V; ++v) {
        moetier_model & m = *ms[v];
        for (size_t i = 0; i < m.layers.size(); ++i) {
            moetier_layer & l = *m.layers[i];
            moetier_layer & h = *host.layers[i];
            l.target          = &h;
            l.cache           = h.cache;
            for (size_t k = 0; k < l.projs.size(); ++k) {
                l.projs[k].pool[MOETIER_PRECISION_HIGH] = h.projs[k].pool[MOETIER_PRECISION_HIGH];
                l.projs[k].pool[MOETIER_PRECISION_LOW]  = h.projs[k].pool[MOETIER_PRECISION_LOW];
            }
            l.keys.resize(E);
            for (int32_t e = 0; e < E; ++e) {
                l.keys[e] = v * E + e;
            }
        }
        for (auto & old : m.caches) {
            old->sync();
        }
        m.caches.clear();
        m.shared_host = &host;
        // the first model reads this one's store: it keeps it, whichever model is freed first
        host.variant_stores.push_back(m.store);
        host.variant_stores.push_back(m.store_file);
    }
    MOETIER_LOG_INFO(
        "%s: %d variants share one expert cache: %d slots of %zu MoE layers x %d experts x %d variants "
        "(%s)\n",
        __func__, V, n_high, host.layers.size(), E, V, moetier_format_bytes(host.caches[0]->pool_bytes()).c_str());
}

void moetier_model::set_expert_keys(const int32_t * keys, int64_t n) {
    moetier_model & host = shared_host ? *shared_host : *this;
    if (host.n_variants == 0) {
        throw std::runtime_error(
            format("%s: shares no expert cache; expert keys map variants onto one cache", paths[0].c_str()));
    }
    const int64_t want = (int64_t) layers.size() * n_expert;
    if (n != want) {
        throw std::runtime_error(format("%s: %" PRId64
                                        " expert keys, the model has %zu MoE layers x %d experts = %" PRId64,
                                        paths[0].c_str(), n, layers.size(), n_expert, want));
    }
    for (int64_t j = 0; j < n; ++j) {
        const int32_t e = (int32_t) (j % n_expert);
        if (keys[j] < 0 || keys[j] >= host.n_variants * n_expert || keys[j] % n_expert != e) {
            throw std::runtime_error(
                format("%s: expert key %d for layer %d expert %d: a key names the same expert of "
                       "one of the %d variants (variant * %d + %d)",
                       paths[0].c_str(), keys[j], layers[j / n_expert]->il, e, host.n_variants, n_expert, e));
        }
    }
    for (size_t i = 0; i < layers.size(); ++i) {
        layers[i]->keys.assign(keys + i * n_expert, keys + (i + 1) * n_expert);
    }
}
