#pragma once

// HOBBIT's dynamic precision rule (eq. 2): what a token needs of each of its selected experts, from
// their gate weights. Used by resolve (the real weights) and by prefetch (the predicted ones).

#include "moetier-layer.h"

#include <cstdint>

struct moetier_precision_rule {
    float t1 = 1.0f;
    float t2 = 1.0f;

    // whether the rule can pick anything but high (given low copies or not)
    bool exact() const { return t1 >= 1.0f && t2 >= 1.0f; }
};

// HOBBIT's unimportance score of each selected expert: the normalised |weight| ranked above it (0 for
// the top-1; ties: the earlier k first; all 0 for a zero sum)
void moetier_precision_scores(const float * weights, int32_t n_used, float * scores);

// What a token needs of each of its n_used selected experts: score <= t1 high, <= t2 low, above
// skip; the top-1 is always high. weights == nullptr or a zero sum: all high.
void moetier_precision_needs(const moetier_precision_rule & rule,
                             const float *                  weights,
                             int32_t                        n_used,
                             moetier_need *                 needs);
