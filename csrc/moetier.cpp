// The C API of moetier.h for a loaded model (the params table is in moetier-params.cpp, the store
// in moetier-store.cpp, the policies in policies/policies.cpp, the last error in moetier-impl.cpp).

#include "moetier.h"

#include "llama-model.h"
#include "moetier-impl.h"
#include "moetier-model.h"

#include <string>

static moetier_model * moetier_of(const llama_model * model) {
    return model ? model->moetier.get() : nullptr;
}

// the open layer passes are finished: their read times and failed reads are accounted
static void moetier_sync(moetier_model & m) {
    for (auto & c : m.caches) {
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
    info->n_groups         = (int32_t) m->caches.size();
    info->expert_bytes     = m->expert_bytes;
    info->expert_bytes_low = m->expert_bytes_low;
    info->min_cache_bytes  = m->min_cache_bytes;
    info->t1               = m->precision.t1;
    info->t2               = m->precision.t2;
    info->exact            = m->exact();
    info->from_store       = m->store != nullptr;
    info->direct_io        = m->store ? m->store_file->direct() : m->files[0]->direct();
    info->io_uring         = m->io && m->io->uses_uring();
    for (const auto & c : m->caches) {
        info->n_slots += c->n_slots(MOETIER_PRECISION_HIGH);
        info->n_slots_low += c->n_slots(MOETIER_PRECISION_LOW);
        info->cache_bytes += c->pool_bytes();
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
    const int32_t n = (int32_t) m->layers.size();
    for (int32_t i = 0; i < n && i < n_max; ++i) {
        out[i] = m->layers[i]->stats;
    }
    return n;
}

struct moetier_layer_stats moetier_model_stats_total(const struct llama_model * model) {
    moetier_layer_stats total = {};
    if (moetier_model * m = moetier_of(model)) {
        moetier_sync(*m);
        for (const auto & l : m->layers) {
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
    for (auto & c : m->caches) {
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
    for (auto & l : m->layers) {
        l->stats       = {};
        l->stats.layer = l->il;
    }
    for (auto & c : m->caches) {
        c->reset_prefetch_stats();
    }
}

void moetier_model_reset_sequence(struct llama_model * model) {
    moetier_model * m = moetier_of(model);
    if (!m) {
        return;
    }
    for (auto & c : m->caches) {
        c->reset_sequence();
    }
}

bool moetier_abort_callback(void * model) {
    const moetier_model * m = moetier_of((const llama_model *) model);
    if (!m) {
        return false;
    }
    for (const auto & c : m->caches) {
        if (c->failed()) {
            return true;
        }
    }
    return false;
}

// the first error of any group
static moetier_error moetier_model_first_error(const llama_model * model) {
    if (const moetier_model * m = moetier_of(model)) {
        for (const auto & c : m->caches) {
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

void moetier_model_clear_error(struct llama_model * model) {
    moetier_model * m = moetier_of(model);
    if (!m) {
        return;
    }
    for (auto & c : m->caches) {
        c->sync();
        c->clear_error();
    }
}
