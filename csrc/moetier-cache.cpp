#include "moetier-cache.h"

#include "moetier-impl.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

// upper bound on compute threads that may run the load op; bounce buffers are per thread index
static constexpr int MOETIER_MAX_THREADS = 512;

moetier_cache::moetier_cache(int32_t n_expert, int32_t n_slots, moetier_policy_ptr policy_, std::vector<moetier_proj> proj_shapes)
        : n_expert_(n_expert), policy(std::move(policy_)), shapes(std::move(proj_shapes)) {
    GGML_ASSERT(n_slots >= n_expert && n_expert > 0);

    uint64_t total = 0;
    for (const auto & p : shapes) {
        slot_stride.push_back(moetier_align_up(p.bytes));
        total += slot_stride.back() * (uint64_t) n_slots;
    }
    buf_size = total;
    // not touched here: pages become resident as slots fill (and the memory-fit pass of
    // common_fit_params, which loads the model with no_alloc, costs no RSS)
    mem.reserve(buf_size);

    buf = ggml_backend_cpu_buffer_from_ptr(mem.data.get(), buf_size);
    if (!buf) {
        throw std::runtime_error("failed to create the expert cache buffer");
    }
    ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);

    ggml_init_params ip = {
        /*.mem_size   =*/ ggml_tensor_overhead() * (shapes.size() + 1),
        /*.mem_buffer =*/ nullptr,
        /*.no_alloc   =*/ true,
    };
    ctx = ggml_init(ip);
    if (!ctx) {
        throw std::runtime_error("failed to create the expert cache context");
    }

    uint8_t * base = (uint8_t *) mem.data.get();
    for (size_t k = 0; k < shapes.size(); ++k) {
        const ggml_tensor * m = shapes[k].meta;
        ggml_tensor * t = ggml_new_tensor_3d(ctx, m->type, m->ne[0], m->ne[1], n_slots);
        // slots padded to 4096 so that aligned reads land straight in them [TAG_MOETIER_ALIGN]
        t->nb[2] = slot_stride[k];
        t->nb[3] = slot_stride[k] * (uint64_t) n_slots;
        ggml_format_name(t, "moetier_pool_%s", shapes[k].name.c_str());
        if (ggml_backend_tensor_alloc(buf, t, base) != GGML_STATUS_SUCCESS) {
            throw std::runtime_error("failed to place an expert cache pool");
        }
        base += slot_stride[k] * (uint64_t) n_slots;
        pools.push_back(t);
    }

    slot_key.assign(n_slots, moetier_key{});
    pinned.assign(n_slots, 0);
    free_slots.resize(n_slots);
    for (int32_t s = 0; s < n_slots; ++s) {
        free_slots[s] = n_slots - 1 - s; // pop_back hands out slot 0 first
    }
    policy->init(n_slots);

    tasks.resize((size_t) n_expert * shapes.size());
    mask.assign(n_slots, 0);
    bounce.resize(MOETIER_MAX_THREADS);
}

moetier_cache::~moetier_cache() {
    if (ctx) {
        ggml_free(ctx);
    }
    if (buf) {
        ggml_backend_buffer_free(buf);
    }
}

void moetier_cache::add_layer(moetier_layer * layer) {
    if ((size_t) layer->il >= layers.size()) {
        layers.resize(layer->il + 1, nullptr);
    }
    layers[layer->il] = layer;
    held.resize(layers.size(), 0);
    ++n_layers;
    layer->cache = this;
    layer->slot_of.assign(n_expert_, -1);
}

