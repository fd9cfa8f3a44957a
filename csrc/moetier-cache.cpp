#include "moetier-cache.h"

#include "ggml-cpu.h"
#include "moetier-impl.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <thread>
#if defined(__x86_64__) || defined(__i386__)
#    include <immintrin.h>
#endif

// upper bound on compute threads that may run the load op; bounce buffers are per thread index
static constexpr int MOETIER_MAX_THREADS = 512;

// upload's vram_of: the expert computes on the CPU from its RAM slot
static constexpr int32_t MOETIER_VRAM_ON_CPU = -2;

// a thread that found nothing to do for `idle` rounds: spin a little (as ggml's barrier does), then
// give the core away (thread 0 may be asleep in a wait for the disk, and a core may be shared)
static inline void moetier_relax(int32_t idle) {
    if (idle > 256) {
        std::this_thread::yield();
        return;
    }
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

moetier_cache::moetier_cache(int32_t                        n_expert,
                             const int32_t                  n_slots[MOETIER_N_PRECISIONS],
                             const moetier_precision_rule & rule_,
                             const std::string &            policy,
                             const moetier_policy_weights & weights,
                             std::vector<moetier_proj>      shapes_,
                             bool                           simulate_,
                             const moetier_policy_env &     env,
                             int32_t                        n_route,
                             int32_t                        n_capacity) :
    n_expert_(n_expert),
    rule(rule_),
    simulate(simulate_),
    shapes(std::move(shapes_)) {
    GGML_ASSERT(n_slots[MOETIER_PRECISION_HIGH] >= (n_route > 0 ? n_route : n_expert) && n_expert > 0 &&
                n_slots[MOETIER_PRECISION_LOW] >= 0);
    GGML_ASSERT(n_slots[MOETIER_PRECISION_LOW] == 0 || shapes[0].store != nullptr);
    vram_env        = env;
    vram_env.record = nullptr;  // a decision log is the RAM tier's
    for (int32_t prec = 0; prec < MOETIER_N_PRECISIONS; ++prec) {
        sets[prec] = std::make_unique<moetier_slots>((moetier_precision) prec, n_slots[prec], n_expert,
                                                     moetier_policy_create(policy, weights, env),
                                                     prec == MOETIER_PRECISION_HIGH ? n_capacity : 0);
        if (!simulate) {
            sets[prec]->alloc(shapes);
        }
    }
    need.assign(n_expert, MOETIER_NEED_NONE);
    pass.tasks.resize((size_t) MOETIER_N_PRECISIONS * n_expert * shapes.size());
    // a layer uses one version of each expert at most: one check per expert
    pass.checks.resize(n_expert);
    pass.check_states = std::make_unique<std::atomic<uint8_t>[]>(pass.checks.size());
    // the next layers' prefetches: a few layers' experts (a deeper walk's extra ones are left to their layer)
    pass.aheads.reserve((size_t) 4 * MOETIER_N_PRECISIONS * n_expert);
    pass.ahead_states = std::make_unique<std::atomic<uint8_t>[]>(pass.aheads.capacity());
    bounce.resize(MOETIER_MAX_THREADS);
}

moetier_cache::~moetier_cache() {
    if (elastic) {
        elastic->remove_pool(elastic_pool);
    }
    if (vram_event) {
        if (copies_pending) {
            ggml_backend_event_synchronize(vram_event);
        }
        ggml_backend_event_free(vram_event);
    }
    if (vram_consumed) {
        if (consumed_set) {
            ggml_backend_event_synchronize(vram_consumed);
        }
        ggml_backend_event_free(vram_consumed);
    }
}

void moetier_cache::add_layer(moetier_layer * layer) {
    for (auto & set : sets) {
        set->add_layer(layer->il);
    }
    for (moetier_slots * v : { vram.get(), vram_low.get() }) {
        if (v) {
            v->add_layer(layer->il);
        }
    }
    layers_.push_back(layer);
    layer->cache = this;
}

void moetier_cache::set_vram(ggml_backend_dev_t             dev,
                             bool                           host,
                             bool                           cpu,
                             int32_t                        n_slots,
                             int32_t                        n_slots_low,
                             int32_t                        n_used,
                             bool                           pin_ram,
                             const std::string &            policy,
                             const moetier_policy_weights & weights) {
    GGML_ASSERT((dev != nullptr || simulate) && n_slots >= n_expert_);
    GGML_ASSERT(n_slots_low == 0 || (n_slots_low >= n_expert_ && sets[MOETIER_PRECISION_LOW]->n_slots() > 0));
    vram = std::make_unique<moetier_slots>(MOETIER_PRECISION_HIGH, n_slots, n_expert_,
                                           moetier_policy_create(policy, weights, vram_env));
    if (n_slots_low > 0) {
        vram_low = std::make_unique<moetier_slots>(MOETIER_PRECISION_LOW, n_slots_low, n_expert_,
                                                   moetier_policy_create(policy, weights, vram_env));
    }
    n_zero = std::max<int32_t>(1, n_used);
    vram_of.assign(n_expert_, -1);
    vram_low_of.assign(n_expert_, -1);
    if (simulate) {
        return;  // replay: the bookkeeping only
    }
    for (moetier_slots * v : { vram.get(), vram_low.get() }) {
        if (v == nullptr) {
            continue;
        }
        v->alloc(shapes, host ? ggml_backend_cpu_buffer_type() : ggml_backend_dev_buffer_type(dev), /*vram =*/true,
                 n_zero);
        for (size_t k = 0; k < shapes.size(); ++k) {
            GGML_ASSERT(v->tensor(k)->nb[2] == shapes[k].expert_bytes(v->prec()));
        }
    }
    vram_dev = dev;
    vram_backend.reset(
        ggml_backend_dev_init(host ? ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU) : dev, nullptr));
    // a device with events copies asynchronously (nullptr: the CPU device of vram_host, copies are memcpy)
    vram_event    = host ? nullptr : ggml_backend_event_new(dev);
    vram_consumed = host ? nullptr : ggml_backend_event_new(dev);
    if (!vram_backend) {
        throw std::runtime_error(
            format("failed to start a backend on %s for the VRAM tier's copies", ggml_backend_dev_name(dev)));
    }
    ggml_backend_buffer_type_t pinned = host || !pin_ram ? nullptr : ggml_backend_dev_host_buffer_type(dev);
    if (pinned != nullptr) {
        for (auto & set : sets) {
            set->alloc(shapes, pinned);
        }
    }
    cooperative = cpu;
    if (cooperative) {
        measure_vram_costs();
    }
}

