// Layer-level adaptive prefetch (HOBBIT sec. 3.3): the prefetch half of the expert cache and the
// stacked routers it runs on.
//
// At layer L, after its experts are loaded, one matmul of L's gate input with the routers of the
// next p layers stacked ([n_embd, p * n_expert]) predicts their experts. Walking forward, a layer
// whose predicted experts are all cached has them held against eviction, and the walk goes on; the
// first layer with a missing one gets background reads (in the precision the rule gives the
// predicted weights; the surest predictions first, only as many as are read at once), held too, and
// the walk stops. When a layer resolves, its needed experts that a prefetch is still reading are
// waited for (or, if the read has not started, read at once: on-demand reads go first); queued
// prefetches it does not need are cancelled, and the ones already read are counted as waste.

#include "moetier-cache.h"
#include "moetier-impl.h"
#include "moetier-loader.h"

#include "llama-model.h"

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstring>
#include <stdexcept>

bool moetier_cache::use_prefetched(moetier_layer & layer, int32_t prec, int32_t e, int32_t s) noexcept {
    GGML_UNUSED(layer);
    GGML_UNUSED(e);
    moetier_pool_set & set = sets[prec];
    const int32_t id = set.pf_task[s];
    if (id < 0) {
        return true;
    }
    set.pf_task[s] = -1;
    if (io->claim(id)) {
        ++pf.n_claimed;
        return false;
    }
    const int32_t st = io->state(id);
    if (st == MOETIER_IO_RUNNING) {
        wait_ids.push_back({ id, prec, s, false });
        ++pf.n_hits;
        ++pf.n_waits;
        return true;
    }
    io->release(id);
    if (st == MOETIER_IO_DONE) {
        ++pf.n_hits;
        return true;
    }
    return false; // failed: read again
}

void moetier_cache::settle_prefetched(moetier_layer & layer) noexcept {
    for (const auto & [prec, s] : layer.prefetched) {
        moetier_pool_set & set = sets[prec];
        set.pf_hold[s] = 0;
        const int32_t id = set.pf_task[s];
        if (id < 0) {
            continue; // used by this layer, or a hold of an expert that was already cached
        }
        const uint64_t bytes = slot_bytes_unpadded(prec);
        if (io->claim(id)) {
            set.pf_task[s] = -1;
            drop_slot(set, s);
            ++pf.n_cancelled;
            continue;
        }
        ++pf.n_wasted;
        pf.bytes_wasted += bytes;
        const int32_t st = io->state(id);
        if (st == MOETIER_IO_RUNNING) {
            zombies.push_back({ prec, s }); // keeps pf_task: the slot is not reused until the read ends
            continue;
        }
        set.pf_task[s] = -1;
        io->release(id);
        if (st == MOETIER_IO_FAILED) {
            drop_slot(set, s);
        }
    }
    layer.prefetched.clear();
}

void moetier_cache::settle_zombies() noexcept {
    for (size_t i = 0; i < zombies.size();) {
        const auto [prec, s] = zombies[i];
        moetier_pool_set & set = sets[prec];
        const int32_t id = set.pf_task[s];
        const int32_t st = id >= 0 ? io->state(id) : MOETIER_IO_DONE;
        if (st == MOETIER_IO_RUNNING || st == MOETIER_IO_QUEUED) {
            ++i;
            continue;
        }
        if (id >= 0) {
            io->release(id);
            set.pf_task[s] = -1;
        }
        if (st == MOETIER_IO_FAILED) {
            drop_slot(set, s);
        }
        zombies[i] = zombies.back();
        zombies.pop_back();
    }
}

uint64_t moetier_cache::slot_bytes_unpadded(int32_t prec) const {
    uint64_t n = 0;
    for (const auto & p : shapes) {
        n += p.expert_bytes(prec);
    }
    return n;
}

