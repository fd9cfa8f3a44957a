#include "moetier-cache.h"

#include "moetier-impl.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <stdexcept>

// upper bound on compute threads that may run the load op; bounce buffers are per thread index
static constexpr int MOETIER_MAX_THREADS = 512;

void moetier_precision_scores(const float * weights, int32_t n_used, float * scores) {
    // n_used is small (<= 64 in practice): an insertion sort of indices by weight, descending
    int32_t order[256];
    const int32_t n = std::min<int32_t>(n_used, 256);
    double sum = 0.0;
    for (int32_t k = 0; k < n; ++k) {
        sum += std::fabs(weights[k]);
        int32_t j = k;
        while (j > 0 && std::fabs(weights[order[j - 1]]) < std::fabs(weights[k])) {
            order[j] = order[j - 1];
            --j;
        }
        order[j] = k;
    }
    std::fill(scores, scores + n_used, 0.0f);
    if (!(sum > 0.0)) {
        return;
    }
    double above = 0.0; // normalised weight of the experts ranked above
    for (int32_t i = 0; i < n; ++i) {
        scores[order[i]] = (float) above;
        above += std::fabs(weights[order[i]]) / sum;
    }
}

void moetier_precision_levels(const moetier_precision & rule, const float * weights, int32_t n_used, uint8_t * levels) {
    if (weights == nullptr || (rule.t1 >= 1.0f && rule.t2 >= 1.0f)) {
        std::fill(levels, levels + n_used, 2);
        return;
    }
    float scores[256];
    const int32_t n = std::min<int32_t>(n_used, 256);
    moetier_precision_scores(weights, n, scores);
    std::fill(levels, levels + n_used, 2);
    for (int32_t k = 0; k < n; ++k) {
        // the top-1 scores 0 <= t1: always high
        levels[k] = scores[k] <= rule.t1 ? 2 : scores[k] <= rule.t2 ? 1 : 0;
    }
}

moetier_cache::moetier_cache(int32_t n_expert, const int32_t n_slots[2], const moetier_precision & rule_,
                             const std::string & policy, const moetier_policy_weights & weights,
                             std::vector<moetier_proj> proj_shapes, bool simulate_)
        : n_expert_(n_expert), rule(rule_), simulate(simulate_), shapes(std::move(proj_shapes)) {
    GGML_ASSERT(n_slots[MOETIER_HIGH] >= n_expert && n_expert > 0 && n_slots[MOETIER_LOW] >= 0);
    GGML_ASSERT(n_slots[MOETIER_LOW] == 0 || shapes[0].store != nullptr);

    ggml_init_params ip = {
        /*.mem_size   =*/ ggml_tensor_overhead() * (2 * shapes.size() + 1),
        /*.mem_buffer =*/ nullptr,
        /*.no_alloc   =*/ true,
    };
    ctx = ggml_init(ip);
    if (!ctx) {
        throw std::runtime_error("failed to create the expert cache context");
    }
    init_set(sets[MOETIER_HIGH], MOETIER_HIGH, n_slots[MOETIER_HIGH], policy, weights);
    init_set(sets[MOETIER_LOW],  MOETIER_LOW,  n_slots[MOETIER_LOW],  policy, weights);

    need.assign(n_expert, 0);
    pred_need.assign(n_expert, 0);
    pred_w.assign(n_expert, 0.0f);
    pred_rank.reserve(n_expert);
    tasks.resize((size_t) 2 * n_expert * shapes.size());
    bounce.resize(MOETIER_MAX_THREADS);
}