void moetier_cache::graph_computed() noexcept {
    if (vram_consumed && vram_compute) {
        ggml_backend_event_record(vram_consumed, vram_compute);
        consumed_set = true;
    }
}

int32_t moetier_cache::use_repacked(ggml_backend_buffer_type_t repack_buft) {
    if (simulate || vram) {
        return 0;
    }
    for (auto & set : sets) {
        set->use_repacked(repack_buft);
    }
    return n_repacked();
}

int32_t moetier_cache::use_huge_pages() {
    n_huge_ = 0;
    if (simulate) {
        return 0;
    }
    for (auto & set : sets) {
        if (set->n_slots() > 0 && set->use_huge_pages()) {
            n_huge_ += (int32_t) shapes.size();
        }
    }
    return n_huge_;
}

void moetier_cache::start_populate() {
    if (simulate) {
        return;
    }
    for (auto & set : sets) {
        set->start_populate();
    }
}

void moetier_cache::preload_vram() {
    GGML_ASSERT(vram && !simulate && (int64_t) vram->n_slots() == (int64_t) n_expert_ * (int64_t) layers_.size());
    moetier_slots &        v  = *vram;
    const moetier_slots &  hi = *sets[MOETIER_PRECISION_HIGH];
    moetier_aligned_buffer bb;
    for (moetier_layer * l : layers_) {
        const moetier_policy_ctx pctx = policy_ctx(l->il);
        for (int32_t e = 0; e < n_expert_; ++e) {
            // the RAM tier's slot e holds nothing yet: a staging area
            moetier_error err;
            if (!moetier_read_expert(*l, MOETIER_PRECISION_HIGH, e, e, bb, err)) {
                throw std::runtime_error(err.msg);
            }
            const int32_t s = v.take({ l->il, e }, pctx);
            GGML_ASSERT(s >= 0);
            for (size_t k = 0; k < shapes.size(); ++k) {
                ggml_backend_tensor_set(v.tensor(k),
                                        (const char *) hi.tensor(k)->data + (size_t) e * hi.tensor(k)->nb[2],
                                        (size_t) s * v.tensor(k)->nb[2], v.tensor(k)->nb[2]);
            }
        }
        for (int32_t e = 1; e < n_expert_; ++e) {
            GGML_ASSERT(v.find(l->il, e) == v.find(l->il, 0) + e &&
                        "VRAM tier: a layer's preloaded slots are consecutive");
        }
    }
    // each layer's slots as a tensor of its own, a leaf of the graph as stock's expert tensors are: a view
    // made in the graph would be a node between the gate and up products, and ggml-cuda fuses the two
    // products and their activation only where they are adjacent nodes
    const ggml_init_params ip = { ggml_tensor_overhead() * layers_.size() * shapes.size(), nullptr, true };
    vram_views.reset(ggml_init(ip));
    if (!vram_views) {
        throw std::runtime_error("VRAM tier: out of memory for the layers' views of the VRAM pools");
    }
    for (moetier_layer * l : layers_) {
        const size_t base = (size_t) v.find(l->il, 0);
        for (size_t k = 0; k < shapes.size() && k < l->projs.size(); ++k) {
            ggml_tensor * pool = v.tensor(k);
            ggml_tensor * t    = ggml_view_3d(vram_views.get(), pool, pool->ne[0], pool->ne[1], n_expert_, pool->nb[1],
                                              pool->nb[2], base * pool->nb[2]);
            t->op              = GGML_OP_NONE;
            t->src[0]          = nullptr;
            t->data            = nullptr;
            memset(t->op_params, 0, sizeof(t->op_params));
            ggml_format_name(t, "moetier_vram_layer-%d-%zu", l->il, k);
            if (ggml_backend_view_init(t) != GGML_STATUS_SUCCESS) {
                throw std::runtime_error("VRAM tier: the backend refused a layer's view of its VRAM pool");
            }
            l->projs[k].vram_view = t;
        }
    }
    vram_static_ = true;
}

void moetier_cache::measure_vram_costs() {
    if (const char * env = getenv("MOETIER_VRAM_COSTS")) {
        if (sscanf(env, "%f,%f", &copy_us, &cpu_us) != 2 || !(copy_us > 0.0f) || !(cpu_us > 0.0f)) {
            throw std::runtime_error(
                format("MOETIER_VRAM_COSTS=%s: expected COPY_US,CPU_US, two positive numbers", env));
        }
        return;
    }
    moetier_slots & hi    = *sets[MOETIER_PRECISION_HIGH];
    // the first slots of the RAM tier, before any expert is in them: zeros (the timing of garbage is not
    // the point); several, so that the CPU's time is that of experts read from memory, not from its caches
    const int64_t   n_cpu = std::min<int64_t>(8, hi.n_slots());
    for (size_t k = 0; k < shapes.size(); ++k) {
        memset(hi.tensor(k)->data, 0, (size_t) n_cpu * hi.tensor(k)->nb[2]);
    }
    std::vector<int64_t> t_copy, t_cpu;
    for (int rep = 0; rep < 5; ++rep) {
        const int64_t t0 = moetier_time_us();
        for (size_t k = 0; k < shapes.size(); ++k) {
            ggml_backend_tensor_set_async(vram_backend.get(), vram->tensor(k), hi.tensor(k)->data, 0,
                                          vram->tensor(k)->nb[2]);
        }
        ggml_backend_synchronize(vram_backend.get());
        t_copy.push_back(moetier_time_us() - t0);
    }

    // the CPU: one token through each projection of one slot, and of n_cpu slots, on as many threads as a
    // context gets; the difference per expert is the cost of one more expert in a layer's CPU product
    // (without what every product costs once: starting the threads, quantizing the input)
    const int        n_threads = std::max(1, (int) std::thread::hardware_concurrency());
    ggml_init_params ip        = { ggml_tensor_overhead() * (16 + 4 * (size_t) n_cpu * shapes.size()) +
                                       2 * ggml_graph_overhead() + 1024 * 1024,
                                   nullptr, false };
    ggml_context_ptr ctx(ggml_init(ip));
    if (!ctx) {
        throw std::runtime_error("failed to create the context that measures the CPU's cost per expert");
    }
    auto time_experts = [&](int64_t n) {
        ggml_cgraph * gf = ggml_new_graph(ctx.get());
        for (size_t k = 0; k < shapes.size(); ++k) {
            const ggml_tensor * pool = hi.tensor(k);
            ggml_tensor *       x    = ggml_new_tensor_1d(ctx.get(), GGML_TYPE_F32, pool->ne[0]);
            for (int64_t i = 0; i < pool->ne[0]; ++i) {
                ((float *) x->data)[i] = 0.01f * (float) (i % 7);
            }
            for (int64_t e = 0; e < n; ++e) {
                ggml_tensor * w = ggml_view_2d(ctx.get(), (ggml_tensor *) pool, pool->ne[0], pool->ne[1], pool->nb[1],
                                               (size_t) e * pool->nb[2]);
                ggml_build_forward_expand(gf, ggml_mul_mat(ctx.get(), w, x));
            }
        }
        std::vector<int64_t> t;
        for (int rep = 0; rep < 5; ++rep) {
            const int64_t t0 = moetier_time_us();
            ggml_graph_compute_with_ctx(ctx.get(), gf, n_threads);
            t.push_back(moetier_time_us() - t0);
        }
        std::sort(t.begin(), t.end());
        return t[t.size() / 2];
    };
    const int64_t t_one = time_experts(1);
    const int64_t t_all = n_cpu > 1 ? time_experts(n_cpu) : t_one;
    t_cpu.push_back(n_cpu > 1 ? (t_all - t_one) / (n_cpu - 1) : t_one);
    std::sort(t_copy.begin(), t_copy.end());
    std::sort(t_cpu.begin(), t_cpu.end());
    copy_us = std::max(1.0f, (float) t_copy[t_copy.size() / 2]);
    cpu_us  = std::max(1.0f, (float) t_cpu[t_cpu.size() / 2]);
}

