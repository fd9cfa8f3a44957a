#include "moetier-hooks.h"

#include "moetier-impl.h"
#include "moetier-loader.h"

#include "llama-model.h"
#include "llama.h"

#include <cstring>
#include <unordered_set>
#include <vector>

void moetier_model_deleter::operator()(moetier_model * m) const {
    delete m;
}

//
// load hooks
//

moetier_model_ptr moetier_hook_model_init(const moetier_params * params, const std::string & fname,
                                          const std::vector<std::string> & splits, int * load_mode) {
    moetier_set_last_error("");
    if (params == nullptr || params->cache_bytes == 0) {
        if (params && params->store_dir && params->store_dir[0]) {
            const std::string msg = format("expert store %s given without an expert cache budget", params->store_dir);
            moetier_set_last_error(msg);
            throw std::runtime_error(msg);
        }
        return nullptr;
    }
    try {
        std::vector<std::string> paths = splits.empty() ? std::vector<std::string>{ fname } : splits;
        moetier_model_ptr m(new moetier_model(*params, paths));
        // mmap stays (the loader excludes served experts from the mapping's prefetch), so the other
        // weights are paged like stock's; but mlock of the mapping would fault the experts in
        if (*load_mode == LLAMA_LOAD_MODE_MMAP_MLOCK) {
            *load_mode = LLAMA_LOAD_MODE_MLOCK;
        }
        return m;
    } catch (const std::exception & e) {
        moetier_set_last_error(e.what());
        throw;
    }
}

ggml_tensor * moetier_hook_create_tensor(moetier_model * m, const std::string & name, const ggml_tensor * cur,
                                         uint16_t file_idx, size_t offs) {
    if (m == nullptr) {
        return nullptr;
    }
    try {
        return m->create_tensor(name, cur, file_idx, offs);
    } catch (const std::exception & e) {
        moetier_set_last_error(e.what());
        throw;
    }
}

void moetier_hook_model_loaded(llama_model & model) {
    moetier_model * m = model.moetier.get();
    if (m == nullptr) {
        return;
    }
    try {
        m->finish_load();
        m->init_prefetch(model);
        m->init_io();
    } catch (const std::exception & e) {
        moetier_set_last_error(m->paths[0] + ": " + e.what());
        throw std::runtime_error(moetier_last_error());
    }
}

//
// graph hook and custom ops
//

static void moetier_op_resolve_impl(ggml_tensor * dst, void * userdata, bool warmup) noexcept {
    moetier_layer * l = (moetier_layer *) userdata;
    const ggml_tensor * ids = dst->src[0];
    const ggml_tensor * w   = dst->src[1];
    l->cache->resolve(*l, (const int32_t *) ids->data, w ? (const float *) w->data : nullptr, ids->ne[0], ids->ne[1],
            ids->nb[1], w ? w->nb[1] : 0, (int32_t *) dst->data, warmup);
}

// note: the CPU backend calls a custom op on every thread whatever its n_tasks, so the serial
// resolve runs on thread 0 only; the barrier after the node orders it before the load op
static void moetier_op_resolve(ggml_tensor * dst, int ith, int nth, void * userdata) noexcept {
    GGML_UNUSED(nth);
    if (ith == 0) {
        moetier_op_resolve_impl(dst, userdata, false);
    }
}

static void moetier_op_resolve_warmup(ggml_tensor * dst, int ith, int nth, void * userdata) noexcept {
    GGML_UNUSED(nth);
    if (ith == 0) {
        moetier_op_resolve_impl(dst, userdata, true);
    }
}

static void moetier_op_load(ggml_tensor * dst, int ith, int nth, void * userdata) noexcept {
    moetier_layer * l = (moetier_layer *) userdata;
    l->cache->load(ith, nth);

    // pass the slots through: the mul_mat_ids depend on this op, so they run after the reads
    const ggml_tensor * src = dst->src[0];
    const int64_t n  = ggml_nelements(dst);
    const int64_t i0 = n * ith / nth;
    const int64_t i1 = n * (ith + 1) / nth;
    memcpy((int32_t *) dst->data + i0, (const int32_t *) src->data + i0, (i1 - i0) * sizeof(int32_t));
}