void moetier_cache::init_set(moetier_pool_set & set, int32_t prec, int32_t n_slots, const std::string & policy,
                             const moetier_policy_weights & weights) {
    set.prec = prec;
    set.policy = moetier_policy_create(policy, weights);
    GGML_ASSERT(set.policy);
    if (n_slots == 0) {
        return;
    }
    uint64_t total = 0;
    for (const auto & p : shapes) {
        set.stride.push_back(moetier_align_up(p.expert_bytes(prec)));
        total += set.stride.back() * (uint64_t) n_slots;
    }
    set.buf_size = total;
    if (simulate) {
        set.buf_size = 0;
        init_slots(set, n_slots);
        return;
    }
    // not touched here: pages become resident as slots fill (and the memory-fit pass of
    // common_fit_params, which loads the model with no_alloc, costs no RSS)
    set.mem.reserve(set.buf_size);

    set.buf = ggml_backend_cpu_buffer_from_ptr(set.mem.data.get(), set.buf_size);
    if (!set.buf) {
        throw std::runtime_error("failed to create the expert cache buffer");
    }
    ggml_backend_buffer_set_usage(set.buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);

    uint8_t * base = (uint8_t *) set.mem.data.get();
    for (size_t k = 0; k < shapes.size(); ++k) {
        const ggml_tensor * m = shapes[k].meta;
        const ggml_type type = prec == MOETIER_LOW ? shapes[k].store->type_low : m->type;
        ggml_tensor * t = ggml_new_tensor_3d(ctx, type, m->ne[0], m->ne[1], n_slots);
        // slots padded to 4096 so that aligned reads land straight in them [TAG_MOETIER_ALIGN]
        t->nb[2] = set.stride[k];
        t->nb[3] = set.stride[k] * (uint64_t) n_slots;
        ggml_format_name(t, "moetier_pool_%s%s", shapes[k].name.c_str(), prec == MOETIER_LOW ? "_low" : "");
        if (ggml_backend_tensor_alloc(set.buf, t, base) != GGML_STATUS_SUCCESS) {
            throw std::runtime_error("failed to place an expert cache pool");
        }
        base += set.stride[k] * (uint64_t) n_slots;
        set.tensors.push_back(t);
    }

    init_slots(set, n_slots);
}

void moetier_cache::init_slots(moetier_pool_set & set, int32_t n_slots) {
    set.slot_key.assign(n_slots, moetier_key{});
    set.pinned.assign(n_slots, 0);
    set.free_slots.resize(n_slots);
    for (int32_t s = 0; s < n_slots; ++s) {
        set.free_slots[s] = n_slots - 1 - s; // pop_back hands out slot 0 first
    }
    set.mask.assign(n_slots, 0);
    set.pf_task.assign(n_slots, -1);
    set.pf_hold.assign(n_slots, 0);
    set.policy->init(n_slots);
}

moetier_cache::~moetier_cache() {
    if (ctx) {
        ggml_free(ctx);
    }
    for (auto & set : sets) {
        if (set.buf) {
            ggml_backend_buffer_free(set.buf);
        }
    }
}

void moetier_cache::add_layer(moetier_layer * layer) {
    if ((size_t) layer->il >= layers.size()) {
        layers.resize(layer->il + 1, nullptr);
    }
    layers[layer->il] = layer;
    for (auto & set : sets) {
        set.held.resize(layers.size(), 0);
    }
    ++n_layers;
    layer->cache = this;
    layer->slot_of[MOETIER_HIGH].assign(n_expert_, -1);
    layer->slot_of[MOETIER_LOW].assign(n_expert_, -1);
}

uint64_t moetier_cache::slot_bytes(int32_t prec) const {
    uint64_t n = 0;
    for (uint64_t s : sets[prec].stride) {
        n += s;
    }
    return n;
}

void moetier_cache::set_error(const std::string & msg) noexcept {
    try {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (error_msg.empty()) {
            error_msg = msg;
            MOETIER_LOG_ERROR("moetier: expert read failed: %s\n", msg.c_str());
        }
    } catch (...) {
    }
    has_error.store(true, std::memory_order_relaxed);
}

std::string moetier_cache::error() const {
    std::lock_guard<std::mutex> lock(error_mutex);
    return error_msg;
}

void moetier_cache::clear_error() {
    std::lock_guard<std::mutex> lock(error_mutex);
    error_msg.clear();
    has_error.store(false, std::memory_order_relaxed);
}

void moetier_cache::reset_sequence() {
    seq_tick   = tick;
    seq_pass   = pass + 1;
    last_layer = INT32_MAX; // the next resolve starts a forward pass
    const moetier_policy_ctx c = policy_ctx(0);
    for (auto & set : sets) {
        set.policy->reset_sequence(c);
    }
}

