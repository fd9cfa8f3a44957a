#include "moetier-loader.h"

#include "moetier-impl.h"

#include <algorithm>
#include <cinttypes>
#include <map>
#include <stdexcept>

// [TAG_MOETIER_EXTRA] served tensors carry their layer in ggml_tensor::extra: they are never
// allocated in a backend buffer, so no backend owns that field for them
static constexpr uint32_t MOETIER_LAYER_MAGIC = 0x4d4f4554; // "MOET"

struct moetier_layer_tag {
    uint32_t        magic = MOETIER_LAYER_MAGIC;
    moetier_layer * layer = nullptr;
};

moetier_model::moetier_model(const moetier_params & params, const std::vector<std::string> & paths_)
        : paths(paths_) {
    cache_bytes = params.cache_bytes;
    direct_io   = params.direct_io;
    policy_name = params.policy && params.policy[0] ? params.policy : "lru";
    if (!moetier_policy_create(policy_name)) {
        std::string names;
        for (const char * const * n = moetier_policy_names(); *n; ++n) {
            names += names.empty() ? *n : std::string(", ") + *n;
        }
        throw std::runtime_error(format("unknown expert cache policy '%s'; available: %s", policy_name.c_str(), names.c_str()));
    }
    if (paths.empty()) {
        throw std::runtime_error("no model file");
    }

    if (params.store_dir && params.store_dir[0]) {
        if (paths.size() > 1) {
            throw std::runtime_error("expert stores of split GGUF models are not supported; merge the splits first");
        }
        store = std::make_unique<moetier_store>(params.store_dir, moetier_model_identity_compute(paths[0]));
        store_file = std::make_unique<moetier_file>(store->data_path(), direct_io);
    } else {
        for (const auto & p : paths) {
            files.push_back(std::make_unique<moetier_file>(p, direct_io));
        }
    }

    ggml_init_params ip = {
        /*.mem_size   =*/ ggml_tensor_overhead() * 4096,
        /*.mem_buffer =*/ nullptr,
        /*.no_alloc   =*/ true,
    };
    meta_ctx = ggml_init(ip);
    if (!meta_ctx) {
        throw std::runtime_error("failed to create the expert metadata context");
    }
}

moetier_model::~moetier_model() {
    caches.clear();
    if (meta_ctx) {
        for (ggml_tensor * t = ggml_get_first_tensor(meta_ctx); t; t = ggml_get_next_tensor(meta_ctx, t)) {
            delete (moetier_layer_tag *) t->extra;
            t->extra = nullptr;
        }
        ggml_free(meta_ctx);
    }
}

moetier_layer * moetier_model::layer_of(const ggml_tensor * t) {
    if (t == nullptr || t->extra == nullptr || t->buffer != nullptr) {
        return nullptr;
    }
    const moetier_layer_tag * tag = (const moetier_layer_tag *) t->extra;
    return tag->magic == MOETIER_LAYER_MAGIC ? tag->layer : nullptr;
}

ggml_tensor * moetier_model::create_tensor(const std::string & name, const ggml_tensor * cur, uint16_t file_idx, size_t offs) {
    int32_t il = -1;
    const std::string proj = moetier_expert_tensor_proj(name, &il);
    if (proj.empty() || ggml_n_dims(cur) != 3) {
        return nullptr;
    }
    if (n_expert == 0) {
        n_expert = (int32_t) cur->ne[2];
    } else if (n_expert != cur->ne[2]) {
        throw std::runtime_error(format("tensor %s has %" PRId64 " experts, other layers have %d; per-layer expert counts are not supported",
                name.c_str(), cur->ne[2], n_expert));
    }

    moetier_layer * layer = nullptr;
    for (auto & l : layers) {
        if (l->il == il) {
            layer = l.get();
        }
    }
    if (!layer) {
        layers.push_back(std::make_unique<moetier_layer>());
        layer = layers.back().get();
        layer->il = il;
    }

    moetier_proj p;
    p.name  = proj;
    p.bytes = cur->nb[2];
    if (store) {
        p.store = store->find(il, proj);
        if (!p.store) {
            throw std::runtime_error(format("%s: the store has no entry for %s; re-run `moetier pack` on this model",
                    store->manifest_path().c_str(), name.c_str()));
        }
        if (p.store->type_high != cur->type || p.store->ne0 != cur->ne[0] || p.store->ne1 != cur->ne[1] ||
            (int64_t) p.store->offset_high.size() != cur->ne[2] || p.store->bytes_high != p.bytes) {
            throw std::runtime_error(format("%s: entry for %s does not match the model (type %s %" PRId64 "x%" PRId64 " vs %s %" PRId64 "x%" PRId64 "); "
                    "re-run `moetier pack` on this model", store->manifest_path().c_str(), name.c_str(),
                    ggml_type_name(p.store->type_high), p.store->ne0, p.store->ne1, ggml_type_name(cur->type), cur->ne[0], cur->ne[1]));
        }
        p.file = store_file.get();
    } else {
        if (file_idx >= files.size()) {
            throw std::runtime_error(format("tensor %s is in split %u, but only %zu files were given", name.c_str(), file_idx, files.size()));
        }
        p.file   = files[file_idx].get();
        p.offset = offs;
    }

    ggml_tensor * t = ggml_dup_tensor(meta_ctx, cur);
    ggml_set_name(t, name.c_str());
    t->extra = new moetier_layer_tag{ MOETIER_LAYER_MAGIC, layer };
    p.meta = t;
    layer->projs.push_back(p);
    expert_bytes += ggml_nbytes(cur);
    return t;
}