// pass-through of the slots on every thread; thread 0 predicts and queues the background reads
static void moetier_op_prefetch(ggml_tensor * dst, int ith, int nth, void * userdata) noexcept {
    moetier_layer * l = (moetier_layer *) userdata;
    const ggml_tensor * src    = dst->src[0];
    const ggml_tensor * logits = dst->src[1];
    const int64_t n  = ggml_nelements(dst);
    const int64_t i0 = n * ith / nth;
    const int64_t i1 = n * (ith + 1) / nth;
    memcpy((int32_t *) dst->data + i0, (const int32_t *) src->data + i0, (i1 - i0) * sizeof(int32_t));
    if (ith == 0) {
        l->cache->prefetch(*l, (const float *) logits->data, logits->ne[1], logits->nb[1]);
    }
}

// the served layer whose build_moe_ffn is being built on this thread, between moetier_hook_moe_ids
// and its mul_mat_ids (graphs are built by one thread, one MoE block at a time)
struct moetier_graph_state {
    moetier_layer * layer   = nullptr;
    ggml_tensor   * low_ids = nullptr;
};
static thread_local moetier_graph_state g_graph_state;

ggml_tensor * moetier_hook_moe_ids(ggml_context * ctx, ggml_tensor * cur, ggml_tensor * selected_experts, ggml_tensor * weights, bool warmup,
                                   ggml_tensor ** up_exps, ggml_tensor ** gate_exps, ggml_tensor ** down_exps,
                                   ggml_tensor ** gate_up_exps) noexcept {
    g_graph_state = {};
    moetier_layer * l = moetier_model::layer_of(*gate_up_exps ? *gate_up_exps : *up_exps);
    if (l == nullptr) {
        return selected_experts;
    }
    const int64_t n_used   = selected_experts->ne[0];
    const int64_t n_tokens = selected_experts->ne[1];
    const int64_t n_planes = l->cache->has_low() ? 2 : 1;

    // the precision rule reads the weights only if it can pick anything but high
    ggml_tensor * args[2] = { selected_experts, nullptr };
    int n_args = 1;
    if (weights && l->cache->uses_weights()) {
        args[n_args++] = ggml_cont_2d(ctx, weights, n_used, n_tokens);
    }
    ggml_tensor * slots = ggml_custom_4d(ctx, GGML_TYPE_I32, n_used, n_tokens, n_planes, 1,
            args, n_args, warmup ? moetier_op_resolve_warmup : moetier_op_resolve, 1, l);
    ggml_format_name(slots, "moetier_resolve-%d", l->il);

    args[0] = slots;
    ggml_tensor * loaded = ggml_custom_4d(ctx, GGML_TYPE_I32, n_used, n_tokens, n_planes, 1,
            args, 1, moetier_op_load, GGML_N_TASKS_MAX, l);
    ggml_format_name(loaded, "moetier_load-%d", l->il);

    // prefetch: the next layers' routers on this gate input, then the prefetch op, which passes the
    // slots through (so it runs before the mul_mat_ids and overlaps them)
    if (l->router_stack && !warmup && cur && cur->type == GGML_TYPE_F32) {
        ggml_tensor * logits = ggml_mul_mat(ctx, l->router_stack, cur);
        ggml_format_name(logits, "moetier_router_stack-%d", l->il);
        ggml_tensor * pargs[2] = { loaded, logits };
        loaded = ggml_custom_4d(ctx, GGML_TYPE_I32, n_used, n_tokens, n_planes, 1, pargs, 2, moetier_op_prefetch,
                GGML_N_TASKS_MAX, l);
        ggml_format_name(loaded, "moetier_prefetch-%d", l->il);
    }

    ggml_tensor ** targets[4] = { up_exps, gate_exps, down_exps, gate_up_exps };
    for (ggml_tensor ** t : targets) {
        if (*t == nullptr) {
            continue;
        }
        for (const auto & p : l->projs) {
            if (p.meta == *t) {
                *t = p.pool[MOETIER_HIGH];
            }
        }
        GGML_ASSERT(moetier_model::layer_of(*t) == nullptr && "expert tensor of a served layer has no pool");
    }
    if (n_planes == 1) {
        return loaded;
    }
    g_graph_state.layer   = l;
    g_graph_state.low_ids = ggml_view_2d(ctx, loaded, n_used, n_tokens, loaded->nb[1], loaded->nb[2]);
    return ggml_view_2d(ctx, loaded, n_used, n_tokens, loaded->nb[1], 0);
}