void moetier_cache::check_predictions(const moetier_layer & layer, const int32_t * ids, int64_t n_used) noexcept {
    for (size_t j = 0; j < layer.pred_pass.size() && j < MOETIER_MAX_PREFETCH; ++j) {
        if (layer.pred_pass[j] != pass) {
            continue;
        }
        const std::vector<uint8_t> & pred = layer.pred_set[j];
        int64_t n_in = 0;
        for (int64_t k = 0; k < n_used; ++k) {
            n_in += pred[ids[k]] ? 1 : 0;
        }
        ++pf.n_pred[j];
        pf.n_top1[j] += layer.pred_top1[j] == ids[0];
        pf.n_allk[j] += n_in == n_used;
        pf.n_any[j]  += n_in > 0;
    }
}

// indices of the k largest of x[0..n) in descending order (k <= 64, n small: selection)
static int32_t moetier_top_k(const float * x, int32_t n, int32_t k, int32_t * out) {
    k = std::min(k, std::min(n, 64));
    for (int32_t i = 0; i < k; ++i) {
        out[i] = -1;
    }
    for (int32_t e = 0; e < n; ++e) {
        int32_t j = k;
        while (j > 0 && (out[j - 1] < 0 || x[out[j - 1]] < x[e])) {
            --j;
        }
        if (j < k) {
            for (int32_t m = k - 1; m > j; --m) {
                out[m] = out[m - 1];
            }
            out[j] = e;
        }
    }
    return k;
}

void moetier_cache::prefetch(moetier_layer & layer, const float * logits, int64_t n_tokens, size_t nb1) noexcept {
    if (io == nullptr || layer.next.empty() || n_tokens <= 0 || n_used_last <= 0) {
        return;
    }
    const int32_t E = n_expert_;
    int32_t top[64];
    float   w[64];
    uint8_t lv[64];
    // reads started per walk: one per prefetch lane. More would wait in the queue, each holding a
    // slot it evicted a cached expert for, and a wrong one is cancelled when its layer resolves:
    // the eviction is all that is left of it.
    const int32_t max_reads = std::max(1, io->prefetch_depth());
    int32_t n_reads = 0;
    bool walking = true;
    for (size_t j = 0; j < layer.next.size(); ++j) {
        moetier_layer & T = *layer.next[j];
        std::fill(pred_need.begin(), pred_need.end(), 0);
        std::fill(pred_w.begin(), pred_w.end(), 0.0f);
        for (int64_t t = 0; t < n_tokens; ++t) {
            const float * row = (const float *) ((const char *) logits + t * nb1) + j * E;
            const int32_t k = moetier_top_k(row, E, n_used_last, top);
            // the gate weights of the predicted experts: a softmax over them ranks like the model's
            float sum = 0.0f;
            for (int32_t i = 0; i < k; ++i) {
                w[i] = std::exp(row[top[i]] - row[top[0]]);
                sum += w[i];
            }
            for (int32_t i = 0; i < k; ++i) {
                w[i] /= sum;
            }
            moetier_precision_levels(rule, w, k, lv);
            for (int32_t i = 0; i < k; ++i) {
                pred_need[top[i]] = std::max<uint8_t>(pred_need[top[i]], lv[i] + 1);
                pred_w[top[i]]    = std::max(pred_w[top[i]], w[i]);
            }
            if (n_tokens == 1 && j < T.pred_pass.size()) {
                // a prediction made j + 1 layers ahead, checked when T resolves in this pass
                T.pred_pass[j] = pass;
                T.pred_top1[j] = top[0];
                for (int32_t e = 0; e < E; ++e) {
                    T.pred_set[j][e] = pred_need[e] > 0;
                }
            }
        }
        if (!walking) {
            continue;
        }
        // surest first: with few reads in flight, the likeliest experts are the ones read
        pred_rank.clear();
        for (int32_t e = 0; e < E; ++e) {
            if (pred_need[e] > 0) {
                pred_rank.push_back(e);
            }
        }
        std::sort(pred_rank.begin(), pred_rank.end(), [&](int32_t a, int32_t b) {
            return pred_w[a] != pred_w[b] ? pred_w[a] > pred_w[b] : a < b;
        });
        // the cached ones are held against eviction until T runs (all of them, before any read
        // takes a slot: a read must not evict a predicted expert of the same walk)
        bool all_cached = true;
        for (const int32_t e : pred_rank) {
            int32_t prec = MOETIER_HIGH;
            int32_t s    = -1;
            if (cached_version(T, e, pred_need[e], prec, s)) {
                if (!sets[prec].pf_hold[s]) {
                    sets[prec].pf_hold[s] = 1;
                    T.prefetched.push_back({ prec, s });
                }
            } else if (pred_need[e] > 1) { // a low need is skipped on a miss
                all_cached = false;
            }
        }
        for (const int32_t e : pred_rank) {
            const uint8_t nd = pred_need[e];
            if (n_reads == max_reads) {
                break;
            }
            int32_t prec = MOETIER_HIGH;
            int32_t s    = -1;
            if (nd == 1 || cached_version(T, e, nd, prec, s)) {
                continue;
            }
            prec = nd == 2 && sets[MOETIER_LOW].n_slots() > 0 ? MOETIER_LOW : MOETIER_HIGH;
            moetier_pool_set & set = sets[prec];
            const moetier_key key = { T.il, e };
            s = take_slot(set, key);
            if (s < 0) {
                continue;
            }
            T.slot_of[prec][e] = s;
            set.policy->on_load(s, key, prec == MOETIER_HIGH, policy_ctx(T.il));
            moetier_io_task task;
            task.owner  = this;
            task.layer  = &T;
            task.prec   = prec;
            task.expert = e;
            task.slot   = s;
            const int32_t id = io->submit(task);
            if (id < 0) {
                drop_slot(set, s);
                continue;
            }
            set.pf_task[s] = id;
            set.pf_hold[s] = 1;
            T.prefetched.push_back({ prec, s });
            ++pf.n_issued;
            ++n_reads;
        }
        walking = all_cached;
    }
}

