#include "moetier-prefetch.h"

#include "moetier-impl.h"
#include "moetier-read.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

moetier_prefetch_stacked::moetier_prefetch_stacked(const std::vector<moetier_prefetch_layer> & layers,
                                                   int32_t                                     depth_,
                                                   int32_t                                     n_expert_,
                                                   moetier_slots &                             hi,
                                                   moetier_slots &                             lo,
                                                   moetier_io_pool &                           io_,
                                                   const moetier_precision_rule &              rule_,
                                                   float                                       waste_,
                                                   bool                                        gate_) :
    n_expert(n_expert_),
    depth(depth_),
    slots{ &hi, &lo },
    io(io_),
    rule(rule_),
    waste(std::max(0.0f, waste_)),
    gate(gate_) {
    // the ceiling: two walks' reads of the largest expert. It starts empty: the first reads wait
    // for the bytes of the first misses, and the bound holds from the first token on.
    uint64_t expert_max = 0;
    for (const auto & l : layers) {
        expert_max = std::max(expert_max, moetier_read_bytes(*l.layer, MOETIER_PRECISION_HIGH));
    }
    credit_max             = (int64_t) (2 * (uint64_t) std::max(1, io.prefetch_depth()) * expert_max);
    size_t  n_stack        = 0;
    int32_t n_model_layers = 0;
    for (const auto & l : layers) {
        n_stack += l.next.empty() ? 0 : 1;
        n_model_layers = std::max(n_model_layers, l.layer->il + 1);
        for (const moetier_layer * t : l.next) {
            n_model_layers = std::max(n_model_layers, t->il + 1);
        }
    }
    states.resize(n_model_layers);
    for (const auto & l : layers) {
        states[l.layer->il].layer = l.layer;
    }
    pred_need.assign(n_expert, MOETIER_NEED_NONE);
    pred_w.assign(n_expert, 0.0f);
    pred_rank.reserve(n_expert);
    pred_row.assign(n_expert, 0.0f);
    pred_sel.assign(n_expert, 0.0f);
    if (n_stack == 0) {
        return;
    }

    ggml_init_params ip = {
        /*.mem_size   =*/ggml_tensor_overhead() * (n_stack + 1),
        /*.mem_buffer =*/nullptr,
        /*.no_alloc   =*/true,
    };
    router_ctx.reset(ggml_init(ip));
    if (!router_ctx) {
        throw std::runtime_error("failed to create the stacked router context");
    }
    int64_t n_embd = 0;
    for (const auto & l : layers) {
        if (l.next.empty()) {
            continue;
        }
        const ggml_tensor * g = l.routers[0];
        if (g == nullptr) {
            throw std::runtime_error(format("prefetch: layer %d has no router (ffn_gate_inp)", l.next[0]->il));
        }
        n_embd = g->ne[0];
        ggml_tensor * t =
            ggml_new_tensor_2d(router_ctx.get(), GGML_TYPE_F32, n_embd, (int64_t) l.next.size() * n_expert);
        ggml_format_name(t, "moetier_router_stack-%d", l.layer->il);
        states[l.layer->il].router_stack = t;
    }
    router_buf.reset(ggml_backend_alloc_ctx_tensors_from_buft(router_ctx.get(), ggml_backend_cpu_buffer_type()));
    if (!router_buf) {
        throw std::runtime_error("failed to allocate the stacked routers");
    }

    std::vector<uint8_t> raw;
    for (const auto & l : layers) {
        layer_state & st = states[l.layer->il];
        if (!st.router_stack) {
            continue;
        }
        float * dst = (float *) st.router_stack->data;
        for (size_t j = 0; j < l.next.size(); ++j) {
            const ggml_tensor * g = l.routers[j];
            if (g == nullptr || g->ne[0] != n_embd || g->ne[1] != n_expert) {
                throw std::runtime_error(
                    format("prefetch: the router of layer %d is missing or has another shape", l.next[j]->il));
            }
            const auto * traits = ggml_get_type_traits(g->type);
            if (g->type != GGML_TYPE_F32 && traits->to_float == nullptr) {
                throw std::runtime_error(
                    format("prefetch: the router of layer %d has type %s, which cannot be read back", l.next[j]->il,
                           ggml_type_name(g->type)));
            }
            raw.resize(ggml_nbytes(g));
            if (g->buffer != nullptr) {
                ggml_backend_tensor_get(g, raw.data(), 0, raw.size());
            } else {
                memcpy(raw.data(), g->data, raw.size());  // a fitted map: host memory of its GGUF context
            }
            float * out = dst + j * n_expert * n_embd;
            if (g->type == GGML_TYPE_F32) {
                memcpy(out, raw.data(), (size_t) n_expert * n_embd * sizeof(float));
            } else {
                for (int64_t e = 0; e < n_expert; ++e) {
                    traits->to_float(raw.data() + e * g->nb[1], out + e * n_embd, n_embd);
                }
            }
        }
        st.next = l.next;
        st.bias.assign(l.next.size(), {});
        for (size_t j = 0; j < l.next.size() && j < l.biases.size(); ++j) {
            if (l.biases[j] != nullptr) {
                st.bias[j].assign(l.biases[j], l.biases[j] + n_expert);
            }
        }
        st.sigmoid = l.sigmoid;
        st.probs_bias.assign(l.next.size(), {});
        for (size_t j = 0; j < l.next.size() && j < l.probs_biases.size(); ++j) {
            if (!l.probs_biases[j].empty() && l.probs_biases[j].size() != (size_t) n_expert) {
                throw std::runtime_error(
                    format("prefetch: the selection bias of layer %d has %zu values for %d experts", l.next[j]->il,
                           l.probs_biases[j].size(), n_expert));
            }
            st.probs_bias[j] = l.probs_biases[j];
        }
        for (const moetier_layer * t : l.next) {
            layer_state & ts = states[t->il];
            ts.pred_set.assign(depth, std::vector<uint8_t>(n_expert, 0));
            ts.pred_pass.assign(depth, 0);
            ts.pred_top1.assign(depth, -1);
        }
    }
}

