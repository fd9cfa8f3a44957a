#include "moetier-slots.h"

#include "ggml-alloc.h"
#include "moetier-impl.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <utility>

moetier_slots::moetier_slots(moetier_precision  prec,
                             int32_t            n_slots,
                             int32_t            n_expert_,
                             moetier_policy_ptr policy_,
                             int32_t            n_capacity) :
    prec_(prec),
    n_expert(n_expert_),
    policy(std::move(policy_)),
    n_floor(n_slots) {
    GGML_ASSERT(policy && n_slots >= 0 && n_expert > 0);
    const int32_t cap = std::max(n_slots, n_capacity);
    keys.assign(cap, moetier_key{});
    pinned.assign(cap, 0);
    readers.assign(cap, -1);
    holds.assign(cap, 0);
    unchecked.assign(cap, 0);
    mask.assign(cap, 0);
    enabled.assign(cap, 0);
    touched.assign(cap, 0);
    free_slots.resize(n_slots);
    for (int32_t s = 0; s < n_slots; ++s) {
        free_slots[s] = n_slots - 1 - s;  // pop_back hands out slot 0 first
        enabled[s]    = 1;
    }
    n_enabled.store(n_slots, std::memory_order_relaxed);
    n_untouched_ = n_slots;
    policy->init(cap);
}

moetier_slots::~moetier_slots() {
    stop_populate();
}

bool moetier_slots::use_huge_pages() {
    huge_ = mem.advise_huge();
    return huge_;
}

void moetier_slots::start_populate() {
    stop_populate();
    if (!huge_ || free_slots.empty()) {
        return;
    }
    // the ranges now, in hand-out order (free_slots' back first); the thread reads nothing else of
    // the bookkeeping, which the cache changes under it
    std::vector<std::pair<size_t, size_t>> ranges;
    for (auto it = free_slots.rbegin(); it != free_slots.rend(); ++it) {
        for (const ggml_tensor * t : tensors) {
            ranges.emplace_back(
                (size_t) ((const uint8_t *) t->data - (const uint8_t *) mem.data()) + (size_t) *it * t->nb[2],
                t->nb[2]);
        }
    }
    // a window of slots ahead of the ones taken: never much more committed than the misses will use
    const int64_t window = std::max<int64_t>(4, (int64_t) ((256u << 20) / std::max<uint64_t>(slot_bytes_, 1)));
    const size_t  n_proj = tensors.size();
    n_fresh_taken.store(0, std::memory_order_relaxed);
    populate_stop.store(false, std::memory_order_relaxed);
    populate_thread = std::thread([this, window, n_proj, ranges = std::move(ranges)] {
#ifdef __linux__
        // idle time first: the decode's threads come before it (a per-thread nice on Linux)
        setpriority(PRIO_PROCESS, (id_t) syscall(SYS_gettid), 19);
#endif
        for (size_t i = 0; i < ranges.size();) {
            if (populate_stop.load(std::memory_order_relaxed)) {
                return;
            }
            if ((int64_t) (i / n_proj) >= n_fresh_taken.load(std::memory_order_relaxed) + window) {
                std::this_thread::sleep_for(std::chrono::milliseconds(5));
                continue;
            }
            if (!mem.populate(ranges[i].first, ranges[i].second)) {
                return;  // a kernel before 5.14, or no memory: the reads fault their pages in
            }
            populated.fetch_add(ranges[i].second, std::memory_order_relaxed);
            ++i;
        }
    });
}

void moetier_slots::stop_populate() noexcept {
    if (populate_thread.joinable()) {
        populate_stop.store(true, std::memory_order_relaxed);
        populate_thread.join();
    }
}