bool moetier_cache::read_expert(const moetier_layer & l, int32_t prec, int32_t e, int32_t s, moetier_aligned_buffer & bb,
                                std::string & err) const noexcept {
    moetier_read_task t;
    t.layer  = &l;
    t.prec   = prec;
    t.expert = e;
    t.slot   = s;
    const bool whole = !l.file_order[prec].empty();
    bool ok = true;
    for (size_t p = 0; ok && p < (whole ? 1 : l.projs.size()); ++p) {
        t.proj = whole ? -1 : (int32_t) p;
        ok = read_task(t, bb, err);
    }
    return ok;
}

bool moetier_cache::io_read(const moetier_io_task & task, int thread_id, std::string & err) noexcept {
    // I/O threads serve prefetch only (on-demand reads go to them only in io_uring mode)
    const bool ok = read_expert(*(const moetier_layer *) task.layer, task.prec, task.expert, task.slot, io_bounce[thread_id], err);
    if (ok) {
        pf_bytes_read.fetch_add(slot_bytes_unpadded(task.prec), std::memory_order_relaxed);
    }
    return ok;
}

bool moetier_cache::io_prep(const moetier_io_task & task, moetier_io_vec_read & rd, std::string & err) const noexcept {
    const moetier_layer & l = *(const moetier_layer *) task.layer;
    const std::vector<int32_t> & order = l.file_order[task.prec];
    if (order.empty() || task.proj >= 0 || order.size() > 8) {
        err = "io_uring: the expert is not one contiguous range of the store";
        return false;
    }
    const moetier_proj & first = l.projs[order[0]];
    rd.fd     = first.file->direct_fd();
    rd.offset = first.expert_offset(task.expert, task.prec);
    rd.n_iov  = (unsigned) order.size();
    rd.bytes  = 0;
    for (size_t k = 0; k < order.size(); ++k) {
        const moetier_proj & p = l.projs[order[k]];
        const ggml_tensor * pool = p.pool[task.prec];
        rd.iov[k].iov_base = (uint8_t *) pool->data + (uint64_t) task.slot * pool->nb[2];
        rd.iov[k].iov_len  = moetier_align_up(p.expert_bytes(task.prec));
        rd.bytes += rd.iov[k].iov_len;
    }
    if (rd.fd < 0) {
        err = format("%s: io_uring reads need O_DIRECT", first.file->path().c_str());
        return false;
    }
    return true;
}

