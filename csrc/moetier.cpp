// The C API of moetier.h for a loaded model (the params table is in moetier-params.cpp, the store
// in moetier-store.cpp, the policies in policies/policies.cpp, the last error in moetier-impl.cpp).

#include "moetier.h"

#include "llama-model.h"
#include "moetier-budget.h"
#include "moetier-configure.h"
#include "moetier-impl.h"
#include "moetier-model.h"
#include "moetier-predictor.h"

#include <algorithm>
#include <cinttypes>
#include <cstring>
#include <string>
#include <vector>

static moetier_model * moetier_of(const llama_model * model) {
    return model ? model->moetier.get() : nullptr;
}

// the open layer passes are finished: their read times and failed reads are accounted. Not while
// another thread computes a graph on these caches: finishing its passes there would drop the slots
// its next load fills; the counters are then those so far
static void moetier_sync(moetier_model & m) {
    std::unique_lock<std::recursive_mutex> lock(m.compute_mutex(), std::try_to_lock);
    if (!lock.owns_lock()) {
        return;
    }
    for (auto & c : m.served_caches()) {
        c->sync();
    }
}

bool moetier_model_has_cache(const struct llama_model * model) {
    return moetier_of(model) != nullptr;
}

int32_t moetier_model_cache_info(const struct llama_model * model, struct moetier_cache_info * info) {
    const moetier_model * m = moetier_of(model);
    if (!m) {
        return -1;
    }
    *info                  = {};
    info->n_layers         = (int32_t) m->layers.size();
    info->n_expert         = m->n_expert;
    info->n_groups         = (int32_t) m->served_caches().size();
    info->expert_bytes     = m->expert_bytes;
    info->expert_bytes_low = m->expert_bytes_low;
    info->min_cache_bytes  = m->min_cache_bytes;
    info->weights_locked   = m->locked_bytes;
    info->reads_checked    = m->n_checked.load(std::memory_order_relaxed);
    info->t1               = m->precision.t1;
    info->t2               = m->precision.t2;
    info->exact            = m->exact();
    info->from_store       = m->store != nullptr;
    info->direct_io        = m->store ? m->store_file->direct() : m->files[0]->direct();
    info->io_uring         = m->io && m->io->uses_uring();
    info->grow             = m->elastic != nullptr;
    if (m->elastic) {
        info->free_bytes  = m->elastic->last_headroom();
        info->free_margin = m->elastic->margin();
    }
    for (const auto & c : m->served_caches()) {
        const moetier_slots & hi = c->slots(MOETIER_PRECISION_HIGH);
        info->n_slots_budget += hi.n_slots_floor();
        const moetier_slots & lo = c->slots(MOETIER_PRECISION_LOW);
        info->budget_bytes +=
            hi.slot_bytes() * (uint64_t) hi.n_slots_floor() + lo.slot_bytes() * (uint64_t) lo.n_slots();
        info->n_slots_max += hi.n_capacity();
        info->n_grown += c->n_grown();
        info->n_shrunk += c->n_shrunk();
        info->n_slots += c->n_slots(MOETIER_PRECISION_HIGH);
        info->n_slots_low += c->n_slots(MOETIER_PRECISION_LOW);
        info->n_held += c->slots(MOETIER_PRECISION_HIGH).n_experts_held();
        info->cache_bytes += c->pool_bytes();
        info->n_slots_vram += c->n_slots_vram();
        info->n_repacked += c->n_repacked();
        info->n_huge += c->n_huge();
        info->vram_bytes += c->vram_bytes();
        info->vram_copy_us = std::max(info->vram_copy_us, c->vram_copy_us());
        info->vram_cpu_us  = std::max(info->vram_cpu_us, c->vram_cpu_us());
    }
    return 0;
}

const char * moetier_model_warning(const struct llama_model * model, int32_t i) {
    const moetier_model * m = moetier_of(model);
    if (!m || i < 0 || (size_t) i >= m->warnings.size()) {
        return nullptr;
    }
    return m->warnings[i].c_str();
}

