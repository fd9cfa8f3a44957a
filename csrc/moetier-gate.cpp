#include "moetier-gate.h"

#include <algorithm>

moetier_prefetch_gate::moetier_prefetch_gate(bool enabled_, int32_t window_, int32_t rounds_, int32_t keep_) :
    enabled(enabled_),
    window(std::max(2, window_)),
    rounds(std::max(1, rounds_)),
    keep(std::max(1, keep_)) {}

void moetier_prefetch_gate::step(uint64_t pass, bool decode, int64_t now_us) {
    // the pass before ended now: a decode step followed by another is timed (a prompt or a new
    // request after it would add their own time)
    if (cur_timed && decode && pass == cur_pass + 1) {
        samples[cur_on ? 1 : 0].push_back(now_us - cur_start);
    }
    cur_pass  = pass;
    cur_start = now_us;
    cur_timed = false;
    cur_on    = true;
    if (!enabled || !decode) {
        return;
    }
    if (probing && win == 2 * rounds) {
        decide();
    }
    cur_on = on;
    (on ? n_on : n_off) += 1;
    if (!probing) {
        if (++idx >= keep) {
            probing = true;
            idx     = 0;
            win     = 0;
            on      = true;
            samples[0].clear();
            samples[1].clear();
        }
        return;
    }
    cur_timed = idx > 0;
    if (++idx == window) {
        idx = 0;
        ++win;
        on = win % 2 == 0;
    }
}

// the median of x (sorted in place); 0 if empty
static int64_t moetier_median(std::vector<int64_t> & x) {
    if (x.empty()) {
        return 0;
    }
    std::sort(x.begin(), x.end());
    const size_t n = x.size();
    return n % 2 ? x[n / 2] : (x[n / 2 - 1] + x[n / 2]) / 2;
}

void moetier_prefetch_gate::decide() {
    idx               = 0;
    win               = 0;
    // too few steps of an arm were timed (requests of a token or two): prefetch reads, as it
    // would without the gate, until the next probe
    const size_t need = (size_t) (window - 1);
    if (samples[0].size() < need || samples[1].size() < need) {
        on      = true;
        probing = false;
        return;
    }
    us_off  = moetier_median(samples[0]);
    us_on   = moetier_median(samples[1]);
    // prefetch keeps reading only if it is faster: its reads cost disk time and slots
    on      = us_on < us_off;
    probing = false;
}