bool moetier_cache::io_finish(const moetier_io_task & task, std::string & err) noexcept {
    const moetier_layer & l = *(const moetier_layer *) task.layer;
    moetier_read_task t;
    t.layer  = &l;
    t.prec   = task.prec;
    t.expert = task.expert;
    t.slot   = task.slot;
    for (const auto & p : l.projs) {
        if (!verify(p, t, err)) {
            return false;
        }
    }
    if (task.proj == MOETIER_IO_ALL_PROJS) {
        pf_bytes_read.fetch_add(slot_bytes_unpadded(task.prec), std::memory_order_relaxed);
    }
    return true;
}

void moetier_cache::add_prefetch_stats(moetier_prefetch_stats & out) const {
    out.n_issued     += pf.n_issued;
    out.n_hits       += pf.n_hits;
    out.n_waits      += pf.n_waits;
    out.n_claimed    += pf.n_claimed;
    out.n_cancelled  += pf.n_cancelled;
    out.n_wasted     += pf.n_wasted;
    out.bytes_read   += pf_bytes_read.load(std::memory_order_relaxed);
    out.bytes_wasted += pf.bytes_wasted;
    for (int j = 0; j < MOETIER_MAX_PREFETCH; ++j) {
        out.n_pred[j] += pf.n_pred[j];
        out.n_top1[j] += pf.n_top1[j];
        out.n_allk[j] += pf.n_allk[j];
        out.n_any[j]  += pf.n_any[j];
    }
}

void moetier_cache::reset_prefetch_stats() {
    pf = {};
    pf_bytes_read.store(0, std::memory_order_relaxed);
}

//
// model side: the stacked routers and the I/O threads (which also serve the on-demand reads)
//

void moetier_model::init_prefetch(const llama_model & model) {
    if (prefetch <= 0) {
        return;
    }
    // the successors of each served layer within its pool group
    size_t n_stack = 0;
    std::vector<std::vector<moetier_layer *>> next(layers.size());
    for (size_t i = 0; i < layers.size(); ++i) {
        for (size_t k = i + 1; k < layers.size() && next[i].size() < (size_t) prefetch; ++k) {
            if (layers[k]->cache != layers[i]->cache) {
                break;
            }
            next[i].push_back(layers[k].get());
        }
        n_stack += next[i].empty() ? 0 : 1;
    }
    if (n_stack == 0) {
        return;
    }

    ggml_init_params ip = {
        /*.mem_size   =*/ ggml_tensor_overhead() * (n_stack + 1),
        /*.mem_buffer =*/ nullptr,
        /*.no_alloc   =*/ true,
    };
    router_ctx = ggml_init(ip);
    if (!router_ctx) {
        throw std::runtime_error("failed to create the stacked router context");
    }
    int64_t n_embd = 0;
    for (size_t i = 0; i < layers.size(); ++i) {
        if (next[i].empty()) {
            continue;
        }
        const ggml_tensor * g = model.layers[layers[i]->il].ffn_gate_inp;
        if (g == nullptr) {
            throw std::runtime_error(format("prefetch: layer %d has no router (ffn_gate_inp)", layers[i]->il));
        }
        n_embd = g->ne[0];
        ggml_tensor * t = ggml_new_tensor_2d(router_ctx, GGML_TYPE_F32, n_embd, (int64_t) next[i].size() * n_expert);
        ggml_format_name(t, "moetier_router_stack-%d", layers[i]->il);
        layers[i]->router_stack = t;
    }
    router_buf = ggml_backend_alloc_ctx_tensors_from_buft(router_ctx, ggml_backend_cpu_buffer_type());
    if (!router_buf) {
        throw std::runtime_error("failed to allocate the stacked routers");
    }

    std::vector<uint8_t> raw;
    for (size_t i = 0; i < layers.size(); ++i) {
        moetier_layer & l = *layers[i];
        if (!l.router_stack) {
            continue;
        }
        float * dst = (float *) l.router_stack->data;
        for (size_t j = 0; j < next[i].size(); ++j) {
            const ggml_tensor * g = model.layers[next[i][j]->il].ffn_gate_inp;
            if (g == nullptr || g->ne[0] != n_embd || g->ne[1] != n_expert) {
                throw std::runtime_error(format("prefetch: the router of layer %d is missing or has another shape",
                        next[i][j]->il));
            }
            const auto * traits = ggml_get_type_traits(g->type);
            if (g->type != GGML_TYPE_F32 && traits->to_float == nullptr) {
                throw std::runtime_error(format("prefetch: the router of layer %d has type %s, which cannot be read back",
                        next[i][j]->il, ggml_type_name(g->type)));
            }
            raw.resize(ggml_nbytes(g));
            ggml_backend_tensor_get(g, raw.data(), 0, raw.size());
            float * out = dst + j * n_expert * n_embd;
            if (g->type == GGML_TYPE_F32) {
                memcpy(out, raw.data(), (size_t) n_expert * n_embd * sizeof(float));
            } else {
                for (int64_t e = 0; e < n_expert; ++e) {
                    traits->to_float(raw.data() + e * g->nb[1], out + e * n_embd, n_embd);
                }
            }
        }
        l.next = next[i];
        for (moetier_layer * t : l.next) {
            t->pred_set.assign(prefetch, std::vector<uint8_t>(n_expert, 0));
            t->pred_pass.assign(prefetch, 0);
            t->pred_top1.assign(prefetch, -1);
        }
    }

    MOETIER_LOG_INFO("%s: prefetch: %d layers ahead by stacked routers\n", __func__, prefetch);
}