void moetier_cache::upload(moetier_layer & layer,
                           const int32_t * ram,
                           int64_t         n_used,
                           int64_t         n_tokens,
                           const int32_t * ram_low,
                           bool            cpu_plane,
                           int32_t *       out,
                           bool            warmup) noexcept {
    moetier_slots &       v        = *vram;
    const moetier_slots & hi       = *sets[MOETIER_PRECISION_HIGH];
    const int32_t         spare    = v.n_slots();  // the first zero expert, n_zero of them
    const int32_t         spare_lo = vram_low ? vram_low->n_slots() : 0;
    const int64_t         n        = n_used * n_tokens;
    v.unpin_all();
    if (vram_low) {
        vram_low->unpin_all();
    }
    if (warmup || failed() || pass.layer != &layer) {
        // nothing to copy from: valid ids, distinct within a token (CUDA's batched paths need both)
        for (int64_t i = 0; i < n; ++i) {
            out[i] = (int32_t) ((i % n_used) % (spare + n_zero));
            if (cpu_plane) {
                out[n + i] = -1;
            } else if (ram_low) {
                out[n + i] = (int32_t) ((i % n_used) % (spare_lo + n_zero));
            }
        }
        return;
    }
    moetier_layer_stats & c    = layer.stats;
    moetier_policy_ctx    pctx = policy_ctx(layer.il);
    pctx.batch                 = n_tokens > 1;
    // per precision: the experts this layer computes in it (pinned in the RAM tier's pool `from`), hits in
    // the VRAM pool `to` first, in expert order as the RAM tier resolves (a copy must not evict an expert
    // this layer uses); the misses into `miss`
    auto hits                  = [&](moetier_slots & to, const moetier_slots & from, std::vector<int32_t> & of,
                    std::vector<int32_t> & miss) {
        std::fill(of.begin(), of.end(), -1);
        miss.clear();
        for (int32_t e = 0; e < n_expert_; ++e) {
            const int32_t rs = need[e] == MOETIER_NEED_NONE ? -1 : from.find(layer.il, e);
            if (rs < 0 || !from.is_pinned(rs)) {
                continue;  // not computed in this precision
            }
            const int32_t s = to.find(layer.il, e);
            pctx.rank       = rank[e];
            if (s >= 0) {
                to.on_hit(s, pctx);
                to.pin(s);
                of[e] = s;
                ++c.n_vram_hits;
            } else {
                miss.push_back(e);
            }
        }
    };
    hits(v, hi, vram_of, missing);
    // cooperative compute, in decode: the most used misses are copied, the others computed on the CPU,
    // the split that makes both take about as long (m misses: k copies, m - k on the CPU)
    int32_t * cpu_out = cpu_plane ? out + n : nullptr;
    size_t    n_copy  = missing.size();
    if (cpu_plane && !missing.empty() && layer.uses) {
        const double m     = (double) missing.size();
        const double kstar = m * cpu_us / (copy_us + cpu_us);
        size_t       best  = 0;
        double       cost  = m * cpu_us;
        for (size_t k : { (size_t) std::floor(kstar), (size_t) std::ceil(kstar) }) {
            k              = std::min(k, missing.size());
            const double c = std::max((double) k * copy_us, (m - (double) k) * cpu_us);
            if (c < cost) {
                cost = c;
                best = k;
            }
        }
        n_copy = best;
        std::stable_sort(missing.begin(), missing.end(), [&](int32_t a, int32_t b) {
            return layer.uses[a].load(std::memory_order_relaxed) > layer.uses[b].load(std::memory_order_relaxed);
        });
    }
    // mixed precision: the experts computed in low precision, from the VRAM tier's low slots
    missing_low.clear();
    if (ram_low) {
        hits(*vram_low, *sets[MOETIER_PRECISION_LOW], vram_low_of, missing_low);
    }
    const bool    any_copy = n_copy > 0 || !missing_low.empty();
    const int64_t t0       = !any_copy || simulate ? 0 : moetier_time_us();
    uint64_t      bytes    = 0;
    if (any_copy && consumed_set) {
        // the copy stream waits for the last graph another context computed here (the host does not)
        ggml_backend_event_wait(vram_backend.get(), vram_consumed);
    }
    for (size_t i = n_copy; i < missing.size(); ++i) {
        vram_of[missing[i]] = MOETIER_VRAM_ON_CPU;
        ++c.n_vram_cpu;
    }
    missing.resize(n_copy);
    // copies from the RAM tier's slot of the expert (read and checked by the load op) into a VRAM slot
    auto copy = [&](moetier_slots & to, const moetier_slots & from, moetier_precision prec, int32_t e) {
        pctx.rank        = rank[e];
        const int32_t s  = to.take({ layer.il, e }, pctx);
        const int32_t rs = from.find(layer.il, e);
        // the tier holds at least one layer's experts and pins only this layer's
        GGML_ASSERT(s >= 0 && "VRAM tier: no unpinned slot");
        for (size_t k = 0; k < shapes.size() && simulate; ++k) {
            bytes += shapes[k].expert_bytes(prec);
        }
        for (size_t k = 0; k < shapes.size() && !simulate; ++k) {
            const ggml_tensor * src = from.tensor(k);
            ggml_tensor *       dst = to.tensor(k);
            ggml_backend_tensor_set_async(vram_backend.get(), dst, (const char *) src->data + (size_t) rs * src->nb[2],
                                          (size_t) s * dst->nb[2], dst->nb[2]);
            bytes += dst->nb[2];
        }
        to.pin(s);
        ++c.n_vram_copies;
        return s;
    };
    for (const int32_t e : missing) {
        vram_of[e] = copy(v, hi, MOETIER_PRECISION_HIGH, e);
    }
    for (const int32_t e : missing_low) {
        vram_low_of[e] = copy(*vram_low, *sets[MOETIER_PRECISION_LOW], MOETIER_PRECISION_LOW, e);
    }
    if (any_copy) {
        if (!simulate && vram_event && vram_compute) {
            // the compute stream waits for the copies, this thread does not (vram_copy_us: issuing them)
            ggml_backend_event_record(vram_event, vram_backend.get());
            ggml_backend_event_wait(vram_compute, vram_event);
            copies_pending = true;
            c.vram_copy_us += (uint64_t) (moetier_time_us() - t0);
        } else if (!simulate) {
            ggml_backend_synchronize(vram_backend.get());
            c.vram_copy_us += (uint64_t) (moetier_time_us() - t0);
        }
        c.n_vram_bytes += bytes;
    }
    for (int64_t i = 0; i < n; ++i) {
        const int32_t rs = ram[i];
        const int32_t s  = rs >= 0 ? vram_of[hi.key(rs).expert] : -1;
        out[i]           = s >= 0 ? s : spare + (int32_t) (i % n_used) % n_zero;
        if (cpu_out) {
            cpu_out[i] = s == MOETIER_VRAM_ON_CPU ? rs : -1;
        } else if (ram_low) {
            const int32_t rl = ram_low[i];
            const int32_t sl = rl >= 0 ? vram_low_of[sets[MOETIER_PRECISION_LOW]->key(rl).expert] : -1;
            out[n + i]       = sl >= 0 ? sl : spare_lo + (int32_t) (i % n_used) % n_zero;
        }
    }
}

