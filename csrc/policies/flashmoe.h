#pragma once

// FlashMoE's learned eviction (paper 003, sec. 3): each cached expert is described by its recency
// and its frequency, normalised as the paper does ([1/r, f / max f]), and a small feed-forward
// network (3 layers, SiLU, hidden 128 in its Table 1) scores it; the highest score is evicted. The
// network is trained in Python (moetier train-policy) to imitate Belady's evictions and written to
// a small file that the policy loads.
//
// The paper's caches are per layer, as this cache's partition is. A network of three inputs adds
// the layer distance (d / n_layers, d: layers until the expert's layer runs again, HOBBIT's FLD) and
// chooses across layers, where the gap to Belady lies: which layer gives up a slot.

#include "policies.h"

#include <cstdint>
#include <string>
#include <vector>

static constexpr int32_t MOETIER_FLASHMOE_N_IN = 3;  // inputs recorded; a network uses the first 2 or 3

// The inputs of the network, per expert: r = forward passes since its last use + 1 (1: used in the
// current pass), f = passes that used it since the cache started, over the largest f of its layer.
class moetier_flashmoe_features {
  public:
    // expert k is used in the forward pass of ctx (counted once per pass)
    void use(const moetier_key & k, const moetier_policy_ctx & ctx);

    // [1/r, f / max f, d / n_layers] of expert k
    void of(const moetier_key & k, const moetier_policy_ctx & ctx, float out[MOETIER_FLASHMOE_N_IN]) const;

    uint64_t last_use(const moetier_key & k) const { return rec(k).last_tick; }

  private:
    struct record {
        uint64_t uses      = 0;
        uint64_t last_pass = 0;
        uint64_t last_tick = 0;
    };

    std::vector<std::vector<record>> records;   // [layer][expert]
    std::vector<uint64_t>            max_uses;  // [layer]

    record &       rec_mut(const moetier_key & k);
    const record & rec(const moetier_key & k) const;
};

// The scoring network: n_in -> hidden -> hidden -> 1, SiLU after the two hidden layers.
//
// File (little-endian): "MOETFMN1", uint32 n_in (2 or 3), uint32 n_hidden, then float32 w1[n_hidden][n_in],
// b1[n_hidden], w2[n_hidden][n_hidden], b2[n_hidden], w3[n_hidden], b3.
struct moetier_flashmoe_net {
    int32_t            n_in     = 2;  // 2: the paper's inputs (per-layer partition); 3: + layer distance
    int32_t            n_hidden = 0;
    std::vector<float> w1, b1, w2, b2, w3;
    float              b3 = 0.0f;

    // eviction score of one expert's inputs (higher: evict first)
    float score(const float * x) const;
};

// false with err set if path cannot be read or is not such a file (sizes checked before any read)
bool moetier_flashmoe_load(const std::string & path, moetier_flashmoe_net & net, std::string & err);

// One eviction decision as a replay records it for training: for each candidate slot, the
// network's inputs and how far ahead its expert's next use is (Belady's key; UINT64_MAX: never).
struct moetier_decision_row {
    int64_t  decision;  // index of the victim call
    float    x[MOETIER_FLASHMOE_N_IN];
    uint64_t next_use;  // ticks from this resolve to the next use (0: this resolve uses it)
    bool     chosen;    // the policy evicted this one
};