moetier_policy_ctx moetier_cache::policy_ctx(int32_t layer) const {
    moetier_policy_ctx c;
    c.tick     = tick;
    c.seq_tick = seq_tick;
    c.pass     = pass;
    c.steps    = pass >= seq_pass ? pass - seq_pass + 1 : 1;
    c.layer    = layer;
    c.n_layers = n_model_layers;
    return c;
}

void moetier_cache::sync() noexcept {
    finish_previous();
}

void moetier_cache::finish_previous() noexcept {
    if (task_layer == nullptr) {
        return;
    }
    const int64_t t_begin = t_load_begin_us.load(std::memory_order_relaxed);
    const int64_t t_end   = t_load_end_us.load(std::memory_order_relaxed);
    if (t_begin > 0 && t_end > t_begin) {
        task_layer->counters.read_us += (uint64_t) (t_end - t_begin);
    }
    for (int32_t i = 0; i < n_tasks; ++i) {
        moetier_read_task & t = tasks[i];
        if (!load_done && !simulate) {
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
            drop_slot(sets[t.prec], t.slot);
            t.failed = false;
        }
    }
    for (auto & w : wait_ids) {
        if (w.id >= 0) {
            // the graph stopped before the load op waited: the read must end before the slot is reused
            w.failed = io->wait(w.id) == MOETIER_IO_FAILED;
            io->release(w.id);
        }
        if (w.failed) {
            drop_slot(sets[w.prec], w.slot);
        }
    }
    wait_ids.clear();
    n_tasks    = 0;
    task_layer = nullptr;
}

void moetier_cache::drop_slot(moetier_pool_set & set, int32_t s) noexcept {
    const moetier_key k = set.slot_key[s];
    moetier_layer * l = k.layer >= 0 && (size_t) k.layer < layers.size() ? layers[k.layer] : nullptr;
    if (l == nullptr || k.expert < 0) {
        return;
    }
    l->slot_of[set.prec][k.expert] = -1;
    --set.held[k.layer];
    set.slot_key[s] = moetier_key{};
    set.free_slots.push_back(s);
}

int32_t moetier_cache::take_slot(moetier_pool_set & set, const moetier_key & key) noexcept {
    int32_t s;
    if (!set.free_slots.empty()) {
        s = set.free_slots.back();
        set.free_slots.pop_back();
    } else {
        // candidates: not pinned by the layer being resolved, not being read by a prefetch, not held
        // for a later layer by a prediction
        const int32_t n_slots = set.n_slots();
        set.cand.assign(set.held.size(), 0);
        int32_t n_cand = 0;
        for (int32_t i = 0; i < n_slots; ++i) {
            set.mask[i] = set.pinned[i] || set.pf_task[i] >= 0 || set.pf_hold[i];
            if (!set.mask[i]) {
                ++n_cand;
                ++set.cand[set.slot_key[i].layer];
            }
        }
        if (n_cand == 0) {
            return -1;
        }
        if (!set.policy->across_layers()) {
            // donor layer: the most slots above the fair share among layers with a candidate
            const double quota = (double) n_slots / std::max(1, n_layers);
            int32_t donor = -1;
            double  best  = 0.0;
            for (int32_t l = 0; l < (int32_t) set.held.size(); ++l) {
                if (set.cand[l] == 0) {
                    continue;
                }
                const double excess = set.held[l] - quota;
                if (donor < 0 || excess > best) {
                    donor = l;
                    best  = excess;
                }
            }
            for (int32_t i = 0; i < n_slots; ++i) {
                set.mask[i] = set.mask[i] || set.slot_key[i].layer != donor;
            }
        }
        s = set.policy->victim(set.mask, policy_ctx(key.layer));
        GGML_ASSERT(s >= 0 && !set.mask[s]);
        const moetier_key old = set.slot_key[s];
        layers[old.layer]->slot_of[set.prec][old.expert] = -1;
        --set.held[old.layer];
    }
    set.slot_key[s] = key;
    ++set.held[key.layer];
    return s;
}

static void moetier_pin(moetier_pool_set & set, int32_t s) {
    if (!set.pinned[s]) {
        set.pinned[s] = 1;
        ++set.n_pinned;
    }
}