void moetier_cache::set_error(const moetier_error & err) noexcept {
    n_read_errors_.fetch_add(1, std::memory_order_relaxed);
    try {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (error_.msg.empty()) {
            error_ = err;
            MOETIER_LOG_ERROR("moetier: expert read failed: %s\n", err.msg.c_str());
        }
    } catch (...) {
    }
    has_error.store(true, std::memory_order_relaxed);
}

moetier_error moetier_cache::error() const {
    std::lock_guard<std::mutex> lock(error_mutex);
    return error_;
}

void moetier_cache::clear_error() {
    std::lock_guard<std::mutex> lock(error_mutex);
    error_ = {};
    has_error.store(false, std::memory_order_relaxed);
}

void moetier_cache::reset_sequence() {
    // a new sequence skips a pass number: the time between the last sequence's step and the next
    // one's is not a step's (the prefetch gate times consecutive passes only)
    ++n_pass;
    seq_tick                   = tick;
    seq_pass                   = n_pass + 1;
    last_layer                 = INT32_MAX;  // the next resolve starts a forward pass
    const moetier_policy_ctx c = policy_ctx(0);
    for (auto & set : sets) {
        set->reset_sequence(c);
    }
}

void moetier_cache::set_elastic(std::shared_ptr<moetier_elastic> e, uint64_t reserve) {
    moetier_slots & hi = *sets[MOETIER_PRECISION_HIGH];
    GGML_ASSERT(hi.elastic() && !simulate && !vram && !elastic);
    elastic      = std::move(e);
    elastic_pool = elastic->add_pool(hi.slot_bytes() * (uint64_t) hi.n_capacity(), reserve);
}

void moetier_cache::apply_elastic(const moetier_layer & layer, const moetier_policy_ctx & ctx) noexcept {
    moetier_slots & hi    = *sets[MOETIER_PRECISION_HIGH];
    const uint64_t  bytes = hi.slot_bytes();
    const int64_t   d     = elastic->poll(elastic_pool, (uint64_t) hi.n_untouched() * bytes, ggml_time_us());
    if (d >= (int64_t) bytes) {
        const int32_t n = hi.grow((int32_t) std::min<int64_t>(d / (int64_t) bytes, hi.n_capacity()));
        if (n > 0) {
            grown.fetch_add(n, std::memory_order_relaxed);
            MOETIER_LOG_INFO("moetier: expert cache grows into free memory: +%d slots (%s), %d in use\n", n,
                             moetier_format_bytes((uint64_t) n * bytes).c_str(), hi.n_slots());
        }
    } else if (d < 0) {
        // this layer's hits are pinned first: what shrinking evicts must not be what the layer uses now
        for (int32_t e = 0; e < n_expert_; ++e) {
            const int32_t s = need[e] != MOETIER_NEED_NONE ? hi.find(layer.il, e) : -1;
            if (s >= 0) {
                hi.pin(s);
            }
        }
        const int32_t n = hi.shrink(
            (int32_t) std::min<int64_t>((-d + (int64_t) bytes - 1) / (int64_t) bytes, hi.n_capacity()), n_expert_, ctx);
        if (n > 0) {
            shrunk.fetch_add(n, std::memory_order_relaxed);
            MOETIER_LOG_INFO("moetier: expert cache gives memory back: -%d slots (%s), %d in use\n", n,
                             moetier_format_bytes((uint64_t) n * bytes).c_str(), hi.n_slots());
        }
    }
}

moetier_policy_ctx moetier_cache::policy_ctx(int32_t layer) const {
    moetier_policy_ctx c;
    c.tick     = tick;
    c.seq_tick = seq_tick;
    c.pass     = n_pass;
    c.steps    = n_pass >= seq_pass ? n_pass - seq_pass + 1 : 1;
    c.layer    = layer;
    c.n_layers = n_model_layers;
    return c;
}

void moetier_cache::add_prefetch_stats(moetier_prefetch_stats & out) const {
    if (prefetcher) {
        prefetcher->add_stats(out);
    }
}

void moetier_cache::reset_prefetch_stats() {
    if (prefetcher) {
        prefetcher->reset_stats();
    }
}

int32_t moetier_cache::warm_take(const moetier_layer & layer, int32_t e) {
    moetier_slots & hi = *sets[MOETIER_PRECISION_HIGH];
    if (warm_entry.empty()) {
        warm_entry.assign(hi.n_capacity(), -1);
    }
    if (n_warm + n_expert_ >= hi.n_slots() || hi.find(layer.il, e) >= 0) {
        return -1;
    }
    const int32_t s = hi.take({ layer.il, e }, policy_ctx(layer.il));
    if (s >= 0) {
        hi.hold(s, true);
        ++n_warm;
    }
    return s;
}

