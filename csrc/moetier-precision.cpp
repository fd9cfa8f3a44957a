#include "moetier-precision.h"

#include <algorithm>
#include <cmath>

void moetier_precision_scores(const float * weights, int32_t n_used, float * scores) {
    // n_used is small (<= 64 in practice): an insertion sort of indices by weight, descending
    int32_t       order[256];
    const int32_t n   = std::min<int32_t>(n_used, 256);
    double        sum = 0.0;
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
    double above = 0.0;  // normalised weight of the experts ranked above
    for (int32_t i = 0; i < n; ++i) {
        scores[order[i]] = (float) above;
        above += std::fabs(weights[order[i]]) / sum;
    }
}

void moetier_precision_needs(const moetier_precision_rule & rule,
                             const float *                  weights,
                             int32_t                        n_used,
                             moetier_need *                 needs) {
    std::fill(needs, needs + n_used, MOETIER_NEED_HIGH);
    if (weights == nullptr || rule.exact()) {
        return;
    }
    float         scores[256];
    const int32_t n = std::min<int32_t>(n_used, 256);
    moetier_precision_scores(weights, n, scores);
    for (int32_t k = 0; k < n; ++k) {
        // the top-1 scores 0 <= t1: always high
        needs[k] = scores[k] <= rule.t1 ? MOETIER_NEED_HIGH :
                   scores[k] <= rule.t2 ? MOETIER_NEED_LOW :
                                          MOETIER_NEED_SKIP;
    }
}