int32_t moetier_model_layer_stats(const struct llama_model * model, struct moetier_layer_stats * out, int32_t n_max) {
    moetier_model * m = moetier_of(model);
    if (!m) {
        return 0;
    }
    moetier_sync(*m);
    // a variant sharing a cache: the counters live on the layers the cache serves, the first model's
    const moetier_model & s = m->shared_host ? *m->shared_host : *m;
    const int32_t         n = (int32_t) s.layers.size();
    for (int32_t i = 0; i < n && i < n_max; ++i) {
        out[i] = s.layers[i]->stats;
    }
    return n;
}

struct moetier_layer_stats moetier_model_stats_total(const struct llama_model * model) {
    moetier_layer_stats total = {};
    if (moetier_model * m = moetier_of(model)) {
        moetier_sync(*m);
        for (const auto & l : (m->shared_host ? m->shared_host : m)->layers) {
            moetier_stats_add(total, l->stats);
        }
    }
    total.layer = -1;
    return total;
}

int32_t moetier_model_prefetch_stats(const struct llama_model * model, struct moetier_prefetch_stats * out) {
    *out              = {};
    moetier_model * m = moetier_of(model);
    if (!m) {
        return -1;
    }
    moetier_sync(*m);
    for (auto & c : m->served_caches()) {
        c->add_prefetch_stats(*out);
    }
    return 0;
}

void moetier_model_reset_stats(struct llama_model * model) {
    moetier_model * m = moetier_of(model);
    if (!m) {
        return;
    }
    moetier_sync(*m);
    for (auto & l : (m->shared_host ? m->shared_host : m)->layers) {
        l->stats       = {};
        l->stats.layer = l->il;
    }
    for (auto & c : m->served_caches()) {
        c->reset_prefetch_stats();
    }
    m->read_hist.reset();
}

void moetier_model_reset_sequence(struct llama_model * model) {
    moetier_model * m = moetier_of(model);
    if (!m) {
        return;
    }
    for (auto & c : m->served_caches()) {
        c->reset_sequence();
    }
}

bool moetier_abort_callback(void * model) {
    const moetier_model * m = moetier_of((const llama_model *) model);
    if (!m) {
        return false;
    }
    for (const auto & c : m->served_caches()) {
        if (c->failed()) {
            return true;
        }
    }
    return false;
}

// the first error of any group
static moetier_error moetier_model_first_error(const llama_model * model) {
    if (const moetier_model * m = moetier_of(model)) {
        for (const auto & c : m->served_caches()) {
            moetier_error e = c->error();
            if (!e.msg.empty()) {
                return e;
            }
        }
    }
    return {};
}

const char * moetier_model_error(const struct llama_model * model) {
    // storage of the returned string, as moetier_last_error's: valid until the next call on this thread
    static thread_local std::string msg;
    msg = moetier_model_first_error(model).msg;
    return msg.c_str();
}

enum moetier_error_kind moetier_model_error_kind(const struct llama_model * model) {
    return moetier_model_first_error(model).kind;
}

// a counter of every layer's cache, summed
static uint64_t moetier_sum_caches(const struct llama_model * model, uint64_t (moetier_cache::*count)() const) {
    uint64_t n = 0;
    if (const moetier_model * m = moetier_of(model)) {
        for (const auto & c : m->served_caches()) {
            n += ((*c).*count)();
        }
    }
    return n;
}

uint64_t moetier_model_read_errors(const struct llama_model * model) {
    return moetier_sum_caches(model, &moetier_cache::n_read_errors);
}

uint64_t moetier_model_read_retries(const struct llama_model * model) {
    return moetier_sum_caches(model, &moetier_cache::n_read_retries);
}

void moetier_model_clear_error(struct llama_model * model) {
    moetier_model * m = moetier_of(model);
    if (!m) {
        return;
    }
    moetier_sync(*m);
    for (auto & c : m->served_caches()) {
        c->clear_error();
    }
}

