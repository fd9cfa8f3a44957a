#pragma once

// Trace replay: a recorded routing trace (per token and layer, the selected experts and their gate
// weights) run through the cache's own bookkeeping (precision rule, slot pools, policy, partition)
// in simulate mode: nothing is read, the counters say what would have been. For calibration tools.

#include "moetier-precision.h"
#include "moetier.h"
#include "policies/policies.h"

#include <cstdint>
#include <string>
#include <vector>

struct moetier_replay_params {
    int32_t                n_layers     = 0;  // served layers, in trace order
    int32_t                n_expert     = 0;
    int32_t                n_used       = 0;  // selected experts per token and layer
    uint64_t               bytes_high   = 0;  // bytes of one expert's high / low version
    uint64_t               bytes_low    = 0;
    int32_t                n_slots_high = 0;  // slots of the (single) pool group
    int32_t                n_slots_low  = 0;
    int32_t                n_slots_vram = 0;  // a VRAM tier over the cache (0: none), driven by the engine's tier code
    std::string            policy       = moetier_default_params().policy;
    moetier_policy_weights weights;
    moetier_precision_rule rule;
};

// ids: [n_tokens][n_layers][n_used]; weights: same shape or nullptr (all high). seq_starts: token
// indices where a new sequence starts (the policy's sequence records reset). decisions: if set,
// every eviction decision is logged there (policies/flashmoe.h). Returns the counters summed over
// layers (layer = -1). throws std::invalid_argument on bad parameters.
moetier_layer_stats moetier_replay(const moetier_replay_params &       p,
                                   const int32_t *                     ids,
                                   const float *                       weights,
                                   int64_t                             n_tokens,
                                   const std::vector<int64_t> &        seq_starts,
                                   std::vector<moetier_decision_row> * decisions = nullptr);