ggml_tensor * moetier_prefetch_stacked::router_stack(int32_t il) const {
    return il >= 0 && (size_t) il < states.size() ? states[il].router_stack : nullptr;
}

void moetier_prefetch_stacked::begin(const moetier_layer & layer,
                                     const int32_t *       ids,
                                     int64_t               n_used,
                                     bool                  check,
                                     uint64_t              pass_) {
    if (pass_ != pass) {
        gate.step(pass_, check, moetier_time_us());
    }
    pass       = pass_;
    cur        = &layer;
    cur_demand = layer.stats.n_bytes_read;
    cur_used   = 0;
    settle_zombies();
    if (!check) {
        return;
    }
    const layer_state & st = states[layer.il];
    for (size_t j = 0; j < st.pred_pass.size() && j < MOETIER_MAX_PREFETCH; ++j) {
        if (st.pred_pass[j] != pass) {
            continue;
        }
        const std::vector<uint8_t> & pred = st.pred_set[j];
        int64_t                      n_in = 0;
        for (int64_t k = 0; k < n_used; ++k) {
            n_in += pred[ids[k]] ? 1 : 0;
        }
        ++pf.n_pred[j];
        pf.n_top1[j] += st.pred_top1[j] == ids[0];
        pf.n_allk[j] += n_in == n_used;
        pf.n_any[j] += n_in > 0;
    }
}

moetier_prefetch_use moetier_prefetch_stacked::use(moetier_precision prec, int32_t s, int32_t * id_out) {
    moetier_slots & set = *slots[prec];
    const int32_t   id  = set.reader(s);
    if (id < 0) {
        return MOETIER_PREFETCH_USE_READY;
    }
    set.set_reader(s, -1);
    // a read an earlier layer did not need, still running: counted as waste then, and its bytes stay
    // spent; this layer only waits for it (settle_zombies sees its reader gone)
    const bool was_wasted = is_zombie(prec, s);
    if (!was_wasted) {
        // needed: its bytes go back to the byte cap (a read the layer then does itself counts as its demand)
        refund(*cur, prec);
    }
    if (io.claim(id)) {
        ++pf.n_claimed;
        return MOETIER_PREFETCH_USE_READ;
    }
    const int32_t st = io.state(id);
    if (st == MOETIER_IO_RUNNING) {
        if (!was_wasted) {
            ++pf.n_hits;
            ++pf.n_waits;
            cur_used += moetier_read_bytes(*cur, prec);
        }
        *id_out = id;
        return MOETIER_PREFETCH_USE_WAIT;
    }
    io.release(id);
    if (st == MOETIER_IO_DONE) {
        if (!was_wasted) {
            ++pf.n_hits;
            cur_used += moetier_read_bytes(*cur, prec);
        }
        return MOETIER_PREFETCH_USE_READY;
    }
    return MOETIER_PREFETCH_USE_READ;  // failed: read again
}