void moetier_model::finish_load() {
    if (layers.empty()) {
        throw std::runtime_error("the model has no expert tensors (blk.N.ffn_*_exps.weight): the expert cache needs a MoE model; "
                "drop the expert cache option for dense models");
    }
    std::sort(layers.begin(), layers.end(), [](const auto & a, const auto & b) { return a->il < b->il; });

    // pool groups: layers whose projections agree in name, type and shape share slots
    std::map<std::string, std::vector<moetier_layer *>> groups;
    for (auto & l : layers) {
        std::sort(l->projs.begin(), l->projs.end(), [](const moetier_proj & a, const moetier_proj & b) { return a.name < b.name; });
        std::string sig;
        for (const auto & p : l->projs) {
            sig += format("%s:%s:%" PRId64 "x%" PRId64 ";", p.name.c_str(), ggml_type_name(p.meta->type), p.meta->ne[0], p.meta->ne[1]);
        }
        groups[sig].push_back(l.get());
    }

    // every group needs one layer's experts (a ubatch may route to all of them); the rest of the
    // budget is split in proportion to the group's share of expert bytes
    struct plan { std::vector<moetier_layer *> layers; uint64_t slot_bytes; int64_t n_slots; };
    std::vector<plan> plans;
    uint64_t group_bytes_total = 0;
    min_cache_bytes = 0;
    for (auto & [sig, ls] : groups) {
        uint64_t sb = 0;
        for (const auto & p : ls[0]->projs) {
            sb += moetier_align_up(p.bytes);
        }
        plans.push_back({ ls, sb, n_expert });
        min_cache_bytes   += sb * (uint64_t) n_expert;
        group_bytes_total += sb * (uint64_t) n_expert * ls.size();
    }
    if (cache_bytes < min_cache_bytes) {
        throw std::runtime_error(format("expert cache budget %s is below the minimum %s (one layer's %d experts%s); "
                "use a budget of at least %" PRIu64 " bytes", moetier_format_bytes(cache_bytes).c_str(),
                moetier_format_bytes(min_cache_bytes).c_str(), n_expert, plans.size() > 1 ? " per pool group" : "",
                min_cache_bytes));
    }
    const uint64_t extra = cache_bytes - min_cache_bytes;
    for (auto & pl : plans) {
        const uint64_t share = (uint64_t) ((double) extra * (double) (pl.slot_bytes * n_expert * pl.layers.size()) / (double) group_bytes_total);
        const int64_t  max_slots = (int64_t) n_expert * (int64_t) pl.layers.size();
        pl.n_slots = std::min<int64_t>(max_slots, n_expert + (int64_t) (share / pl.slot_bytes));
    }

    // store reads: one vectored read per expert when its projections lie back to back in the file
    for (auto & l : layers) {
        if (!store || l->projs.size() > 8) {
            continue;
        }
        std::vector<int32_t> order(l->projs.size());
        for (size_t k = 0; k < order.size(); ++k) {
            order[k] = (int32_t) k;
        }
        std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
            return l->projs[a].store->offset_high[0] < l->projs[b].store->offset_high[0];
        });
        bool contiguous = true;
        for (int32_t e = 0; e < n_expert && contiguous; ++e) {
            for (size_t k = 1; k < order.size(); ++k) {
                const moetier_proj & a = l->projs[order[k - 1]];
                const moetier_proj & b = l->projs[order[k]];
                if (b.store->offset_high[e] != a.store->offset_high[e] + moetier_align_up(a.bytes)) {
                    contiguous = false;
                    break;
                }
            }
        }
        if (contiguous) {
            l->file_order = order;
        }
    }

    for (auto & pl : plans) {
        std::vector<moetier_proj> shapes = pl.layers[0]->projs;
        caches.push_back(std::make_unique<moetier_cache>(n_expert, (int32_t) pl.n_slots, moetier_policy_create(policy_name), shapes));
        moetier_cache * c = caches.back().get();
        for (moetier_layer * l : pl.layers) {
            c->add_layer(l);
            for (size_t k = 0; k < l->projs.size(); ++k) {
                l->projs[k].pool = c->pool(k);
            }
        }
    }

    uint64_t pool_bytes = 0;
    int64_t  n_slots    = 0;
    for (auto & c : caches) {
        pool_bytes += c->pool_bytes();
        n_slots    += c->n_slots();
    }
    MOETIER_LOG_INFO("%s: expert cache: %zu MoE layers x %d experts (%s), %" PRId64 " slots in %zu group(s) = %s, policy %s, reading %s%s\n",
            __func__, layers.size(), n_expert, moetier_format_bytes(expert_bytes).c_str(), n_slots, caches.size(),
            moetier_format_bytes(pool_bytes).c_str(), policy_name.c_str(),
            store ? store->dir().c_str() : paths[0].c_str(),
            (store ? store_file->direct() : files[0]->direct()) ? " (O_DIRECT)" : "");
}