void moetier_cache::warm_attach(const moetier_warm * w, int32_t s, int32_t i) {
    warm          = w;
    warm_entry[s] = i;
}

void moetier_cache::settle_warm() noexcept {
    if (n_warm == 0) {
        return;
    }
    moetier_slots & hi = *sets[MOETIER_PRECISION_HIGH];
    for (int32_t s = 0; s < (int32_t) warm_entry.size(); ++s) {
        const int32_t i = warm_entry[s];
        if (i < 0 || !warm->finished(i)) {
            continue;
        }
        hi.hold(s, false);
        if (warm->failed(i)) {
            hi.drop(s);
        }
        warm_entry[s] = -1;
        --n_warm;
    }
}

void moetier_cache::wait_warm_all() noexcept {
    for (const int32_t i : warm_entry) {
        if (i >= 0) {
            warm->wait(i);
        }
    }
    settle_warm();
}

void moetier_cache::end_warm() noexcept {
    moetier_slots & hi = *sets[MOETIER_PRECISION_HIGH];
    for (int32_t s = 0; s < (int32_t) warm_entry.size() && n_warm > 0; ++s) {
        const int32_t i = warm_entry[s];
        if (i < 0) {
            continue;
        }
        hi.hold(s, false);
        if (!warm->finished(i) || warm->failed(i)) {
            hi.drop(s);
        }
        warm_entry[s] = -1;
        --n_warm;
    }
}

bool moetier_cache::claim_warm(int32_t s) noexcept {
    const int32_t i  = warm_entry[s];
    const bool    ok = warm->wait(i);
    sets[MOETIER_PRECISION_HIGH]->hold(s, false);
    warm_entry[s] = -1;
    --n_warm;
    return ok;
}

void moetier_cache::sync() noexcept {
    finish(pass);
}

void moetier_cache::finish(moetier_pass & p) noexcept {
    if (copies_pending) {
        // the pass's RAM slots may be evicted and read into next: its copies must have left them
        ggml_backend_event_synchronize(vram_event);
        copies_pending = false;
    }
    if (p.layer == nullptr) {
        return;
    }
    const int64_t t_begin = p.t_load_begin_us.load(std::memory_order_relaxed);
    const int64_t t_end   = p.t_load_end_us.load(std::memory_order_relaxed);
    if (t_begin > 0 && t_end > t_begin) {
        p.layer->stats.read_us += (uint64_t) (t_end - t_begin);
    }
    const bool aborted = !p.loaded && !simulate;
    for (int32_t i = 0; i < p.n_tasks; ++i) {
        moetier_pass::task & t = p.tasks[i];
        if (aborted) {
            // the graph stopped before the load op (a failed read aborts it): nothing of this pass
            // was read, or read and checked; a ring read must end before the slot is reused
            if (t.io_id >= 0 && !io->claim(t.io_id)) {
                io->wait(t.io_id);
                io->release(t.io_id);
            }
            t.failed = true;
        }
        t.io_id = -1;
        if (t.failed) {
            // the slot holds garbage: forget it, so the expert is read again next time
            sets[t.read.prec]->drop(t.read.slot);
            t.failed = false;
        }
    }
    for (auto & w : p.waits) {
        if (w.id >= 0) {
            // the graph stopped before the load op waited: the read must end before the slot is reused
            w.failed = io->wait(w.id) == MOETIER_IO_FAILED;
            io->release(w.id);
        }
        if (w.failed) {
            sets[w.prec]->drop(w.slot);
        }
    }
    for (int32_t k = 0; k < p.n_checks; ++k) {
        // a slot whose check the load op never reached stays unchecked: the next layer to use it checks it
        const moetier_pass::check & c  = p.checks[k];
        const uint8_t               st = p.check_states[k].load(std::memory_order_relaxed);
        if (st == moetier_pass::CHECK_OK) {
            sets[c.prec]->set_unchecked(c.slot, false);
        } else if (st == moetier_pass::CHECK_FAILED) {
            sets[c.prec]->drop(c.slot);
        }
    }
    p.waits.clear();
    p.n_tasks  = 0;
    p.n_checks = 0;
    p.n_checks_taken.store(0, std::memory_order_relaxed);
    p.n_checks_done.store(0, std::memory_order_relaxed);
    p.layer = nullptr;
}

int32_t moetier_cache::add_check(moetier_pass &    p,
                                 moetier_precision prec,
                                 int32_t           s,
                                 bool              read,
                                 int32_t           io_id) noexcept {
    if (!sets[prec]->is_unchecked(s)) {
        return -1;
    }
    const int32_t k = p.n_checks++;
    GGML_ASSERT(k < (int32_t) p.checks.size());
    p.checks[k] = { prec, s, sets[prec]->key(s).expert, read ? -1 : io_id };
    p.check_states[k].store(read ? moetier_pass::CHECK_READ : moetier_pass::CHECK_READING, std::memory_order_relaxed);
    return k;
}

void moetier_cache::end_check_read(moetier_pass & p, int32_t k, bool ok, bool settled) noexcept {
    if (k < 0) {
        return;
    }
    if (ok) {
        // a thread that saw the read land may have taken it already
        uint8_t st = moetier_pass::CHECK_READING;
        p.check_states[k].compare_exchange_strong(st, moetier_pass::CHECK_READ, std::memory_order_release);
        return;
    }
    p.n_checks_taken.fetch_add(1, std::memory_order_relaxed);
    p.check_states[k].store(settled ? moetier_pass::CHECK_OK : moetier_pass::CHECK_FAILED, std::memory_order_release);
    p.n_checks_done.fetch_add(1, std::memory_order_release);
}

void moetier_cache::gather_aheads(moetier_pass & p, const moetier_layer & layer) noexcept {
    p.aheads.clear();
    p.reads_waited.store(false, std::memory_order_relaxed);
    // only where the load op will wait for reads (its idle time), on the ring (whose reads are the
    // unchecked ones)
    if (!prefetcher || io == nullptr || !io->uses_uring() || (p.n_tasks == 0 && p.waits.empty())) {
        p.n_ahead_open.store(0, std::memory_order_relaxed);
        return;
    }
    prefetcher->landing(layer, p.aheads);  // at most the list's capacity (ahead_states' size)
    for (size_t k = 0; k < p.aheads.size(); ++k) {
        p.ahead_states[k].store(moetier_pass::AHEAD_OPEN, std::memory_order_relaxed);
    }
    p.n_ahead_open.store((int32_t) p.aheads.size(), std::memory_order_relaxed);
}