ggml_tensor * moetier_hook_mul_mat_id(ggml_context * ctx, ggml_tensor * cur, ggml_tensor * as, ggml_tensor * b) noexcept {
    const moetier_graph_state & g = g_graph_state;
    if (g.layer == nullptr) {
        return cur;
    }
    for (const auto & p : g.layer->projs) {
        if (p.pool[MOETIER_HIGH] == as && p.pool[MOETIER_LOW] != nullptr) {
            ggml_tensor * low = ggml_mul_mat_id(ctx, p.pool[MOETIER_LOW], b, g.low_ids);
            return ggml_add(ctx, cur, low);
        }
    }
    return cur;
}

static bool moetier_is_op(const ggml_tensor * t, const char * prefix) {
    return t->op == GGML_OP_CUSTOM && strncmp(t->name, prefix, strlen(prefix)) == 0;
}

// a node that writes into memory it does not own (a copy into a view, set_rows into a cache): it
// keeps its place relative to the nodes that depend on the load
static bool moetier_writes_elsewhere(const ggml_tensor * t) {
    if (t->view_src == nullptr) {
        return false;
    }
    switch (t->op) {
        case GGML_OP_NONE:
        case GGML_OP_VIEW:
        case GGML_OP_RESHAPE:
        case GGML_OP_PERMUTE:
        case GGML_OP_TRANSPOSE:
            return false;
        default:
            return true;
    }
}

void moetier_hook_graph_built(const llama_model & model, ggml_cgraph * gf) noexcept {
    const moetier_model * m = model.moetier.get();
    if (m == nullptr || m->io == nullptr || !m->io->uses_uring() || gf == nullptr) {
        return;
    }
    ggml_tensor ** nodes = ggml_graph_nodes(gf);
    const int n = ggml_graph_n_nodes(gf);
    try {
        std::unordered_set<const ggml_tensor *> dep;
        std::vector<ggml_tensor *> ahead;
        std::vector<ggml_tensor *> behind;
        for (int i = 0; i < n; ++i) {
            if (!moetier_is_op(nodes[i], "moetier_load-")) {
                continue;
            }
            // window: up to the next layer's routing, which needs this layer's output anyway.
            // A node depends on the load if a source (or the tensor a source views) does; the others
            // go ahead of the load, both groups in their order: a topological order still.
            int j = i + 1;
            while (j < n && !moetier_is_op(nodes[j], "moetier_resolve-")) {
                ++j;
            }
            dep.clear();
            ahead.clear();
            behind.clear();
            dep.insert(nodes[i]);
            behind.push_back(nodes[i]);
            for (int k = i + 1; k < j; ++k) {
                ggml_tensor * t = nodes[k];
                bool d = moetier_writes_elsewhere(t) || (t->view_src && dep.count(t->view_src));
                for (int s = 0; s < GGML_MAX_SRC && !d; ++s) {
                    const ggml_tensor * src = t->src[s];
                    d = src && (dep.count(src) || (src->view_src && dep.count(src->view_src)));
                }
                if (d) {
                    dep.insert(t);
                    if (moetier_writes_elsewhere(t)) {
                        // what reads the written buffer later (e.g. the KV cache, through its own
                        // view) must stay behind the write
                        dep.insert(t->view_src);
                    }
                    behind.push_back(t);
                } else {
                    ahead.push_back(t);
                }
            }
            int k = i;
            for (ggml_tensor * t : ahead) {
                nodes[k++] = t;
            }
            for (ggml_tensor * t : behind) {
                nodes[k++] = t;
            }
            i = j - 1;
        }
    } catch (...) {
        // out of memory in the sets: the order was not touched (nodes are written only at the end
        // of a window, without allocating), so the graph stays valid
    }
}

//
// C API
//

static moetier_model * moetier_of(const llama_model * model) {
    return model ? model->moetier.get() : nullptr;
}

