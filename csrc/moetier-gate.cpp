#include "moetier-gate.h"

#include <algorithm>
#include <cmath>

moetier_prefetch_gate::moetier_prefetch_gate(bool    enabled_,
                                             int32_t window_,
                                             int32_t rounds_,
                                             int32_t keep_,
                                             int32_t max_blocks_) :
    enabled(enabled_),
    window(std::max(1, window_)),
    rounds(std::max(2, rounds_ + rounds_ % 2)),  // even: a block is whole ABBA quartets
    keep(std::max(1, keep_)),
    max_blocks(std::max(1, max_blocks_)) {}

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
        win = 0;
        ++blocks;
        probing = !decide();
        if (!probing) {
            idx = 0;
        }
    }
    cur_on = on;
    (on ? n_on : n_off) += 1;
    if (!probing) {
        if (++idx >= keep * blocks) {  // a longer probe, a longer keep: probing stays a fifth of the time
            probing = true;
            idx     = 0;
            win     = 0;
            blocks  = 0;
            on      = arm(0);
            samples[0].clear();
            samples[1].clear();
        }
        return;
    }
    const bool first = idx == 0 && win == 0 && blocks == 0;
    cur_timed        = !first && last_on == on;
    last_on          = on;
    if (++idx == window) {
        idx = 0;
        ++win;
        on = arm(win % (2 * rounds));
    }
}

// the mean and the variance of the mean of x
static void moetier_mean_var(const std::vector<int64_t> & x, double & mean, double & var_of_mean) {
    const double n = (double) x.size();
    double       s = 0;
    for (const int64_t v : x) {
        s += (double) v;
    }
    mean     = s / n;
    double q = 0;
    for (const int64_t v : x) {
        q += ((double) v - mean) * ((double) v - mean);
    }
    var_of_mean = n > 1 ? q / (n - 1) / n : 0;
}

bool moetier_prefetch_gate::decide() {
    // too few steps of an arm were timed (requests of a token or two): prefetch reads, as it
    // would without the gate, until the next probe
    const size_t need = (size_t) rounds;
    if (samples[0].size() < need || samples[1].size() < need) {
        on = true;
        return true;
    }
    double m_off = 0, v_off = 0, m_on = 0, v_on = 0;
    moetier_mean_var(samples[0], m_off, v_off);
    moetier_mean_var(samples[1], m_on, v_on);
    us_off = (int64_t) m_off;
    us_on  = (int64_t) m_on;
    // prefetch has to show that it pays (its reads cost disk time and slots): no faster, it stands
    // back at once; faster by less than two standard errors, another block measures it, up to the last
    if (m_on < m_off && m_off - m_on < 2 * std::sqrt(v_on + v_off) && blocks < max_blocks) {
        on = arm(0);
        return false;
    }
    on = m_on < m_off;
    return true;
}