bool moetier_cache::check_ahead(moetier_pass & p, int ith) noexcept {
    // busy is raised before reads_waited is read, and thread 0 sets reads_waited before it waits
    // for busy to fall (both sequentially consistent): no thread starts a check thread 0 misses
    p.n_ahead_busy.fetch_add(1);
    bool          took = false;
    const int32_t n    = p.reads_waited.load() ? 0 : (int32_t) p.aheads.size();
    for (int32_t j = 0; j < n && !took && !p.reads_waited.load(std::memory_order_relaxed); ++j) {
        const int32_t k  = (j + ith) % n;
        uint8_t       st = moetier_pass::AHEAD_OPEN;
        if (p.ahead_states[k].load(std::memory_order_relaxed) != st || !io->landed(p.aheads[k].io_id) ||
            !p.ahead_states[k].compare_exchange_strong(st, moetier_pass::AHEAD_BUSY, std::memory_order_acquire)) {
            continue;
        }
        p.n_ahead_open.fetch_sub(1, std::memory_order_relaxed);
        const moetier_landing & a = p.aheads[k];
        moetier_error           err;
        const bool              ok = moetier_read_verify(*a.layer, a.prec, a.expert, a.slot, bounce[ith], err);
        p.ahead_states[k].store(ok ? moetier_pass::AHEAD_OK : moetier_pass::AHEAD_LEFT, std::memory_order_release);
        took = true;
    }
    p.n_ahead_busy.fetch_sub(1);
    return took;
}

void moetier_cache::run_checks(moetier_pass & p, int ith) noexcept {
    const int32_t n    = p.n_checks;
    int32_t       idle = 0;
    // the others also stay while thread 0 waits and a landed prefetch of the next layers may come
    while (p.n_checks_taken.load(std::memory_order_acquire) < n ||
           (ith != 0 && !p.reads_waited.load(std::memory_order_relaxed) &&
            p.n_ahead_open.load(std::memory_order_relaxed) > 0)) {
        bool took = false;
        for (int32_t j = 0; j < n; ++j) {
            const int32_t k  = (j + ith) % n;  // the threads start apart: fewer fights over one entry
            uint8_t       st = p.check_states[k].load(std::memory_order_relaxed);
            // READ, or still READING for thread 0 (which may be waiting on another read) but landed
            const bool    ready =
                st == moetier_pass::CHECK_READ ||
                (st == moetier_pass::CHECK_READING && p.checks[k].io_id >= 0 && io->landed(p.checks[k].io_id));
            if (!ready ||
                !p.check_states[k].compare_exchange_strong(st, moetier_pass::CHECK_BUSY, std::memory_order_acquire)) {
                continue;
            }
            p.n_checks_taken.fetch_add(1, std::memory_order_relaxed);
            took                          = true;
            const moetier_pass::check & c = p.checks[k];
            moetier_error               err;
            // a mismatch is read again: bits flipped on the way read right the second time
            const bool ok = moetier_read_verify(*p.layer, c.prec, c.expert, c.slot, bounce[ith], err) ||
                            read_again(*p.layer, c.prec, c.expert, c.slot, bounce[ith]);
            p.check_states[k].store(ok ? moetier_pass::CHECK_OK : moetier_pass::CHECK_FAILED,
                                    std::memory_order_release);
            p.n_checks_done.fetch_add(1, std::memory_order_release);
        }
        if (!took && ith != 0) {
            took = check_ahead(p, ith);
        }
        idle = took ? 0 : idle + 1;
        moetier_relax(idle);
    }
    if (ith == 0) {
        // the abort callback runs on thread 0 right after this op: a failed check must be known
        // by then, so that no matmul runs on the slot (the others may still be checking)
        while (p.n_checks_done.load(std::memory_order_acquire) < n) {
            moetier_relax(++idle);
        }
        // the next layers' checks done meanwhile (none starts now: reads_waited is set)
        while (p.n_ahead_busy.load() > 0) {
            moetier_relax(++idle);
        }
        for (size_t k = 0; k < p.aheads.size(); ++k) {
            if (p.ahead_states[k].load(std::memory_order_acquire) == moetier_pass::AHEAD_OK) {
                sets[p.aheads[k].prec]->set_unchecked(p.aheads[k].slot, false);
            }
        }
    }
}

bool moetier_cache::queue_load(moetier_pass &             p,
                               moetier_layer &            layer,
                               moetier_precision          prec,
                               int32_t                    e,
                               const moetier_policy_ctx & ctx) noexcept {
    const int32_t s = sets[prec]->take({ layer.il, e }, ctx);
    if (s < 0) {
        return false;
    }
    queue_read(p, layer, prec, e, s);
    return true;
}

void moetier_cache::queue_read(moetier_pass &    p,
                               moetier_layer &   layer,
                               moetier_precision prec,
                               int32_t           e,
                               int32_t           s) noexcept {
    sets[prec]->pin(s);
    // a read per projection lets the compute threads share an expert's reads; on the ring an
    // expert is one task (a GGUF's projections its parts)
    const bool    whole   = moetier_read_parts(layer, prec) == 1 || (io != nullptr && io->uses_uring());
    const int32_t n_parts = whole ? 1 : moetier_read_parts(layer, prec);
    for (int32_t k = 0; k < n_parts; ++k) {
        moetier_pass::task & t = p.tasks[p.n_tasks++];
        t.read.layer           = &layer;
        t.read.proj            = whole ? MOETIER_READ_ALL : k;
        t.read.prec            = prec;
        t.read.expert          = e;
        t.read.slot            = s;
        t.io_id                = -1;
        t.failed               = false;
        t.check                = -1;
    }
    const uint64_t bytes = moetier_read_bytes(layer, prec);
    layer.stats.n_bytes_read += bytes;
    if (prec == MOETIER_PRECISION_LOW) {
        layer.stats.n_bytes_low += bytes;
    }
}