void moetier_prefetch_stacked::landing(const moetier_layer & layer, std::vector<moetier_landing> & out) const {
    for (const moetier_layer * T : states[layer.il].next) {
        for (const auto & [prec, s] : states[T->il].prefetched) {
            const int32_t id = slots[prec]->reader(s);
            if (id >= 0 && slots[prec]->is_unchecked(s) && out.size() < out.capacity()) {
                out.push_back({ T, prec, s, slots[prec]->key(s).expert, id });
            }
        }
    }
}

void moetier_prefetch_stacked::refund(const moetier_layer & layer, moetier_precision prec) {
    credit = std::min(credit_max, credit + (int64_t) moetier_read_bytes(layer, prec));
}

void moetier_prefetch_stacked::settle(const moetier_layer & layer) {
    layer_state &  st     = states[layer.il];
    // what demand reads alone would have moved for this layer: its own reads and the prefetches it used
    const uint64_t needed = layer.stats.n_bytes_read - cur_demand + cur_used;
    credit                = std::min(credit_max, credit + (int64_t) (waste * (double) needed));
    for (const auto & [prec, s] : st.prefetched) {
        moetier_slots & set = *slots[prec];
        set.hold(s, false);
        const int32_t id = set.reader(s);
        if (id < 0) {
            unhold(prec);
            continue;  // used by this layer, or a hold of an expert that was already cached
        }
        if (io.claim(id)) {
            unhold(prec);
            set.set_reader(s, -1);
            set.drop(s);
            ++pf.n_cancelled;
            refund(layer, prec);  // never read: it cost nothing
            continue;
        }
        ++pf.n_wasted;
        pf.bytes_wasted += moetier_read_bytes(layer, prec);
        const int32_t state = io.state(id);
        if (state == MOETIER_IO_RUNNING) {
            zombies.push_back({ prec, s });  // keeps its reader: the slot is not reused until the read ends
            continue;
        }
        unhold(prec);
        set.set_reader(s, -1);
        io.release(id);
        if (state == MOETIER_IO_FAILED) {
            set.drop(s);
        }
    }
    st.prefetched.clear();
}

bool moetier_prefetch_stacked::is_zombie(moetier_precision prec, int32_t s) const {
    for (const auto & z : zombies) {
        if (z.first == prec && z.second == s) {
            return true;
        }
    }
    return false;
}

bool moetier_prefetch_stacked::may_hold(moetier_precision prec) const {
    // a layer's loads fall back to the high pool when the low one has no room: only it is bounded
    return prec != MOETIER_PRECISION_HIGH || n_held_high < slots[MOETIER_PRECISION_HIGH]->n_slots() - n_expert;
}

void moetier_prefetch_stacked::unhold(moetier_precision prec) {
    n_held_high -= prec == MOETIER_PRECISION_HIGH ? 1 : 0;
}

