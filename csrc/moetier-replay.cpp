#include "moetier-replay.h"

#include "moetier-cache.h"
#include "moetier-impl.h"

#include <algorithm>
#include <memory>
#include <stdexcept>

moetier_layer_stats moetier_replay(const moetier_replay_params &       p,
                                   const int32_t *                     ids,
                                   const float *                       weights,
                                   int64_t                             n_tokens,
                                   const std::vector<int64_t> &        seq_starts,
                                   std::vector<moetier_decision_row> * decisions) {
    if (p.n_layers < 1 || p.n_expert < 1 || p.n_used < 1 || p.n_used > p.n_expert || p.bytes_high == 0) {
        throw std::invalid_argument(
            "replay: n_layers, n_expert, n_used and bytes_high must be positive, n_used <= n_expert");
    }
    if ((int64_t) p.n_expert * p.n_layers > INT32_MAX) {  // the cache's keys and slot counts are int32
        throw std::invalid_argument(format("replay: %d experts x %d layers is more experts than a cache holds (%d)",
                                           p.n_expert, p.n_layers, INT32_MAX));
    }
    if (p.n_slots_high < p.n_expert || p.n_slots_low < 0 || (p.n_slots_low > 0 && p.bytes_low == 0)) {
        throw std::invalid_argument(
            format("replay: %d high slots is below one layer's %d experts, or low slots without "
                   "low bytes",
                   p.n_slots_high, p.n_expert));
    }
    for (int64_t i = 0; i < n_tokens * p.n_layers * p.n_used; ++i) {
        if (ids[i] < 0 || ids[i] >= p.n_expert) {
            throw std::invalid_argument(
                format("replay: expert id %d at position %lld is out of range", ids[i], (long long) i));
        }
    }
    // the offline policies look ahead: every use of every expert, in the cache's ticks
    moetier_future future;
    if (moetier_policy_is_offline(p.policy) || decisions) {
        future.bytes_high = p.bytes_high;
        future.bytes_low  = p.bytes_low;
        future.has_low    = p.n_slots_low > 0;
        future.uses.assign(p.n_layers, std::vector<std::vector<moetier_future::use>>(p.n_expert));
        std::vector<moetier_need> needs(p.n_used);
        for (int64_t t = 0; t < n_tokens; ++t) {
            for (int32_t il = 0; il < p.n_layers; ++il) {
                const int64_t off = (t * p.n_layers + il) * p.n_used;
                moetier_precision_needs(p.rule, weights ? weights + off : nullptr, p.n_used, needs.data());
                const uint64_t tick = (uint64_t) (t * p.n_layers + il) + 1;  // resolve counts before it runs
                for (int32_t k = 0; k < p.n_used; ++k) {
                    auto & v = future.uses[il][ids[off + k]];
                    if (!v.empty() && v.back().tick == tick) {
                        v.back().need = std::max(v.back().need, (uint8_t) needs[k]);
                    } else {
                        v.push_back({ tick, (uint8_t) needs[k] });
                    }
                }
            }
        }
    }
    moetier_policy_env env;
    env.future = &future;
    env.record = decisions;
    std::string err;
    if (!moetier_policy_create(p.policy, p.weights, env, &err)) {
        throw std::invalid_argument("replay: " + err);
    }

    // one projection standing for a whole expert: the bookkeeping only needs its byte sizes
    moetier_store_proj sp;
    sp.bytes_high = p.bytes_high;
    sp.bytes_low  = p.bytes_low;
    moetier_proj proj;
    proj.name  = "expert";
    proj.bytes = p.bytes_high;
    proj.store = &sp;

    const int32_t n_slots[2] = { std::min(p.n_slots_high, p.n_expert * p.n_layers),
                                 std::min(p.n_slots_low, p.n_expert * p.n_layers) };
    moetier_cache cache(p.n_expert, n_slots, p.rule, p.policy, p.weights, { proj }, /*simulate =*/true, env);
    cache.set_n_model_layers(p.n_layers);
    if (p.n_slots_vram > 0) {
        if (p.n_slots_vram < p.n_expert) {
            throw std::invalid_argument(
                format("replay: %d VRAM slots is below one layer's %d experts", p.n_slots_vram, p.n_expert));
        }
        cache.set_vram(nullptr, false, false, std::min(p.n_slots_vram, p.n_expert * p.n_layers), 0, p.n_used, false,
                       p.policy, p.weights);
    }
    std::vector<std::unique_ptr<moetier_layer>> layers;
    for (int32_t il = 0; il < p.n_layers; ++il) {
        layers.push_back(std::make_unique<moetier_layer>());
        layers.back()->il    = il;
        layers.back()->projs = { proj };
        cache.add_layer(layers.back().get());
    }

    std::vector<int32_t> out(2 * p.n_used);
    std::vector<int32_t> vout(2 * p.n_used);
    size_t               next_seq = 0;
    const size_t         row      = (size_t) p.n_used * sizeof(int32_t);
    for (int64_t t = 0; t < n_tokens; ++t) {
        while (next_seq < seq_starts.size() && seq_starts[next_seq] <= t) {
            if (seq_starts[next_seq] == t) {
                cache.reset_sequence();
            }
            ++next_seq;
        }
        for (int32_t il = 0; il < p.n_layers; ++il) {
            const int64_t off = (t * p.n_layers + il) * p.n_used;
            cache.resolve(*layers[il], ids + off, weights ? weights + off : nullptr, p.n_used, 1, row, row, out.data(),
                          false);
            if (p.n_slots_vram > 0) {
                cache.upload(*layers[il], out.data(), p.n_used, 1, nullptr, false, vout.data(), false);
            }
        }
    }
    cache.sync();

    moetier_layer_stats total = {};
    for (const auto & l : layers) {
        moetier_stats_add(total, l->stats);
    }
    total.layer = -1;
    return total;
}