void moetier_cache::resolve(moetier_layer & layer,
                            const int32_t * ids,
                            const float *   weights,
                            int64_t         n_used,
                            int64_t         n_tokens,
                            size_t          ids_nb1,
                            size_t          w_nb1,
                            int32_t *       out,
                            bool            warmup) noexcept {
    finish(pass);
    ++tick;
    if (layer.il <= last_layer) {
        ++n_pass;
    }
    last_layer = layer.il;
    if (prefetcher) {
        prefetcher->begin(layer, ids, n_used, n_tokens == 1 && !warmup, n_pass);
    }
    settle_warm();

    // the previous layer of this group is done: its slots may be evicted again
    moetier_slots & hi = *sets[MOETIER_PRECISION_HIGH];
    moetier_slots & lo = *sets[MOETIER_PRECISION_LOW];
    hi.unpin_all();
    lo.unpin_all();

    moetier_pass & p = pass;
    p.layer          = &layer;
    p.n_used         = (int32_t) n_used;
    p.loaded         = false;
    p.t_load_begin_us.store(0, std::memory_order_relaxed);
    p.t_load_end_us.store(0, std::memory_order_relaxed);

    // what the ubatch needs of each expert: the most any of its tokens needs
    needs_k.resize(n_used);
    std::fill(need.begin(), need.end(), MOETIER_NEED_NONE);
    for (int64_t t = 0; t < n_tokens; ++t) {
        const int32_t * row = (const int32_t *) ((const char *) ids + t * ids_nb1);
        const float *   w   = weights ? (const float *) ((const char *) weights + t * w_nb1) : nullptr;
        moetier_precision_needs(rule, w, (int32_t) n_used, needs_k.data());
        for (int64_t k = 0; k < n_used; ++k) {
            const int32_t e = row[k];
            GGML_ASSERT(e >= 0 && e < n_expert_);
            need[e] = std::max(need[e], needs_k[k]);
        }
    }

    // each needed expert's rank by gate weight at the last token (n_used: only earlier tokens route it),
    // for the policies that learn from it (reuse-rank)
    rank.assign(n_expert_, (int32_t) n_used);
    if (n_tokens > 0) {
        const int32_t * row = (const int32_t *) ((const char *) ids + (n_tokens - 1) * ids_nb1);
        const float *   w   = weights ? (const float *) ((const char *) weights + (n_tokens - 1) * w_nb1) : nullptr;
        for (int64_t k = 0; k < n_used; ++k) {
            int32_t r = (int32_t) k;  // no weights: the router's order
            if (w) {
                r = 0;
                for (int64_t j = 0; j < n_used; ++j) {
                    r += w[j] > w[k] || (w[j] == w[k] && j < k);
                }
            }
            rank[row[k]] = r;
        }
    }
    moetier_policy_ctx pctx = policy_ctx(layer.il);
    pctx.batch              = n_tokens > 1;
    missing.clear();
    if (elastic != nullptr && !warmup) {
        apply_elastic(layer, pctx);
    }

    moetier_layer_stats & c = layer.stats;
    for (int32_t e = 0; e < n_expert_; ++e) {
        if (need[e] == MOETIER_NEED_NONE) {
            continue;
        }
        pctx.rank = rank[e];
        if (!warmup && layer.uses) {
            layer.uses[e].fetch_add(1, std::memory_order_relaxed);
            layer.last_use[e].store(tick, std::memory_order_relaxed);
        }
        moetier_precision prec = MOETIER_PRECISION_HIGH;
        int32_t           s    = -1;
        if (moetier_slots_find_version(hi, lo, layer.il, e, need[e], prec, s)) {
            if (prec == MOETIER_PRECISION_HIGH && n_warm > 0 && warm_entry[s] >= 0) {
                if (warmup) {
                    continue;  // still being read: warmup computes nothing with it
                }
                if (!claim_warm(s)) {
                    // the warm read failed: read it now, into the same slot
                    ++c.n_lookups;
                    ++c.n_misses;
                    ++c.n_loads_high;
                    queue_read(p, layer, prec, e, s);
                    continue;
                }
            }
            moetier_slots & set = *sets[prec];
            set.on_hit(s, pctx);
            ++c.n_lookups;
            int32_t                    id  = -1;
            const moetier_prefetch_use use = prefetcher ? prefetcher->use(prec, s, &id) : MOETIER_PREFETCH_USE_READY;
            if (use != MOETIER_PREFETCH_USE_READ) {
                ++c.n_hits;
                c.n_hits_low += prec == MOETIER_PRECISION_LOW;
                set.pin(s);
                if (use == MOETIER_PREFETCH_USE_WAIT) {
                    p.waits.push_back({ id, prec, s, false, add_check(p, prec, s, /*read=*/false, id) });
                } else {
                    add_check(p, prec, s, /*read=*/true);
                }
            } else {
                // its prefetch had not started (or failed): read now, ahead of the queue
                ++c.n_misses;
                (prec == MOETIER_PRECISION_HIGH ? c.n_loads_high : c.n_loads_low) += 1;
                queue_read(p, layer, prec, e, s);
            }
        } else if (warmup) {
            // warmup runs every expert through the graph once; reading them all would defeat the cache
            continue;
        } else if (need[e] == MOETIER_NEED_SKIP) {
            ++c.n_lookups;
            ++c.n_misses;
            ++c.n_skipped;
        } else {
            missing.push_back(e);
        }
    }
    // the misses take slots once every hit is pinned: a miss must not evict an expert this layer uses
    for (const int32_t e : missing) {
        // a high need with only the low version cached reads the high version: the rule asked for it
        pctx.rank = rank[e];
        ++c.n_lookups;
        ++c.n_misses;
        if (need[e] == MOETIER_NEED_LOW && lo.n_slots() > 0 && queue_load(p, layer, MOETIER_PRECISION_LOW, e, pctx)) {
            ++c.n_loads_low;
        } else {
            bool ok = queue_load(p, layer, MOETIER_PRECISION_HIGH, e, pctx);
            if (!ok && n_warm > 0) {
                // the warm start holds the slots (with prefetch holding others): its reads end
                // soon, in layer order; wait for them, then the slots are ordinary again
                wait_warm_all();
                ok = queue_load(p, layer, MOETIER_PRECISION_HIGH, e, pctx);
            }
            GGML_ASSERT(ok && "expert cache: no unpinned slot; the pool is smaller than one layer's experts");
            ++c.n_loads_high;
        }
    }

    if (prefetcher) {
        prefetcher->settle(layer);
    }
    start_reads(p);
    // the next layers' reads are known after the prefetch op (which gathers them); none until then
    p.aheads.clear();
    p.n_ahead_open.store(0, std::memory_order_relaxed);
    p.reads_waited.store(false, std::memory_order_relaxed);

    const int64_t n   = n_used * n_tokens;
    const bool    two = lo.n_slots() > 0;
    for (int64_t t = 0; t < n_tokens; ++t) {
        const int32_t * row = (const int32_t *) ((const char *) ids + t * ids_nb1);
        for (int64_t k = 0; k < n_used; ++k) {
            const int32_t e      = row[k];
            const int32_t hs     = hi.find(layer.il, e);
            const int32_t ls     = lo.find(layer.il, e);
            const bool    use_hi = hs >= 0 && hi.is_pinned(hs);
            const bool    use_lo = !use_hi && ls >= 0 && lo.is_pinned(ls);
            out[t * n_used + k]  = use_hi ? hs : -1;
            if (two) {
                out[n + t * n_used + k] = use_lo ? ls : -1;
            }
        }
    }
}