struct moetier_params moetier_default_params(void) {
    moetier_params p = {
        /*.cache_bytes =*/ 0,
        /*.store_dir   =*/ nullptr,
        /*.policy      =*/ "lru",
        /*.t1          =*/ 0.6f,
        /*.t2          =*/ 0.9f,
        /*.low_frac    =*/ 0.25f,
        /*.w_lru       =*/ 0.25f,
        /*.w_lfu       =*/ 0.25f,
        /*.w_lhu       =*/ 0.25f,
        /*.w_fld       =*/ 0.25f,
        /*.prefetch    =*/ 0,
        /*.io_threads  =*/ 2,
        /*.io_uring    =*/ 1,
        /*.direct_io   =*/ true,
    };
    return p;
}

bool moetier_model_has_cache(const struct llama_model * model) {
    return moetier_of(model) != nullptr;
}

int32_t moetier_model_cache_info(const struct llama_model * model, struct moetier_cache_info * info) {
    const moetier_model * m = moetier_of(model);
    if (!m) {
        return -1;
    }
    *info = {};
    info->n_layers        = (int32_t) m->layers.size();
    info->n_expert        = m->n_expert;
    info->n_groups        = (int32_t) m->caches.size();
    info->expert_bytes    = m->expert_bytes;
    info->expert_bytes_low = m->expert_bytes_low;
    info->min_cache_bytes = m->min_cache_bytes;
    info->from_store      = m->store != nullptr;
    info->direct_io       = m->store ? m->store_file->direct() : m->files[0]->direct();
    info->io_uring        = m->io && m->io->uses_uring();
    for (const auto & c : m->caches) {
        info->n_slots     += c->n_slots(MOETIER_HIGH);
        info->n_slots_low += c->n_slots(MOETIER_LOW);
        info->cache_bytes += c->pool_bytes();
    }
    return 0;
}

static moetier_layer_stats moetier_stats_of(int32_t layer, const moetier_layer_counters & c) {
    moetier_layer_stats out;
    out.layer        = layer;
    out.n_lookups    = c.n_lookups;
    out.n_hits       = c.n_hits;
    out.n_misses     = c.n_misses;
    out.n_bytes_read = c.n_bytes_read;
    out.read_us      = c.read_us;
    out.n_hits_low   = c.n_hits_low;
    out.n_loads_high = c.n_loads_high;
    out.n_loads_low  = c.n_loads_low;
    out.n_skipped    = c.n_skipped;
    out.n_bytes_low  = c.n_bytes_low;
    return out;
}

int32_t moetier_model_layer_stats(const struct llama_model * model, struct moetier_layer_stats * out, int32_t n_max) {
    moetier_model * m = moetier_of(model);
    if (!m) {
        return 0;
    }
    for (auto & c : m->caches) {
        c->sync();
    }
    const int32_t n = (int32_t) m->layers.size();
    for (int32_t i = 0; i < n && i < n_max; ++i) {
        const moetier_layer & l = *m->layers[i];
        out[i] = moetier_stats_of(l.il, l.counters);
    }
    return n;
}

struct moetier_layer_stats moetier_model_stats_total(const struct llama_model * model) {
    moetier_layer_counters total;
    if (moetier_model * m = moetier_of(model)) {
        for (auto & c : m->caches) {
            c->sync();
        }
        for (const auto & l : m->layers) {
            total += l->counters;
        }
    }
    return moetier_stats_of(-1, total);
}

int32_t moetier_model_prefetch_stats(const struct llama_model * model, struct moetier_prefetch_stats * out) {
    *out = {};
    moetier_model * m = moetier_of(model);
    if (!m) {
        return -1;
    }
    for (auto & c : m->caches) {
        c->sync();
        c->add_prefetch_stats(*out);
    }
    return 0;
}

void moetier_model_reset_stats(struct llama_model * model) {
    moetier_model * m = moetier_of(model);
    if (!m) {
        return;
    }
    for (auto & c : m->caches) {
        c->sync();
    }
    for (auto & l : m->layers) {
        l->counters = moetier_layer_counters{};
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

const char * moetier_model_error(const struct llama_model * model) {
    static thread_local std::string msg;
    msg.clear();
    const moetier_model * m = moetier_of(model);
    if (m) {
        for (const auto & c : m->caches) {
            msg = c->error();
            if (!msg.empty()) {
                break;
            }
        }
    }
    return msg.c_str();
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