void moetier_prefetch_stacked::settle_zombies() {
    for (size_t i = 0; i < zombies.size();) {
        const auto [prec, s] = zombies[i];
        moetier_slots & set  = *slots[prec];
        const int32_t   id   = set.reader(s);
        const int32_t   st   = id >= 0 ? io.state(id) : MOETIER_IO_DONE;
        if (st == MOETIER_IO_RUNNING || st == MOETIER_IO_QUEUED) {
            ++i;
            continue;
        }
        if (id >= 0) {
            io.release(id);
            set.set_reader(s, -1);
        }
        if (st == MOETIER_IO_FAILED) {
            set.drop(s);
        }
        unhold(prec);
        zombies[i] = zombies.back();
        zombies.pop_back();
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

void moetier_prefetch_stacked::predict(const moetier_layer &      layer,
                                       const float *              logits,
                                       int64_t                    n_tokens,
                                       size_t                     nb1,
                                       int32_t                    n_used,
                                       const moetier_policy_ctx & ctx) noexcept {
    const layer_state & ls = states[layer.il];
    if (ls.next.empty() || n_tokens <= 0 || n_used <= 0) {
        return;
    }
    const int32_t E = n_expert;
    int32_t       top[64];
    float         w[64];
    moetier_need  nd_k[64];
    // reads started per walk: one per prefetch lane. More would wait in the queue, each holding a
    // slot it evicted a cached expert for, and a wrong one is cancelled when its layer resolves:
    // the eviction is all that is left of it.
    const int32_t max_reads = std::max(1, io.prefetch_depth());
    // the disk is behind when reads of earlier walks have not started: keep the queue within one
    // walk's reads
    const int32_t n_free    = std::max(0, max_reads - io.queued_prefetches());
    int32_t       n_reads   = 0;
    int32_t       n_turned  = 0;  // predicted misses this walk did not read (busy disk, byte cap)
    // standing back (the gate): the predictions are still made and scored, nothing is held or read
    bool          walking   = gate.reads();
    for (size_t j = 0; j < ls.next.size(); ++j) {
        moetier_layer & T  = *ls.next[j];
        layer_state &   ts = states[T.il];
        std::fill(pred_need.begin(), pred_need.end(), MOETIER_NEED_NONE);
        std::fill(pred_w.begin(), pred_w.end(), 0.0f);
        for (int64_t t = 0; t < n_tokens; ++t) {
            const float * row = (const float *) ((const char *) logits + t * nb1) + j * E;
            if (!ls.bias[j].empty()) {
                for (int32_t e = 0; e < E; ++e) {
                    pred_row[e] = row[e] + ls.bias[j][e];
                }
                row = pred_row.data();
            }
            const float * sel = row;
            if (!ls.probs_bias[j].empty() && ls.sigmoid) {
                // the model chooses by its probabilities plus its selection bias (llama.cpp's exp_probs_b)
                for (int32_t e = 0; e < E; ++e) {
                    pred_sel[e] = 1.0f / (1.0f + std::exp(-row[e])) + ls.probs_bias[j][e];
                }
                sel = pred_sel.data();
            } else if (!ls.probs_bias[j].empty()) {
                float mx = row[0];
                for (int32_t e = 1; e < E; ++e) {
                    mx = std::max(mx, row[e]);
                }
                float z = 0.0f;
                for (int32_t e = 0; e < E; ++e) {
                    pred_sel[e] = std::exp(row[e] - mx);
                    z += pred_sel[e];
                }
                for (int32_t e = 0; e < E; ++e) {
                    pred_sel[e] = pred_sel[e] / z + ls.probs_bias[j][e];
                }
                sel = pred_sel.data();
            }
            const int32_t k   = moetier_top_k(sel, E, n_used, top);
            // the gate weights of the predicted experts, from the unbiased logits as the model's:
            // a softmax over them (or their sigmoids), normalised (the precision rule takes shares)
            float         ref = row[top[0]];
            for (int32_t i = 1; i < k; ++i) {
                ref = std::max(ref, row[top[i]]);
            }
            float sum = 0.0f;
            for (int32_t i = 0; i < k; ++i) {
                w[i] = ls.sigmoid ? 1.0f / (1.0f + std::exp(-row[top[i]])) : std::exp(row[top[i]] - ref);
                sum += w[i];
            }
            for (int32_t i = 0; i < k; ++i) {
                w[i] /= sum;
            }
            moetier_precision_needs(rule, w, k, nd_k);
            for (int32_t i = 0; i < k; ++i) {
                pred_need[top[i]] = std::max(pred_need[top[i]], nd_k[i]);
                pred_w[top[i]]    = std::max(pred_w[top[i]], w[i]);
            }
            if (n_tokens == 1 && j < ts.pred_pass.size()) {
                // a prediction made j + 1 layers ahead, checked when T resolves in this pass
                ts.pred_pass[j] = ctx.pass;
                ts.pred_top1[j] = top[0];
                for (int32_t e = 0; e < E; ++e) {
                    ts.pred_set[j][e] = pred_need[e] != MOETIER_NEED_NONE;
                }
            }
        }
        if (!walking) {
            continue;
        }
        // surest first: with few reads in flight, the likeliest experts are the ones read
        pred_rank.clear();
        for (int32_t e = 0; e < E; ++e) {
            if (pred_need[e] != MOETIER_NEED_NONE) {
                pred_rank.push_back(e);
            }
        }
        std::sort(pred_rank.begin(), pred_rank.end(),
                  [&](int32_t a, int32_t b) { return pred_w[a] != pred_w[b] ? pred_w[a] > pred_w[b] : a < b; });
        // the cached ones are held against eviction until T runs (all of them, before any read
        // takes a slot: a read must not evict a predicted expert of the same walk)
        bool all_cached = true;
        for (const int32_t e : pred_rank) {
            moetier_precision prec = MOETIER_PRECISION_HIGH;
            int32_t           s    = -1;
            if (moetier_slots_find_version(*slots[0], *slots[1], T.il, e, pred_need[e], prec, s)) {
                // (a slot still being read for an earlier layer that did not need it cannot be evicted
                // before its read ends: not held)
                if (!slots[prec]->is_held(s) && slots[prec]->reader(s) < 0 && may_hold(prec)) {
                    slots[prec]->hold(s, true);
                    ts.prefetched.push_back({ prec, s });
                    n_held_high += prec == MOETIER_PRECISION_HIGH ? 1 : 0;
                }
            } else if (pred_need[e] != MOETIER_NEED_SKIP) {  // a skip need is not read on a miss
                all_cached = false;
            }
        }
        // the victim of a read is chosen as of now, layer's resolve: with T as the clock's layer, the
        // experts of the layers between (needed before T) looked a whole pass away, and were evicted
        const moetier_policy_ctx & tctx = ctx;
        for (const int32_t e : pred_rank) {
            const moetier_need nd = pred_need[e];
            if (n_reads + n_turned == max_reads) {
                break;
            }
            moetier_precision prec = MOETIER_PRECISION_HIGH;
            int32_t           s    = -1;
            if (nd == MOETIER_NEED_SKIP || moetier_slots_find_version(*slots[0], *slots[1], T.il, e, nd, prec, s)) {
                continue;
            }
            prec = nd == MOETIER_NEED_LOW && slots[MOETIER_PRECISION_LOW]->n_slots() > 0 ? MOETIER_PRECISION_LOW :
                                                                                           MOETIER_PRECISION_HIGH;
            const int64_t bytes = (int64_t) moetier_read_bytes(T, prec);
            if (n_reads >= n_free) {
                ++pf.n_busy;
                ++n_turned;
                continue;
            }
            if (credit < bytes) {
                ++pf.n_capped;
                ++n_turned;
                continue;
            }
            if (!may_hold(prec)) {
                break;  // the pool has no slot to spare beyond one layer's experts
            }
            moetier_slots & set = *slots[prec];
            s                   = set.take({ T.il, e }, tctx);
            if (s < 0) {
                continue;
            }
            moetier_io_task task;
            task.layer       = &T;
            task.prec        = prec;
            task.expert      = e;
            task.slot        = s;
            task.bytes_done  = &bytes_read;
            const int32_t id = io.submit(task);
            if (id < 0) {
                set.drop(s);
                continue;
            }
            set.set_reader(s, id);
            set.set_unchecked(s, io.uses_uring() && moetier_read_checked(T, prec));  // checked where a layer uses it
            set.hold(s, true);
            ts.prefetched.push_back({ prec, s });
            n_held_high += prec == MOETIER_PRECISION_HIGH ? 1 : 0;
            credit -= bytes;  // held until T runs: given back if T uses it or it is cancelled
            ++pf.n_issued;
            ++n_reads;
        }
        walking = all_cached;
    }
}

void moetier_prefetch_stacked::add_stats(moetier_prefetch_stats & out) const {
    out.n_issued += pf.n_issued;
    out.n_hits += pf.n_hits;
    out.n_waits += pf.n_waits;
    out.n_claimed += pf.n_claimed;
    out.n_cancelled += pf.n_cancelled;
    out.n_wasted += pf.n_wasted;
    out.bytes_read += bytes_read.load(std::memory_order_relaxed);
    out.bytes_wasted += pf.bytes_wasted;
    out.n_capped += pf.n_capped;
    out.n_busy += pf.n_busy;
    // one gate per pool group (a model has one but in rare layouts), and each sees every decode
    // step: the most steps and the slowest group's times
    out.n_steps_on  = std::max(out.n_steps_on, gate.n_on);
    out.n_steps_off = std::max(out.n_steps_off, gate.n_off);
    out.step_us_on  = std::max(out.step_us_on, (uint64_t) gate.us_on);
    out.step_us_off = std::max(out.step_us_off, (uint64_t) gate.us_off);
    for (int j = 0; j < MOETIER_MAX_PREFETCH; ++j) {
        out.n_pred[j] += pf.n_pred[j];
        out.n_top1[j] += pf.n_top1[j];
        out.n_allk[j] += pf.n_allk[j];
        out.n_any[j] += pf.n_any[j];
    }
}

void moetier_prefetch_stacked::reset_stats() {
    pf         = {};
    gate.n_on  = 0;
    gate.n_off = 0;
    bytes_read.store(0, std::memory_order_relaxed);
}