void moetier_cache::start_reads(moetier_pass & p) noexcept {
    // With io_uring the kernel starts this layer's reads now, while the compute threads run the
    // nodes that do not need them. I/O threads are not handed on-demand reads: on 2 cores each of
    // their wakeups preempts a compute thread that the other one then waits for at a barrier
    // (measured: 30-40% slower decode than reading on the compute threads).
    if (io == nullptr || simulate || !io->uses_uring()) {
        return;
    }
    for (int32_t i = 0; i < p.n_tasks; ++i) {
        moetier_pass::task & t = p.tasks[i];
        moetier_io_task      task;
        task.layer  = t.read.layer;
        task.prec   = t.read.prec;
        task.expert = t.read.expert;
        task.slot   = t.read.slot;
        task.proj   = t.read.proj;
        t.io_id     = io->submit(task, /*is_urgent =*/true);
        // a ring read is checked by the load op; without one (no free entry) the load op reads
        // the slot itself and checks it there
        sets[t.read.prec]->set_unchecked(t.read.slot, t.io_id >= 0 && moetier_read_checked(*t.read.layer, t.read.prec));
        t.check = add_check(p, t.read.prec, t.read.slot, /*read=*/false, t.io_id);
    }
}

void moetier_cache::load(const moetier_layer & layer, int ith, int nth) noexcept {
    moetier_pass & p = pass;
    if (p.layer != &layer || (p.n_tasks == 0 && p.waits.empty() && p.n_checks == 0)) {
        return;
    }
    GGML_ASSERT(ith < MOETIER_MAX_THREADS);
    if (ith == 0) {
        p.t_load_begin_us.store(moetier_time_us(), std::memory_order_relaxed);
    }
    moetier_aligned_buffer & bb = bounce[ith];
    moetier_error            err;
    if (io && io->uses_uring()) {
        // the kernel reads: thread 0 waits for the completions; every thread checks what has
        // arrived (the others from the start, thread 0 once it waited for everything)
        if (ith == 0) {
            for (int32_t i = 0; i < p.n_tasks; ++i) {
                moetier_pass::task & t = p.tasks[i];
                if (t.io_id < 0) {
                    if (!read_sync(t.read, bb, err)) {  // the pool had no free task entry
                        t.failed = true;
                        set_error(err);
                    }
                    continue;
                }
                const bool failed = !wait_io(t.io_id);
                // again, synchronously (a short or refused ring read; each read of it gets a second
                // try there, so a bad store is read up to three times and fails with the file named)
                n_read_retries_.fetch_add(failed ? 1 : 0, std::memory_order_relaxed);
                if (failed && !read_sync(t.read, bb, err)) {
                    t.failed = true;
                    set_error(err);
                }
                end_check_read(p, t.check, !failed, !t.failed);
            }
            wait_prefetched(p);
            p.loaded = true;
            p.reads_waited.store(true);
        }
        run_checks(p, ith);
    } else {
        // the compute threads read, each its share
        for (int32_t i = ith; i < p.n_tasks; i += nth) {
            moetier_pass::task & t = p.tasks[i];
            if (!read_sync(t.read, bb, err)) {
                t.failed = true;
                set_error(err);
            }
        }
        if (ith == 0) {
            wait_prefetched(p);
            p.loaded = true;
        }
    }
    const int64_t now  = moetier_time_us();
    int64_t       prev = p.t_load_end_us.load(std::memory_order_relaxed);
    while (now > prev && !p.t_load_end_us.compare_exchange_weak(prev, now, std::memory_order_relaxed)) {
    }
}

bool moetier_cache::wait_io(int32_t id) noexcept {
    const int32_t st = io->wait(id);
    if (st == MOETIER_IO_QUEUED) {
        // the ring could not start it (an error of the ring itself): taken back from the queue, so
        // that nothing reads into its slot later
        io->claim(id);
        return false;
    }
    io->release(id);
    return st == MOETIER_IO_DONE;
}

bool moetier_cache::read_sync(const moetier_read & r, moetier_aligned_buffer & bb, moetier_error & err) noexcept {
    // a failed read is tried once more: a transient fault (EIO from a flaky card, bits flipped on the
    // way) reads right the second time; a damaged store fails again. A GGUF's expert is a read per
    // projection, each with its own second try.
    const moetier_layer & l     = *r.layer;
    const bool            split = r.proj == MOETIER_READ_ALL && l.file_order[r.prec].empty();
    moetier_read          one   = r;
    for (int32_t k = 0; k < (split ? (int32_t) l.projs.size() : 1); ++k) {
        one.proj = split ? k : r.proj;
        if (!moetier_read_run(one, bb, err) &&
            (n_read_retries_.fetch_add(1, std::memory_order_relaxed), !moetier_read_run(one, bb, err))) {
            return false;
        }
    }
    return true;
}

bool moetier_cache::read_again(const moetier_layer &    layer,
                               moetier_precision        prec,
                               int32_t                  e,
                               int32_t                  s,
                               moetier_aligned_buffer & bb) noexcept {
    n_read_retries_.fetch_add(1, std::memory_order_relaxed);
    moetier_error err;
    moetier_read  r;
    r.layer  = &layer;
    r.prec   = prec;
    r.expert = e;
    r.slot   = s;
    if (read_sync(r, bb, err)) {
        return true;
    }
    set_error(err);
    return false;
}

void moetier_cache::wait_prefetched(moetier_pass & p) noexcept {
    // prefetches of experts this layer needs that were still being read; a failed one is read again
    // here, synchronously, before the layer uses it
    for (auto & w : p.waits) {
        const bool failed = !wait_io(w.id);
        w.id              = -1;
        if (!failed) {
            end_check_read(p, w.check, true, true);
            continue;
        }
        w.failed = !read_again(*p.layer, w.prec, sets[w.prec]->key(w.slot).expert, w.slot, bounce[0]);
        end_check_read(p, w.check, false, !w.failed);
    }
}

void moetier_cache::prefetch(const moetier_layer & layer, const float * logits, int64_t n_tokens, size_t nb1) noexcept {
    if (!prefetcher || io == nullptr) {
        return;
    }
    prefetcher->predict(layer, logits, n_tokens, nb1, pass.n_used, policy_ctx(layer.il));
    if (pass.layer == &layer) {
        gather_aheads(pass, layer);  // the reads just started for the next layers land while this one waits
    }
}