void moetier_slots::alloc(const std::vector<moetier_proj> & shapes,
                          ggml_backend_buffer_type_t        buft,
                          bool                              vram,
                          int32_t                           n_zero) {
    stop_populate();
    huge_ = false;
    tensors.clear();
    repack_buf.reset();
    n_repacked_ = 0;
    buf.reset();
    ctx.reset();
    mem.map(0);
    buf_size        = 0;
    slot_bytes_     = 0;
    const int32_t n = n_capacity();
    if (n == 0) {
        return;
    }
    GGML_ASSERT(!vram || (buft != nullptr && n_zero >= 1));
    const bool            device = vram;
    std::vector<uint64_t> stride;
    uint64_t              total = 0;
    for (const auto & p : shapes) {
        stride.push_back(device ? p.expert_bytes(prec_) : moetier_align_up(p.expert_bytes(prec_)));
        total += stride.back() * (uint64_t) n;
        slot_bytes_ += stride.back();
    }
    ggml_init_params ip = {
        /*.mem_size   =*/ggml_tensor_overhead() * (shapes.size() + 1),
        /*.mem_buffer =*/nullptr,
        /*.no_alloc   =*/true,
    };
    ctx.reset(ggml_init(ip));
    if (!ctx) {
        throw std::runtime_error("failed to create the expert cache context");
    }
    for (size_t k = 0; k < shapes.size(); ++k) {
        const ggml_tensor * m    = shapes[k].meta;
        const ggml_type     type = prec_ == MOETIER_PRECISION_LOW ? shapes[k].store->type_low : m->type;
        ggml_tensor *       t    = ggml_new_tensor_3d(ctx.get(), type, m->ne[0], m->ne[1], device ? n + n_zero : n);
        if (!device) {
            // slots padded to 4096 so that aligned reads land straight in them [TAG_MOETIER_ALIGN]
            t->nb[2] = stride[k];
            t->nb[3] = stride[k] * (uint64_t) n;
        }
        ggml_format_name(t, "%s%s%s", device ? "moetier_vram_" : "moetier_pool_", shapes[k].name.c_str(),
                         prec_ == MOETIER_PRECISION_LOW ? "_low" : "");
        tensors.push_back(t);
    }

    if (device) {
        buf.reset(ggml_backend_alloc_ctx_tensors_from_buft(ctx.get(), buft));
        if (!buf) {
            throw std::runtime_error(format("failed to allocate the VRAM tier's %s in %s",
                                            moetier_format_bytes(total).c_str(), ggml_backend_buft_name(buft)));
        }
        ggml_backend_buffer_clear(buf.get(), 0);
        buf_size = ggml_backend_buffer_get_size(buf.get());
    } else {
        uint8_t * base = nullptr;
        if (buft != nullptr) {
            // pinned memory: its pages are locked now, not as slots fill
            buf.reset(ggml_backend_buft_alloc_buffer(buft, total + MOETIER_ALIGN));
            if (!buf) {
                throw std::runtime_error(format("failed to allocate the expert cache's %s of pinned memory (%s)",
                                                moetier_format_bytes(total).c_str(), ggml_backend_buft_name(buft)));
            }
            if (ggml_backend_buffer_get_type(buf.get()) != buft) {
                // ggml's CUDA host buffer falls back to plain memory when cudaMallocHost fails (a memlock
                // limit, GGML_CUDA_NO_PINNED) and says so only at debug level: copies then run at pageable
                // speed and block the host
                MOETIER_LOG_WARN(
                    "%s: the expert cache's %s could not be pinned (%s gave %s): copies to the GPU run "
                    "at pageable-memory speed\n",
                    __func__, moetier_format_bytes(total).c_str(), ggml_backend_buft_name(buft),
                    ggml_backend_buffer_name(buf.get()));
            }
            base = (uint8_t *) moetier_align_up((uint64_t) (uintptr_t) ggml_backend_buffer_get_base(buf.get()));
        } else {
            // not touched here: pages become resident as slots fill (and the memory-fit pass of
            // common_fit_params, which loads the model with no_alloc, costs no RSS)
            mem.map(total);
            buf.reset(ggml_backend_cpu_buffer_from_ptr(mem.data(), total));
            if (!buf) {
                throw std::runtime_error("failed to create the expert cache buffer");
            }
            base = (uint8_t *) mem.data();
        }
        buf_size = total;
        for (size_t k = 0; k < shapes.size(); ++k) {
            if (ggml_backend_tensor_alloc(buf.get(), tensors[k], base) != GGML_STATUS_SUCCESS) {
                throw std::runtime_error("failed to place an expert cache pool");
            }
            base += stride[k] * (uint64_t) n;
        }
    }
    ggml_backend_buffer_set_usage(buf.get(), GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
}

int32_t moetier_slots::use_repacked(ggml_backend_buffer_type_t repack_buft) {
    GGML_ASSERT(mem.data() != nullptr || tensors.empty());
    if (repack_buft == nullptr || tensors.empty() || n_repacked_ > 0) {
        return n_repacked_;
    }
    // the token buffer: ggml-cpu takes a tensor's kernels from its buffer's type and its traits (extra),
    // which init_tensor sets from the type and the row count alone; the data pointer stays in the pool
    repack_buf.reset(ggml_backend_buft_alloc_buffer(repack_buft, MOETIER_ALIGN));
    if (!repack_buf) {
        throw std::runtime_error("failed to create the expert cache's repacked-kernel buffer");
    }
    ggml_backend_buffer_set_usage(repack_buf.get(), GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    for (ggml_tensor * t : tensors) {
        t->buffer = repack_buf.get();
        t->extra  = nullptr;
        if (ggml_backend_buffer_init_tensor(repack_buf.get(), t) != GGML_STATUS_SUCCESS || t->extra == nullptr) {
            // no repacked kernel for this type and shape on this CPU: the plain layout and kernels
            t->buffer = buf.get();
            t->extra  = nullptr;
            continue;
        }
        ++n_repacked_;
    }
    if (n_repacked_ == 0) {
        repack_buf.reset();
    }
    return n_repacked_;
}

void moetier_slots::add_layer(int32_t il) {
    GGML_ASSERT(il >= 0);
    if ((size_t) il >= slot_of.size()) {
        slot_of.resize(il + 1);
        held.resize(il + 1, 0);
    }
    slot_of[il].assign(n_expert, -1);
    ++n_layers;
}

void moetier_slots::unpin_all() {
    std::fill(pinned.begin(), pinned.end(), 0);
}

void moetier_slots::forget(int32_t s) noexcept {
    const moetier_key k = keys[s];
    if (k.layer < 0 || k.expert < 0) {
        return;
    }
    slot_of[k.layer][k.expert] = -1;
    --held[k.layer];
    keys[s]      = moetier_key{};
    unchecked[s] = 0;
}

void moetier_slots::drop(int32_t s) noexcept {
    if (keys[s].layer < 0 || keys[s].expert < 0) {
        return;
    }
    forget(s);
    free_slots.push_back(s);
}

int32_t moetier_slots::pick_victim(const moetier_policy_ctx & pctx) noexcept {
    // candidates: slots in use holding an expert, not pinned by the layer being resolved, not being
    // read by a prefetch, not held for a later layer by a prediction
    const int32_t n = n_capacity();
    cand.assign(held.size(), 0);
    int32_t n_cand = 0;
    for (int32_t i = 0; i < n; ++i) {
        mask[i] = !enabled[i] || keys[i].layer < 0 || pinned[i] || readers[i] >= 0 || holds[i];
        if (!mask[i]) {
            ++n_cand;
            ++cand[keys[i].layer];
        }
    }
    if (n_cand == 0) {
        return -1;
    }
    if (!policy->across_layers()) {
        // donor layer: the most slots above the fair share among layers with a candidate
        const double quota = (double) n_slots() / std::max(1, n_layers);
        int32_t      donor = -1;
        double       best  = 0.0;
        for (int32_t l = 0; l < (int32_t) held.size(); ++l) {
            if (cand[l] == 0) {
                continue;
            }
            const double excess = held[l] - quota;
            if (donor < 0 || excess > best) {
                donor = l;
                best  = excess;
            }
        }
        for (int32_t i = 0; i < n; ++i) {
            mask[i] = mask[i] || keys[i].layer != donor;
        }
    }
    const int32_t s = policy->victim(mask, pctx);
    GGML_ASSERT(s >= 0 && !mask[s]);
    return s;
}

int32_t moetier_slots::take(const moetier_key & key, const moetier_policy_ctx & pctx) noexcept {
    int32_t s;
    if (!free_slots.empty()) {
        s = free_slots.back();
        free_slots.pop_back();
    } else {
        s = pick_victim(pctx);
        if (s < 0) {
            return -1;
        }
        forget(s);
    }
    if (!touched[s]) {
        touched[s] = 1;
        --n_untouched_;
        n_fresh_taken.fetch_add(1, std::memory_order_relaxed);
    }
    keys[s]                        = key;
    slot_of[key.layer][key.expert] = s;
    unchecked[s]                   = 0;
    ++held[key.layer];
    policy->on_load(s, key, prec_ == MOETIER_PRECISION_HIGH, pctx);
    return s;
}

int32_t moetier_slots::grow(int32_t n) {
    // the new slots go to the front of the free list: used after the slots already in memory
    std::vector<int32_t> added;
    for (int32_t s = n_capacity() - 1; s >= 0 && (int32_t) added.size() < n; --s) {
        if (!enabled[s]) {
            enabled[s] = 1;
            touched[s] = 0;
            added.push_back(s);
        }
    }
    free_slots.insert(free_slots.begin(), added.begin(), added.end());
    const int32_t done = (int32_t) added.size();
    n_untouched_ += done;
    n_enabled.fetch_add(done, std::memory_order_relaxed);
    return done;
}

void moetier_slots::disable(int32_t s) noexcept {
    stop_populate();
    enabled[s] = 0;
    if (touched[s]) {
        for (const ggml_tensor * t : tensors) {
            mem.release((size_t) ((const uint8_t *) t->data - (const uint8_t *) mem.data()) + (size_t) s * t->nb[2],
                        t->nb[2]);
        }
    } else {
        --n_untouched_;
    }
    touched[s] = 0;
}

int32_t moetier_slots::shrink(int32_t n, int32_t n_keep, const moetier_policy_ctx & pctx) noexcept {
    // never below the floor, and n_keep slots stay free or evictable: the layer being resolved must
    // find its misses a slot (pinned slots, reads in flight and held ones cannot give one)
    int32_t n_stuck = 0;
    for (int32_t s = 0; s < n_capacity(); ++s) {
        n_stuck += enabled[s] && (pinned[s] || readers[s] >= 0 || holds[s]);
    }
    n = std::min(n, n_slots() - std::max(n_floor, n_stuck + n_keep));
    if (n <= 0) {
        return 0;
    }
    // the free slots first, from the front (the last to be used: untouched ones if any)
    const int32_t n_free = std::min<int32_t>(n, (int32_t) free_slots.size());
    for (int32_t i = 0; i < n_free; ++i) {
        disable(free_slots[i]);
    }
    free_slots.erase(free_slots.begin(), free_slots.begin() + n_free);
    int32_t done = n_free;
    while (done < n) {
        const int32_t s = pick_victim(pctx);
        if (s < 0) {
            break;
        }
        forget(s);
        disable(s);
        ++done;
    }
    n_enabled.fetch_sub(done, std::memory_order_relaxed);
    return done;
}

bool moetier_slots_find_version(const moetier_slots & hi,
                                const moetier_slots & lo,
                                int32_t               il,
                                int32_t               e,
                                moetier_need          need,
                                moetier_precision &   prec,
                                int32_t &             s) {
    const int32_t hs = hi.find(il, e);
    if (hs >= 0) {
        prec = MOETIER_PRECISION_HIGH;
        s    = hs;
        return true;
    }
    const int32_t ls = lo.find(il, e);
    if (need < MOETIER_NEED_HIGH && ls >= 0) {
        prec = MOETIER_PRECISION_LOW;
        s    = ls;
        return true;
    }
    return false;
}