bool moetier_models_share_cache(struct llama_model ** models, int32_t n) {
    moetier_set_last_error(MOETIER_ERROR_NONE, "");
    std::vector<moetier_model *> ms;
    for (int32_t i = 0; i < n; ++i) {
        moetier_model * m = moetier_of(models[i]);
        if (m == nullptr) {
            moetier_set_last_error(MOETIER_ERROR_CONFIG,
                                   "moetier_models_share_cache: a model was loaded without an expert cache");
            return false;
        }
        ms.push_back(m);
    }
    try {
        moetier_model::share_cache(ms);
    } catch (const std::exception & e) {
        moetier_set_last_error(MOETIER_ERROR_CONFIG, e.what());
        return false;
    }
    return true;
}

bool moetier_model_set_expert_keys(struct llama_model * model, const int32_t * keys, int64_t n) {
    moetier_set_last_error(MOETIER_ERROR_NONE, "");
    moetier_model * m = moetier_of(model);
    if (m == nullptr) {
        moetier_set_last_error(MOETIER_ERROR_CONFIG, "moetier_model_set_expert_keys: the model has no expert cache");
        return false;
    }
    try {
        m->set_expert_keys(keys, n);
    } catch (const std::exception & e) {
        moetier_set_last_error(MOETIER_ERROR_CONFIG, e.what());
        return false;
    }
    return true;
}

//
// loading a model with an expert cache
//

bool moetier_model_configure(const char * path_model, const struct moetier_params * params) {
    moetier_set_last_error(MOETIER_ERROR_NONE, "");
    if (path_model == nullptr) {
        moetier_set_last_error(MOETIER_ERROR_CONFIG, "moetier_model_configure: no model path");
        return false;
    }
    if (params == nullptr || (params->cache_bytes == 0 && !(params->store_dir && params->store_dir[0]))) {
        moetier_pending_set(path_model, nullptr);
        return true;
    }
    if (params->cache_bytes == 0) {
        moetier_set_last_error(MOETIER_ERROR_CONFIG,
                               format("expert store %s given without an expert cache budget", params->store_dir));
        moetier_pending_set(path_model, nullptr);
        return false;
    }
    if (const char * bad = moetier_params_check(params)) {
        moetier_set_last_error(MOETIER_ERROR_CONFIG, bad);
        moetier_pending_set(path_model, nullptr);
        return false;
    }
    moetier_pending_set(path_model, params);
    return true;
}

struct llama_model * moetier_model_load(const char *                  path_model,
                                        struct llama_model_params     mparams,
                                        const struct moetier_params * params) {
    if (!moetier_model_configure(path_model, params)) {
        return nullptr;
    }
    llama_model * m = llama_model_load_from_file(path_model, mparams);
    moetier_pending_set(path_model, nullptr);  // a load that failed before the loader took it
    return m;
}

uint64_t moetier_memory_limit(const char * root, char * source, size_t source_size) {
    const moetier_memory mem    = moetier_memory_read(root && root[0] ? root : "/");
    const bool           cgroup = mem.cgroup_limit > 0 && (mem.available == 0 || mem.cgroup_limit < mem.available);
    const std::string    src    = cgroup ? mem.cgroup_source : mem.available > 0 ? "MemAvailable /proc/meminfo" : "";
    if (source && source_size > 0) {
        const size_t k = std::min(src.size(), source_size - 1);
        memcpy(source, src.data(), k);
        source[k] = '\0';
    }
    return cgroup ? mem.cgroup_limit : mem.available;
}

uint64_t moetier_memory_free(const char * root) {
    const std::string    r   = root && root[0] ? root : "/";
    const moetier_memory mem = moetier_memory_read(r);
    uint64_t             out = 0;
    return moetier_memory_headroom(r, mem, out) ? out : 0;
}