bool moetier_cache::queue_load(moetier_layer & layer, int32_t prec, int32_t e) noexcept {
    moetier_pool_set & set = sets[prec];
    const moetier_key key = { layer.il, e };
    const int32_t s = take_slot(set, key);
    if (s < 0) {
        return false;
    }
    layer.slot_of[prec][e] = s;
    set.policy->on_load(s, key, prec == MOETIER_HIGH, policy_ctx(layer.il));
    queue_read(layer, prec, e, s);
    return true;
}

void moetier_cache::queue_read(moetier_layer & layer, int32_t prec, int32_t e, int32_t s) noexcept {
    moetier_pin(sets[prec], s);
    const bool whole = !layer.file_order[prec].empty();
    for (size_t p = 0; p < (whole ? 1 : layer.projs.size()); ++p) {
        moetier_read_task & task = tasks[n_tasks++];
        task.layer  = &layer;
        task.proj   = whole ? -1 : (int32_t) p;
        task.prec   = prec;
        task.expert = e;
        task.slot   = s;
        task.io_id  = -1;
        task.failed = false;
    }
    for (const auto & p : layer.projs) {
        layer.counters.n_bytes_read += p.expert_bytes(prec);
        if (prec == MOETIER_LOW) {
            layer.counters.n_bytes_low += p.expert_bytes(prec);
        }
    }
}

bool moetier_cache::cached_version(const moetier_layer & layer, int32_t e, uint8_t need, int32_t & prec, int32_t & s) noexcept {
    const int32_t hs = layer.slot_of[MOETIER_HIGH][e];
    const int32_t ls = layer.slot_of[MOETIER_LOW][e];
    if (hs >= 0) {
        prec = MOETIER_HIGH;
        s    = hs;
        return true;
    }
    if (need < 3 && ls >= 0) {
        prec = MOETIER_LOW;
        s    = ls;
        return true;
    }
    return false;
}

void moetier_cache::resolve(moetier_layer & layer, const int32_t * ids, const float * weights, int64_t n_used,
                            int64_t n_tokens, size_t ids_nb1, size_t w_nb1, int32_t * out, bool warmup) noexcept {
    finish_previous();
    settle_zombies();
    ++tick;
    if (layer.il <= last_layer) {
        ++pass;
    }
    last_layer  = layer.il;
    n_used_last = (int32_t) n_used;
    if (n_tokens == 1 && !warmup) {
        check_predictions(layer, ids, n_used);
    }

    // the previous layer of this group is done: its slots may be evicted again
    for (auto & set : sets) {
        std::fill(set.pinned.begin(), set.pinned.end(), 0);
        set.n_pinned = 0;
    }

    task_layer = &layer;
    t_resolve_us = moetier_time_us();
    t_load_begin_us.store(0, std::memory_order_relaxed);
    t_load_end_us.store(0, std::memory_order_relaxed);
    load_done = false;

    // what the ubatch needs of each expert: the most any of its tokens needs
    levels.resize(n_used);
    std::fill(need.begin(), need.end(), 0);
    for (int64_t t = 0; t < n_tokens; ++t) {
        const int32_t * row = (const int32_t *) ((const char *) ids + t * ids_nb1);
        const float   * w   = weights ? (const float *) ((const char *) weights + t * w_nb1) : nullptr;
        moetier_precision_levels(rule, w, (int32_t) n_used, levels.data());
        for (int64_t k = 0; k < n_used; ++k) {
            const int32_t e = row[k];
            GGML_ASSERT(e >= 0 && e < n_expert_);
            need[e] = std::max<uint8_t>(need[e], levels[k] + 1);
        }
    }

    moetier_pool_set & hi = sets[MOETIER_HIGH];
    moetier_pool_set & lo = sets[MOETIER_LOW];
    moetier_layer_counters & c = layer.counters;
    for (int32_t e = 0; e < n_expert_; ++e) {
        if (need[e] == 0) {
            continue;
        }
        const moetier_key key = { layer.il, e };
        int32_t prec = MOETIER_HIGH;
        int32_t s    = -1;
        if (cached_version(layer, e, need[e], prec, s)) {
            moetier_pool_set & set = sets[prec];
            set.policy->on_hit(s, key, prec == MOETIER_HIGH, policy_ctx(layer.il));
            ++c.n_lookups;
            if (use_prefetched(layer, prec, e, s)) {
                ++c.n_hits;
                c.n_hits_low += prec == MOETIER_LOW;
                moetier_pin(set, s);
            } else {
                // its prefetch had not started (or failed): read now, ahead of the queue
                ++c.n_misses;
                (prec == MOETIER_HIGH ? c.n_loads_high : c.n_loads_low) += 1;
                queue_read(layer, prec, e, s);
            }
        } else if (warmup) {
            // warmup runs every expert through the graph once; reading them all would defeat the cache
            continue;
        } else if (need[e] == 1) {
            ++c.n_lookups;
            ++c.n_misses;
            ++c.n_skipped;
        } else {
            // a high need with only the low version cached reads the high version: the rule asked for it
            ++c.n_lookups;
            ++c.n_misses;
            if (need[e] == 2 && lo.n_slots() > 0 && queue_load(layer, MOETIER_LOW, e)) {
                ++c.n_loads_low;
            } else {
                const bool ok = queue_load(layer, MOETIER_HIGH, e);
                GGML_ASSERT(ok && "expert cache: no unpinned slot; the pool is smaller than one layer's experts");
                ++c.n_loads_high;
            }
        }
    }

    settle_prefetched(layer);
    start_reads();

    const int64_t n = n_used * n_tokens;
    const bool two = lo.n_slots() > 0;
    for (int64_t t = 0; t < n_tokens; ++t) {
        const int32_t * row = (const int32_t *) ((const char *) ids + t * ids_nb1);
        for (int64_t k = 0; k < n_used; ++k) {
            const int32_t e  = row[k];
            const int32_t hs = layer.slot_of[MOETIER_HIGH][e];
            const int32_t ls = layer.slot_of[MOETIER_LOW][e];
            const bool use_hi = hs >= 0 && hi.pinned[hs];
            const bool use_lo = !use_hi && ls >= 0 && lo.pinned[ls];
            out[t * n_used + k] = use_hi ? hs : -1;
            if (two) {
                out[n + t * n_used + k] = use_lo ? ls : -1;
            }
        }
    }
}