uint64_t moetier_cache::slot_bytes() const {
    uint64_t n = 0;
    for (uint64_t s : slot_stride) {
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
    policy->reset_sequence();
}

void moetier_cache::sync() noexcept {
    finish_previous();
}

void moetier_cache::finish_previous() noexcept {
    if (task_layer == nullptr) {
        return;
    }
    const int64_t t_end = t_load_end_us.load(std::memory_order_relaxed);
    if (n_tasks > 0 && t_end > t_resolve_us) {
        task_layer->counters.read_us += (uint64_t) (t_end - t_resolve_us);
    }
    for (int32_t i = 0; i < n_tasks; ++i) {
        moetier_read_task & t = tasks[i];
        if (!t.failed) {
            continue;
        }
        // the slot holds garbage: forget it, so the expert is read again next time
        moetier_layer * l = layers[slot_key[t.slot].layer];
        if (l && slot_key[t.slot].expert >= 0) {
            l->slot_of[slot_key[t.slot].expert] = -1;
        }
        --held[slot_key[t.slot].layer];
        slot_key[t.slot] = moetier_key{};
        free_slots.push_back(t.slot);
        t.failed = false;
    }
    n_tasks    = 0;
    task_layer = nullptr;
}

int32_t moetier_cache::take_slot(const moetier_key & key) noexcept {
    int32_t s;
    if (!free_slots.empty()) {
        s = free_slots.back();
        free_slots.pop_back();
    } else {
        // donor layer: the most slots above the fair share among layers with an unpinned slot
        // (pins belong to the layer being resolved only)
        const int32_t n_slots = (int32_t) slot_key.size();
        const int32_t pinned_cur = n_pinned;
        const double quota = (double) n_slots / std::max(1, n_layers);
        int32_t donor = -1;
        double  best  = 0.0;
        for (int32_t l = 0; l < (int32_t) held.size(); ++l) {
            const int32_t avail = held[l] - (l == key.layer ? pinned_cur : 0);
            if (avail <= 0) {
                continue;
            }
            const double excess = held[l] - quota;
            if (donor < 0 || excess > best) {
                donor = l;
                best  = excess;
            }
        }
        GGML_ASSERT(donor >= 0 && "expert cache: no unpinned slot; the pool is smaller than one layer's experts");
        for (int32_t i = 0; i < n_slots; ++i) {
            mask[i] = pinned[i] || slot_key[i].layer != donor;
        }
        s = policy->victim(mask, tick);
        GGML_ASSERT(s >= 0 && !mask[s]);
        const moetier_key old = slot_key[s];
        layers[old.layer]->slot_of[old.expert] = -1;
        --held[old.layer];
    }
    slot_key[s] = key;
    ++held[key.layer];
    return s;
}

void moetier_cache::resolve(moetier_layer & layer, const int32_t * ids, int64_t n_used, int64_t n_tokens, size_t ids_nb1,
                            int32_t * out, bool warmup) noexcept {
    finish_previous();
    ++tick;

    // the previous layer of this group is done: its slots may be evicted again
    std::fill(pinned.begin(), pinned.end(), 0);
    n_pinned = 0;

    task_layer = &layer;
    t_resolve_us = moetier_time_us();
    t_load_end_us.store(0, std::memory_order_relaxed);

    for (int64_t t = 0; t < n_tokens; ++t) {
        const int32_t * row = (const int32_t *) ((const char *) ids + t * ids_nb1);
        for (int64_t k = 0; k < n_used; ++k) {
            const int32_t e = row[k];
            GGML_ASSERT(e >= 0 && e < n_expert_);
            int32_t s = layer.slot_of[e];
            if (s >= 0 && pinned[s]) {
                // already resolved for this ubatch
                out[t * n_used + k] = s;
                continue;
            }
            const moetier_key key = { layer.il, e };
            if (s >= 0) {
                ++layer.counters.n_lookups;
                ++layer.counters.n_hits;
                policy->on_hit(s, key, tick);
            } else if (warmup) {
                // warmup runs every expert through the graph once; reading them all would defeat the cache
                out[t * n_used + k] = -1;
                continue;
            } else {
                ++layer.counters.n_lookups;
                ++layer.counters.n_misses;
                s = take_slot(key);
                layer.slot_of[e] = s;
                policy->on_load(s, key, tick);
                const bool whole = !layer.file_order.empty();
                for (size_t p = 0; p < (whole ? 1 : layer.projs.size()); ++p) {
                    moetier_read_task & task = tasks[n_tasks++];
                    task.layer  = &layer;
                    task.proj   = whole ? -1 : (int32_t) p;
                    task.expert = e;
                    task.slot   = s;
                    task.failed = false;
                }
                for (const auto & p : layer.projs) {
                    layer.counters.n_bytes_read += p.bytes;
                }
            }
            n_pinned += !pinned[s];
            pinned[s] = 1;
            out[t * n_used + k] = s;
        }
    }
}

bool moetier_cache::verify(const moetier_proj & p, const moetier_read_task & t, std::string & err) const noexcept {
    if (!p.store) {
        return true;
    }
    const uint8_t * dst = (const uint8_t *) p.pool->data + (uint64_t) t.slot * p.pool->nb[2];
    if (moetier_checksum(dst, p.bytes) != p.store->checksum_high[t.expert]) {
        err = format("%s: checksum mismatch for %s expert %d: the store is corrupt; re-run `moetier pack`",
                p.file->path().c_str(), p.meta->name, t.expert);
        return false;
    }
    return true;
}

void moetier_cache::load(int ith, int nth) noexcept {
    if (n_tasks == 0) {
        return;
    }
    GGML_ASSERT(ith < MOETIER_MAX_THREADS);
    moetier_aligned_buffer & bb = bounce[ith];
    std::string err;
    for (int32_t i = ith; i < n_tasks; i += nth) {
        moetier_read_task & t = tasks[i];
        const moetier_layer & l = *t.layer;
        bool ok = true;
        if (t.proj < 0) {
            // a store keeps an expert's projections back to back and padded: one vectored O_DIRECT
            // read straight into the slots of the projection pools
            moetier_iovec iov[8];
            const int n = (int) l.file_order.size();
            for (int k = 0; k < n; ++k) {
                const moetier_proj & p = l.projs[l.file_order[k]];
                iov[k].base = (uint8_t *) p.pool->data + (uint64_t) t.slot * p.pool->nb[2];
                iov[k].len  = moetier_align_up(p.bytes);
            }
            const moetier_proj & first = l.projs[l.file_order[0]];
            ok = first.file->readv(iov, n, first.expert_offset(t.expert), err);
            for (int k = 0; ok && k < n; ++k) {
                ok = verify(l.projs[l.file_order[k]], t, err);
            }
        } else {
            const moetier_proj & p = l.projs[t.proj];
            uint8_t * dst = (uint8_t *) p.pool->data + (uint64_t) t.slot * p.pool->nb[2];
            try {
                // one-time growth per thread; bounded by the largest projection
                bb.reserve(std::max<size_t>(2 * MOETIER_ALIGN, moetier_align_up(p.bytes) + 2 * MOETIER_ALIGN));
            } catch (...) {
                err = "out of memory for the read buffer";
                ok = false;
            }
            if (ok) {
                // a store's slices are padded: read whole blocks straight into the slot
                const size_t n = p.store ? (size_t) moetier_align_up(p.bytes) : (size_t) p.bytes;
                ok = p.file->read(dst, p.expert_offset(t.expert), n, bb, err) && verify(p, t, err);
            }
        }
        if (!ok) {
            t.failed = true;
            set_error(err);
        }
    }
    const int64_t now = moetier_time_us();
    int64_t prev = t_load_end_us.load(std::memory_order_relaxed);
    while (now > prev && !t_load_end_us.compare_exchange_weak(prev, now, std::memory_order_relaxed)) {
    }
}