const char * moetier_model_budget_note(const struct llama_model * model) {
    const moetier_model * m = moetier_of(model);
    return m ? m->budget_note.c_str() : "";
}

const char * moetier_model_prefetch_source(const struct llama_model * model) {
    const moetier_model * m = moetier_of(model);
    return m ? m->prefetch_source.c_str() : "";
}

static int32_t moetier_copy_out(const std::string & s, char * out, size_t out_size) {
    if (out == nullptr || out_size <= s.size()) {
        moetier_set_last_error(MOETIER_ERROR_CONFIG, "output buffer too small");
        return -1;
    }
    memcpy(out, s.c_str(), s.size() + 1);
    return (int32_t) s.size();
}

int32_t moetier_predictor_path(const char * model_path, const char * store_dir, char * out, size_t out_size) {
    return moetier_copy_out(
        moetier_predictor_path(std::string(model_path ? model_path : ""), std::string(store_dir ? store_dir : "")), out,
        out_size);
}

int32_t moetier_predictor_model_key(const char * model_path, char * out, size_t out_size) {
    try {
        return moetier_copy_out(moetier_predictor_model_key(model_path ? model_path : ""), out, out_size);
    } catch (const std::exception & e) {
        moetier_set_last_error(MOETIER_ERROR_MODEL, e.what());
        return -1;
    }
}

int32_t moetier_model_read_hist(const struct llama_model * model, struct moetier_read_hist * out) {
    static_assert(moetier_latency_hist::n_buckets == MOETIER_READ_HIST_BUCKETS, "one bucket layout");
    const moetier_model * m = moetier_of(model);
    if (!m) {
        return -1;
    }
    *out = {};
    for (int i = 0; i < MOETIER_READ_HIST_BUCKETS; ++i) {
        out->le_us[i] = moetier_latency_hist::le_us(i);
        out->count[i] = m->read_hist.count[i].load(std::memory_order_relaxed);
    }
    out->n      = m->read_hist.n.load(std::memory_order_relaxed);
    out->sum_us = m->read_hist.sum_us.load(std::memory_order_relaxed);
    return 0;
}

const char * moetier_model_state_path(const struct llama_model * model) {
    const moetier_model * m = moetier_of(model);
    return m ? m->state_path.c_str() : "";
}

int32_t moetier_model_save_state(const struct llama_model * model) {
    const moetier_model * m = moetier_of(model);
    if (!m || m->state_path.empty()) {
        return 1;
    }
    std::string err;
    if (!m->save_state(err)) {
        moetier_set_last_error(MOETIER_ERROR_IO, err);
        return -1;
    }
    return 0;
}

int32_t moetier_model_warm_progress(const struct llama_model * model, int32_t * n_read) {
    const moetier_model * m = moetier_of(model);
    const int32_t         n = m && m->warm ? m->warm->size() : 0;
    if (n_read) {
        *n_read = m && m->warm ? m->warm->n_read() : 0;
    }
    return n;
}