bool moetier_cache::verify(const moetier_proj & p, const moetier_read_task & t, std::string & err) const noexcept {
    if (!p.store) {
        return true;
    }
    const ggml_tensor * pool = p.pool[t.prec];
    const uint8_t * dst = (const uint8_t *) pool->data + (uint64_t) t.slot * pool->nb[2];
    if (moetier_checksum(dst, p.expert_bytes(t.prec)) != p.expert_checksum(t.expert, t.prec)) {
        err = format("%s: checksum mismatch for %s expert %d (%s precision): the store is corrupt; re-run `moetier pack`",
                p.file->path().c_str(), p.meta->name, t.expert, t.prec == MOETIER_LOW ? "low" : "high");
        return false;
    }
    return true;
}

bool moetier_cache::read_task(const moetier_read_task & t, moetier_aligned_buffer & bb, std::string & err) const noexcept {
    const moetier_layer & l = *t.layer;
    if (t.proj < 0) {
        // a store keeps an expert's projections back to back and padded: one vectored O_DIRECT
        // read straight into the slots of the projection pools
        const std::vector<int32_t> & order = l.file_order[t.prec];
        moetier_iovec iov[8];
        const int n = (int) order.size();
        for (int k = 0; k < n; ++k) {
            const moetier_proj & p = l.projs[order[k]];
            const ggml_tensor * pool = p.pool[t.prec];
            iov[k].base = (uint8_t *) pool->data + (uint64_t) t.slot * pool->nb[2];
            iov[k].len  = moetier_align_up(p.expert_bytes(t.prec));
        }
        const moetier_proj & first = l.projs[order[0]];
        bool ok = first.file->readv(iov, n, first.expert_offset(t.expert, t.prec), err);
        for (int k = 0; ok && k < n; ++k) {
            ok = verify(l.projs[order[k]], t, err);
        }
        return ok;
    }
    const moetier_proj & p = l.projs[t.proj];
    const ggml_tensor * pool = p.pool[t.prec];
    const uint64_t bytes = p.expert_bytes(t.prec);
    uint8_t * dst = (uint8_t *) pool->data + (uint64_t) t.slot * pool->nb[2];
    try {
        // one-time growth per thread; bounded by the largest projection
        bb.reserve(std::max<size_t>(2 * MOETIER_ALIGN, moetier_align_up(bytes) + 2 * MOETIER_ALIGN));
    } catch (...) {
        err = "out of memory for the read buffer";
        return false;
    }
    // a store's slices are padded: read whole blocks straight into the slot
    const size_t n = p.store ? (size_t) moetier_align_up(bytes) : (size_t) bytes;
    return p.file->read(dst, p.expert_offset(t.expert, t.prec), n, bb, err) && verify(p, t, err);
}