void moetier_model::init_io() {
    if (io_threads <= 0) {
        return;
    }
    // one layer's on-demand reads per group (a read per projection at most, both precisions), a
    // read per predicted expert of up to p layers, and room for reads still in flight
    size_t n_proj = 0;
    bool   vectored = store != nullptr && store_file->direct_fd() >= 0;
    for (const auto & l : layers) {
        n_proj = std::max(n_proj, l->projs.size());
        for (int prec = 0; prec < 2; ++prec) {
            vectored = vectored && (!l->file_order[prec].empty() || l->cache->n_slots(prec) == 0);
        }
    }
    const size_t capacity = caches.size() * 2 * n_proj * n_expert + (size_t) 4 * prefetch * n_expert + 64;

    // io_uring when every read is one vectored O_DIRECT read of the store: the kernel reads while
    // the compute threads run; else I/O threads
    if (use_uring && vectored) {
        auto ring = std::make_unique<moetier_uring>((unsigned) std::min<size_t>(capacity, 4096));
        if (ring->ok()) {
            io = std::make_unique<moetier_io_pool>(std::move(ring), io_threads, capacity,
                [](const moetier_io_task & task, moetier_io_vec_read & rd, std::string & err) {
                    return ((moetier_cache *) task.owner)->io_prep(task, rd, err);
                },
                [](const moetier_io_task & task, std::string & err) {
                    return ((moetier_cache *) task.owner)->io_finish(task, err);
                });
            for (auto & c : caches) {
                c->set_io(io.get());
            }
            MOETIER_LOG_INFO("%s: io_uring: expert reads start at routing and overlap the compute that does not need them "
                    "(prefetch: %d reads in flight)\n", __func__, io_threads);
            return;
        }
        MOETIER_LOG_WARN("%s: %s; using %d I/O threads\n", __func__, ring->error().c_str(), io_threads);
    }
    io = std::make_unique<moetier_io_pool>(io_threads, capacity, [](const moetier_io_task & task, int thread_id, std::string & err) {
        return ((moetier_cache *) task.owner)->io_read(task, thread_id, err);
    });
    for (auto & c : caches) {
        c->set_io(io.get());
    }
    MOETIER_LOG_INFO("%s: %d I/O threads: expert reads start at routing and overlap the compute that does not need them\n",
            __func__, io_threads);
}