int32_t moetier_model_prometheus(const struct llama_model * model, const char * prefix, char * buf, size_t buf_size) {
    moetier_model * m = moetier_of(model);
    std::string     out;
    if (m) {
        const std::string      p = prefix ? prefix : "";
        moetier_read_hist      h;
        moetier_cache_info     info;
        moetier_prefetch_stats pf;
        moetier_model_read_hist(model, &h);
        moetier_model_cache_info(model, &info);
        moetier_model_prefetch_stats(model, &pf);
        int32_t           n_warm_read = 0;
        const int32_t     n_warm      = moetier_model_warm_progress(model, &n_warm_read);
        const std::string name        = p + "expert_cache_read_seconds";
        out += "# HELP " + name + " moetier: latency of expert reads (on demand, prefetch and warm start)\n";
        out += "# TYPE " + name + " histogram\n";
        // +Inf and _count from the buckets themselves: reads that land while this runs must not
        // make a bucket's running total exceed them
        uint64_t cum = 0;
        for (int i = 0; i + 1 < MOETIER_READ_HIST_BUCKETS; ++i) {
            cum += h.count[i];
            out += format("%s_bucket{le=\"%g\"} %" PRIu64 "\n", name.c_str(), (double) h.le_us[i] * 1e-6, cum);
        }
        cum += h.count[MOETIER_READ_HIST_BUCKETS - 1];
        out += format("%s_bucket{le=\"+Inf\"} %" PRIu64 "\n", name.c_str(), cum);
        out +=
            format("%s_sum %.17g\n%s_count %" PRIu64 "\n", name.c_str(), (double) h.sum_us * 1e-6, name.c_str(), cum);

        const struct {
            const char * name;
            const char * type;
            const char * help;
            double       value;
        } items[] = {
            { "expert_cache_size_bytes",               "gauge",   "moetier: bytes of the expert cache's slots",
             (double) info.cache_bytes                                                                                                                                 },
            { "expert_cache_budget_bytes",             "gauge",
             "moetier: bytes of the expert cache's budget (an elastic cache grows past it into free memory and "
              "shrinks back to it)",                                                                                        (double) info.budget_bytes                 },
            { "expert_cache_grown_slots_total",        "counter", "moetier: slots the elastic budget added (grow)",
             (double) info.n_grown                                                                                                                                     },
            { "expert_cache_shrunk_slots_total",       "counter",
             "moetier: slots the elastic budget gave back under memory pressure (grow)",                                    (double) info.n_shrunk                     },
            { "expert_cache_experts_bytes",            "gauge",
             "moetier: bytes of all served experts (what stock llama.cpp loads)",                                           (double) info.expert_bytes                 },
            { "expert_cache_prefetch_used_total",      "counter", "moetier: needed experts that a prefetch had read",
             (double) pf.n_hits                                                                                                                                        },
            { "expert_cache_prefetch_wasted_total",    "counter",
             "moetier: prefetched experts the layer did not need, read anyway",                                             (double) pf.n_wasted                       },
            { "expert_cache_prefetch_capped_total",    "counter",
             "moetier: predicted misses not read because the prefetch byte cap (prefetch_waste) was spent",                 (double) pf.n_capped                       },
            { "expert_cache_prefetch_busy_total",      "counter",
             "moetier: predicted misses not read because earlier prefetches were still queued (the disk was behind)",       (double) pf.n_busy                         },
            { "expert_cache_prefetch_on_steps_total",  "counter",
             "moetier: decode steps with prefetch reading (prefetch_gate measured that it pays, or is measuring)",          (double) pf.n_steps_on                     },
            { "expert_cache_prefetch_off_steps_total", "counter",
             "moetier: decode steps with prefetch standing back (measured not to pay here, or being measured)",             (double) pf.n_steps_off                    },
            { "expert_cache_warm_experts",             "gauge",   "moetier: experts the warm start reads from its sidecar",
             (double) n_warm                                                                                                                                           },
            { "expert_cache_warm_read",                "gauge",   "moetier: ... of which read so far",                      (double) n_warm_read                       },
            { "expert_cache_read_errors_total",        "counter",
             "moetier: expert reads that failed (I/O error, short read, checksum); the request that needed one failed",     (double) moetier_model_read_errors(model)  },
            { "expert_cache_read_retries_total",       "counter",
             "moetier: expert reads that failed once and were read again",                                                  (double) moetier_model_read_retries(model) },
        };

        for (const auto & it : items) {
            out += format("# HELP %s%s %s\n# TYPE %s%s %s\n%s%s %.17g\n", p.c_str(), it.name, it.help, p.c_str(),
                          it.name, it.type, p.c_str(), it.name, it.value);
        }
    }
    if (buf && buf_size > 0) {
        const size_t k = std::min(out.size(), buf_size - 1);
        memcpy(buf, out.data(), k);
        buf[k] = '\0';
    }
    return (int32_t) out.size();
}