void moetier_cache::start_reads() noexcept {
    // With io_uring the kernel starts this layer's reads now, while the compute threads run the
    // nodes that do not need them. I/O threads are not handed on-demand reads: on 2 cores each of
    // their wakeups preempts a compute thread that the other one then waits for at a barrier
    // (measured: 30-40% slower decode than reading on the compute threads).
    if (io == nullptr || simulate || !io->uses_uring()) {
        return;
    }
    for (int32_t i = 0; i < n_tasks; ++i) {
        moetier_read_task & t = tasks[i];
        moetier_io_task task;
        task.owner  = this;
        task.layer  = (void *) t.layer;
        task.prec   = t.prec;
        task.expert = t.expert;
        task.slot   = t.slot;
        task.proj   = t.proj;
        t.io_id = io->submit(task, /*is_urgent =*/ true);
    }
}

void moetier_cache::load(int ith, int nth) noexcept {
    if (n_tasks == 0 && wait_ids.empty()) {
        return;
    }
    GGML_ASSERT(ith < MOETIER_MAX_THREADS);
    if (ith == 0) {
        t_load_begin_us.store(moetier_time_us(), std::memory_order_relaxed);
    }
    moetier_aligned_buffer & bb = bounce[ith];
    std::string err;
    if (io && io->uses_uring()) {
        // the kernel reads: thread 0 waits for the completions (and checks them); the others have
        // nothing to do, and spinning at the barrier takes no core a read needs
        if (ith == 0) {
            for (int32_t i = 0; i < n_tasks; ++i) {
                moetier_read_task & t = tasks[i];
                if (t.io_id < 0) {
                    if (!read_task(t, bb, err)) { // the ring was full
                        t.failed = true;
                        set_error(err);
                    }
                    continue;
                }
                const bool failed = io->wait(t.io_id) == MOETIER_IO_FAILED;
                io->release(t.io_id);
                // once more, synchronously (a short or refused ring read; a bad store fails again,
                // with the file named)
                if (failed && !read_task(t, bb, err)) {
                    t.failed = true;
                    set_error(err);
                }
            }
            wait_prefetched();
            load_done = true;
        }
        mark_load_end();
        return;
    }
    // the compute threads read, each its share
    for (int32_t i = ith; i < n_tasks; i += nth) {
        moetier_read_task & t = tasks[i];
        if (!read_task(t, bb, err)) {
            t.failed = true;
            set_error(err);
        }
    }
    if (ith == 0) {
        wait_prefetched();
        load_done = true;
    }
    mark_load_end();
}

void moetier_cache::wait_prefetched() noexcept {
    // prefetches of experts this layer needs that were still being read; a failed one is read again
    // here, synchronously, before the layer uses it
    for (auto & w : wait_ids) {
        const bool failed = io->wait(w.id) == MOETIER_IO_FAILED;
        io->release(w.id);
        w.id = -1;
        if (!failed) {
            continue;
        }
        std::string err;
        if (!read_expert(*task_layer, w.prec, sets[w.prec].slot_key[w.slot].expert, w.slot, bounce[0], err)) {
            w.failed = true;
            set_error(err);
        }
    }
}

void moetier_cache::mark_load_end() noexcept {
    const int64_t now = moetier_time_us();
    int64_t prev = t_load_end_us.load(std::memory_order_relaxed);
    while (now > prev && !t_load_end_us.compare_exchange_weak(prev, now, std::memory_order_relaxed)) {
    }
}
