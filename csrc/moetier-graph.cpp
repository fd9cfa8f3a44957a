// The graph hooks of moetier-hooks.h: what moetier adds to a compute graph. Per served MoE layer the
// resolve, load and prefetch custom ops, the slot ids the mul_mat_ids use (and the low-precision
// product), and, once the graph is built, the node order that lets the nodes which do not need a
// layer's experts run while its reads do.

#include "ggml-backend.h"
#include "ggml.h"
#include "llama-model.h"
#include "moetier-cache.h"
#include "moetier-hooks.h"
#include "moetier-layer.h"
#include "moetier-model.h"
#include "moetier-routing.h"

#include <cstring>
#include <unordered_set>
#include <vector>

//
// custom ops: userdata is the served layer
//

static void moetier_op_resolve_impl(ggml_tensor * dst, void * userdata, bool warmup) noexcept {
    moetier_layer *     l   = (moetier_layer *) userdata;
    const ggml_tensor * ids = dst->src[0];
    const ggml_tensor * w   = dst->src[1];
    const int32_t *     e   = (const int32_t *) ids->data;
    size_t              nb1 = ids->nb[1];
    if (l->routing && !warmup && ids->ne[0] == l->routing->n_used()) {
        // benchmarks only: the experts a routing trace chose (the model's gate weights stay)
        e   = l->routing->ids(l->routing_layer, ids->ne[1]);
        nb1 = (size_t) ids->ne[0] * sizeof(int32_t);
    }
    if (!l->keys.empty()) {
        // a variant sharing a cache: its experts are keys of the cache
        const int64_t n_used = ids->ne[0];
        l->key_ids.resize((size_t) (n_used * ids->ne[1]));
        for (int64_t t = 0; t < ids->ne[1]; ++t) {
            const int32_t * row = (const int32_t *) ((const char *) e + t * nb1);
            for (int64_t k = 0; k < n_used; ++k) {
                l->key_ids[t * n_used + k] = l->keys[row[k]];
            }
        }
        e   = l->key_ids.data();
        nb1 = (size_t) n_used * sizeof(int32_t);
    }
    moetier_layer * u = l->target ? l->target : l;
    l->cache->resolve(*u, e, w ? (const float *) w->data : nullptr, ids->ne[0], ids->ne[1], nb1, w ? w->nb[1] : 0,
                      (int32_t *) dst->data, warmup);
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

// this thread's share of src copied to dst: the slots pass through an op, so what depends on the op
// runs after it
static void moetier_op_pass_through(ggml_tensor * dst, int ith, int nth) {
    const ggml_tensor * src = dst->src[0];
    const int64_t       n   = ggml_nelements(dst);
    const int64_t       i0  = n * ith / nth;
    const int64_t       i1  = n * (ith + 1) / nth;
    memcpy((int32_t *) dst->data + i0, (const int32_t *) src->data + i0, (i1 - i0) * sizeof(int32_t));
}

static void moetier_op_load(ggml_tensor * dst, int ith, int nth, void * userdata) noexcept {
    const moetier_layer * l = (const moetier_layer *) userdata;
    l->cache->load(l->target ? *l->target : *l, ith, nth);
    moetier_op_pass_through(dst, ith, nth);
}

static void moetier_op_upload_impl(ggml_tensor * dst, int ith, void * userdata, bool warmup) noexcept {
    if (ith == 0) {
        moetier_layer *     l       = (moetier_layer *) userdata;
        const ggml_tensor * ram     = dst->src[0];
        const int64_t       n       = dst->ne[0] * dst->ne[1];
        // a second plane in: the resolve's low slots (mixed precision); out: the VRAM tier's low slots, or
        // (cooperative compute, exact modes only) the RAM slots of what the CPU computes
        const int32_t *     ram_low = ram->ne[2] == 2 ? (const int32_t *) ram->data + n : nullptr;
        l->cache->upload(*l, (const int32_t *) ram->data, dst->ne[0], dst->ne[1], ram_low,
                         dst->ne[2] == 2 && ram_low == nullptr, (int32_t *) dst->data, warmup);
    }
}

// the VRAM tier: thread 0 copies the layer's VRAM misses from their RAM slots, out: the VRAM slots
static void moetier_op_upload(ggml_tensor * dst, int ith, int nth, void * userdata) noexcept {
    GGML_UNUSED(nth);
    moetier_op_upload_impl(dst, ith, userdata, false);
}

static void moetier_op_upload_warmup(ggml_tensor * dst, int ith, int nth, void * userdata) noexcept {
    GGML_UNUSED(nth);
    moetier_op_upload_impl(dst, ith, userdata, true);
}

// pass-through of the slots on every thread; thread 0 predicts and starts the background reads
static void moetier_op_prefetch(ggml_tensor * dst, int ith, int nth, void * userdata) noexcept {
    const moetier_layer * l = (const moetier_layer *) userdata;
    moetier_op_pass_through(dst, ith, nth);
    if (ith == 0) {
        const ggml_tensor * logits = dst->src[1];
        l->cache->prefetch(*l, (const float *) logits->data, logits->ne[1], logits->nb[1]);
    }
}

//
// build_moe_ffn
//

moetier_moe moetier_hook_moe_ids(ggml_context * ctx,
                                 ggml_tensor *  cur,
                                 ggml_tensor *  selected_experts,
                                 ggml_tensor *  weights,
                                 bool           warmup,
                                 ggml_tensor ** up_exps,
                                 ggml_tensor ** gate_exps,
                                 ggml_tensor ** down_exps,
                                 ggml_tensor ** gate_up_exps) noexcept {
    moetier_moe moe;
    moe.ids           = selected_experts;
    moetier_layer * l = moetier_model::layer_of(*gate_up_exps ? *gate_up_exps : *up_exps);
    if (l == nullptr) {
        return moe;
    }
    moetier_cache & cache = *l->cache;
    if (cache.vram_static()) {
        // every expert of the group is in VRAM, each layer's in consecutive slots: the mul_mat_ids take
        // the layer's slots (a leaf tensor made at load) with the router's ids, as stock takes its expert
        // tensors
        ggml_tensor ** targets[4] = { up_exps, gate_exps, down_exps, gate_up_exps };
        for (ggml_tensor ** t : targets) {
            for (const auto & p : l->projs) {
                if (*t != nullptr && p.meta == *t) {
                    GGML_ASSERT(p.vram_view != nullptr && "VRAM tier: a preloaded layer has no view of its slots");
                    *t = p.vram_view;
                }
            }
        }
        moe.layer = l;
        return moe;
    }
    const int64_t n_used   = selected_experts->ne[0];
    const int64_t n_tokens = selected_experts->ne[1];
    const int64_t n_planes = cache.has_low() ? 2 : 1;

    // the precision rule reads the weights only if it can pick anything but high
    ggml_tensor * args[2] = { selected_experts, nullptr };
    int           n_args  = 1;
    if (weights && cache.uses_weights()) {
        args[n_args++] = ggml_cont_2d(ctx, weights, n_used, n_tokens);
    }
    ggml_tensor * slots = ggml_custom_4d(ctx, GGML_TYPE_I32, n_used, n_tokens, n_planes, 1, args, n_args,
                                         warmup ? moetier_op_resolve_warmup : moetier_op_resolve, 1, l);
    ggml_format_name(slots, "moetier_resolve-%d", l->il);

    // prefetch: the next layers' routers on this gate input, then the prefetch op, which passes the
    // slots through. On the ring it runs before the load op: the next layers' reads go on the ring
    // beside this layer's (whose urgent reads start first), so the disk has them in hand while this
    // layer's last reads are checked. With I/O threads it runs after the load op, as their wakeups
    // during the compute threads' own reads would preempt them (2 cores).
    ggml_tensor * router_stack = cache.router_stack(l->il);
    ggml_tensor * logits       = nullptr;
    if (router_stack && !warmup && cur && cur->type == GGML_TYPE_F32) {
        logits = ggml_mul_mat(ctx, router_stack, cur);
        ggml_format_name(logits, "moetier_router_stack-%d", l->il);
    }
    const bool    early = cache.reads_on_ring();
    ggml_tensor * pargs[2];
    if (logits && early) {
        pargs[0] = slots;
        pargs[1] = logits;
        slots    = ggml_custom_4d(ctx, GGML_TYPE_I32, n_used, n_tokens, n_planes, 1, pargs, 2, moetier_op_prefetch,
                                  GGML_N_TASKS_MAX, l);
        ggml_format_name(slots, "moetier_prefetch-%d", l->il);
    }

    args[0]              = slots;
    ggml_tensor * loaded = ggml_custom_4d(ctx, GGML_TYPE_I32, n_used, n_tokens, n_planes, 1, args, 1, moetier_op_load,
                                          GGML_N_TASKS_MAX, l);
    ggml_format_name(loaded, "moetier_load-%d", l->il);

    if (logits && !early) {
        pargs[0] = loaded;
        pargs[1] = logits;
        loaded   = ggml_custom_4d(ctx, GGML_TYPE_I32, n_used, n_tokens, n_planes, 1, pargs, 2, moetier_op_prefetch,
                                  GGML_N_TASKS_MAX, l);
        ggml_format_name(loaded, "moetier_prefetch-%d", l->il);
    }

    // the VRAM tier: the layer's experts are copied into VRAM slots and computed there
    // (with cooperative compute, in decode, a second plane: the RAM slots of the misses the CPU computes)
    const bool    in_vram  = cache.has_vram();
    const int64_t n_upload = cache.vram_cpu_plane(n_tokens) || n_planes == 2 ? 2 : 1;
    if (in_vram) {
        GGML_ASSERT((n_planes == 1 || cache.has_vram_low()) && "VRAM tier: low-precision slots without a VRAM pool");
        GGML_ASSERT((n_planes == 1 || !cache.vram_cpu()) && "cooperative compute serves exact modes only");
        // the ids of what the GPU does not compute stay distinct within a token: a zero slot per position
        GGML_ASSERT((warmup || n_used <= cache.vram_zero_slots()) && "more experts per token than zero slots");
        ggml_tensor * src = loaded;
        loaded            = ggml_custom_4d(ctx, GGML_TYPE_I32, n_used, n_tokens, n_upload, 1, &src, 1,
                                warmup ? moetier_op_upload_warmup : moetier_op_upload, 1, l);
        ggml_format_name(loaded, "moetier_upload-%d", l->il);
    }

    ggml_tensor ** targets[4] = { up_exps, gate_exps, down_exps, gate_up_exps };
    for (ggml_tensor ** t : targets) {
        if (*t == nullptr) {
            continue;
        }
        for (const auto & p : l->projs) {
            if (p.meta == *t) {
                *t = in_vram ? p.vram_pool : p.pool[MOETIER_PRECISION_HIGH];
            }
        }
        GGML_ASSERT(moetier_model::layer_of(*t) == nullptr && "expert tensor of a served layer has no pool");
    }
    moe.layer = l;
    if (in_vram && n_upload == 2) {
        moe.ids         = ggml_view_2d(ctx, loaded, n_used, n_tokens, loaded->nb[1], 0);
        moe.low_ids     = ggml_view_2d(ctx, loaded, n_used, n_tokens, loaded->nb[1], loaded->nb[2]);
        moe.second_ram  = n_planes == 1;
        moe.second_vram = n_planes == 2;
        return moe;
    }
    if (n_planes == 1) {
        moe.ids = loaded;
        return moe;
    }
    moe.ids     = ggml_view_2d(ctx, loaded, n_used, n_tokens, loaded->nb[1], 0);
    moe.low_ids = ggml_view_2d(ctx, loaded, n_used, n_tokens, loaded->nb[1], loaded->nb[2]);
    return moe;
}

// cooperative compute: one of the sums the gate and up hooks below returned, cpu + gpu, each the plain
// mul_mat_id of its plane (no adapter, scale or bias between)
static bool moetier_coop_sum(const moetier_moe & moe, const ggml_tensor * sum, ggml_tensor ** cpu, ggml_tensor ** gpu) {
    if (sum == nullptr || sum->op != GGML_OP_ADD) {
        return false;
    }
    ggml_tensor * c = sum->src[0];
    ggml_tensor * g = sum->src[1];
    if (c == nullptr || g == nullptr || c->op != GGML_OP_MUL_MAT_ID || g->op != GGML_OP_MUL_MAT_ID ||
        c->src[2] != moe.low_ids || g->src[2] != moe.ids || c->src[1] != g->src[1]) {
        return false;
    }
    *cpu = c;
    *gpu = g;
    return true;
}

// cooperative compute, at the down projection: when its input is a split GLU (swiglu, geglu, ...) of
// the gate and up sums, each plane gets its own activation and down product, added once at the end.
// The CPU then computes its experts' whole FFN in the upload op's split, while the copies run, and the
// layer's graph leaves the GPU for the CPU once, not twice (the GPU's activation of the gate and up
// sums would need the CPU's products back first). Per token and expert one plane holds zero rows
// (zero slot or negative id), whose activation and down product are zero: the sum is the other exactly.
static ggml_tensor * moetier_coop_down(ggml_context *      ctx,
                                       const moetier_moe & moe,
                                       ggml_tensor *       cur,
                                       ggml_tensor *       as,
                                       ggml_tensor *       ram_pool,
                                       ggml_tensor *       b) {
    if (b->op != GGML_OP_GLU || b->src[1] == nullptr || cur->op != GGML_OP_MUL_MAT_ID || cur->src[1] != b ||
        cur->src[0] != as) {
        return nullptr;
    }
    ggml_tensor *gate_c, *gate_g, *up_c, *up_g;
    if (!moetier_coop_sum(moe, b->src[0], &gate_c, &gate_g) || !moetier_coop_sum(moe, b->src[1], &up_c, &up_g)) {
        return nullptr;
    }
    ggml_tensor * act_c = ggml_glu_split(ctx, gate_c, up_c, ggml_get_glu_op(b));
    ggml_tensor * act_g = ggml_glu_split(ctx, gate_g, up_g, ggml_get_glu_op(b));
    // the activation's own parameters (swiglu_oai's alpha and limit) as build_moe_ffn set them
    memcpy(act_c->op_params, b->op_params, sizeof(b->op_params));
    memcpy(act_g->op_params, b->op_params, sizeof(b->op_params));
    ggml_tensor * down_c = ggml_mul_mat_id(ctx, ram_pool, act_c, moe.low_ids);
    ggml_tensor * down_g = ggml_mul_mat_id(ctx, as, act_g, moe.ids);
    ggml_format_name(act_c, "moetier_cpu_act-%d", moe.layer->il);
    ggml_format_name(down_c, "moetier_cpu_down-%d", moe.layer->il);
    // the CPU's branch first in the graph's order, so it runs in the upload op's split
    return ggml_add(ctx, down_c, down_g);
}

ggml_tensor * moetier_hook_mul_mat_id(ggml_context *      ctx,
                                      const moetier_moe & moe,
                                      ggml_tensor *       cur,
                                      ggml_tensor *       as,
                                      ggml_tensor *       b) noexcept {
    if (moe.layer == nullptr || moe.low_ids == nullptr) {
        return cur;
    }
    for (const auto & p : moe.layer->projs) {
        if (moe.second_ram && p.vram_pool == as && p.pool[MOETIER_PRECISION_HIGH] != nullptr) {
            ggml_tensor * whole = moetier_coop_down(ctx, moe, cur, as, p.pool[MOETIER_PRECISION_HIGH], b);
            if (whole != nullptr) {
                return whole;
            }
        }
    }
    for (const auto & p : moe.layer->projs) {
        // the second product: the low-precision pools, or the RAM tier's computed on the CPU (cooperative
        // compute); per token and expert one of the two is a zero row, so the sum is the other exactly
        ggml_tensor * first  = moe.second_ram || moe.second_vram ? p.vram_pool : p.pool[MOETIER_PRECISION_HIGH];
        ggml_tensor * second = moe.second_ram  ? p.pool[MOETIER_PRECISION_HIGH] :
                               moe.second_vram ? p.vram_pool_low :
                                                 p.pool[MOETIER_PRECISION_LOW];
        if (first == as && second != nullptr) {
            ggml_tensor * other = ggml_mul_mat_id(ctx, second, b, moe.low_ids);
            // cooperative compute: the CPU's product first in the graph's order, in the upload op's CPU split,
            // so it runs while the copies do (a + b and b + a are the same sum)
            return moe.second_ram ? ggml_add(ctx, other, cur) : ggml_add(ctx, cur, other);
        }
    }
    return cur;
}

//
// node order
//

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
    const int      n     = ggml_graph_n_nodes(gf);
    try {
        std::unordered_set<const ggml_tensor *> dep;
        std::vector<ggml_tensor *>              ahead;
        std::vector<ggml_tensor *>              behind;
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
                bool          d = moetier_writes_elsewhere(t) || (t->view_src && dep.count(t->view_src));
                for (int s = 0; s < GGML_MAX_SRC && !d; ++s) {
                    const ggml_tensor * src = t->src[s];
                    d                       = src && (dep.count(src) || (src->view_src && dep.count(src->view_src)));
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
// backend placement
//

void moetier_hook_graph_compute(const llama_model & model, ggml_backend_sched * sched) noexcept {
    if (model.moetier == nullptr) {
        return;
    }
    model.moetier->compute_mutex().lock();  // released by moetier_hook_graph_computed, which always follows
    if (sched == nullptr) {
        return;
    }
    for (const auto & c : model.moetier->caches) {
        if (c->vram_device() == nullptr) {
            continue;
        }
        ggml_backend_t compute = nullptr;
        for (int b = 0; b < ggml_backend_sched_get_n_backends(sched); ++b) {
            ggml_backend_t be = ggml_backend_sched_get_backend(sched, b);
            if (ggml_backend_get_device(be) == c->vram_device()) {
                compute = be;
            }
        }
        c->set_vram_compute(compute);  // nullptr: no such backend here, the copies are waited for on the host
    }
}

void moetier_hook_graph_computed(const llama_model & model) noexcept {
    if (model.moetier == nullptr) {
        return;
    }
    for (const auto & c : model.moetier->caches) {
        c->graph_computed();
    }
    model.moetier->compute_mutex().unlock();
}

uint32_t moetier_hook_graph_extra_nodes(const llama_model & model) noexcept {
    const moetier_model * m = model.moetier.get();
    // per served layer: resolve, prefetch, load and upload ops, the stacked routers' matmul, the
    // low-precision matmuls and adds, views; and a CUDA build's split copies around them (several
    // per layer, times the scheduler's copies with pipeline parallelism)
    return m == nullptr ? 0 : 64u * (uint32_t) m->layers.size();
}

void moetier_hook_graph_sched(const llama_model &  model,
                              ggml_backend_sched * sched,
                              ggml_backend *       backend_cpu,
                              ggml_cgraph *        gf) noexcept {
    if (model.moetier == nullptr || sched == nullptr || backend_cpu == nullptr || gf == nullptr ||
        ggml_backend_sched_get_n_backends(sched) < 2) {
        return;
    }
    // the RAM pools, and a VRAM tier's pools in host memory (vram_host); a VRAM tier's pools in a GPU's
    // memory are left to the scheduler, which places their mul_mat_ids on that GPU
    static const char    pool_prefix[] = "moetier_pool_";
    static const char    vram_prefix[] = "moetier_vram_";
    ggml_tensor ** const nodes         = ggml_graph_nodes(gf);
    const int            n             = ggml_graph_n_nodes(gf);
    for (int i = 0; i < n; ++i) {
        ggml_tensor * t = nodes[i];
        // the cache's own ops (resolve, load, prefetch, upload) call into this process: the CPU runs
        // them, also where a layer lives on a backend that claims every op (an RPC server would get
        // a function pointer of another process)
        if (t->op == GGML_OP_CUSTOM && strncmp(t->name, "moetier_", 8) == 0) {
            ggml_backend_sched_set_tensor_backend(sched, t, backend_cpu);
            continue;
        }
        if (t->op != GGML_OP_MUL_MAT_ID) {
            continue;
        }
        const ggml_tensor * w = t->src[0];
        if (strncmp(w->name, pool_prefix, sizeof(pool_prefix) - 1) == 0 ||
            (strncmp(w->name, vram_prefix, sizeof(vram_prefix) - 1) == 0 && w->buffer &&
             ggml_backend_buffer_is_host(w->buffer))) {
            ggml_backend_sched_set_tensor_backend(sched, t, backend_cpu);
        }
    }
}
