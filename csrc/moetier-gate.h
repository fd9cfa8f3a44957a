#pragma once

// Whether prefetch pays for itself here. With a fast disk and a small model a layer's reads may
// already hide behind compute; then the reads prefetch wastes and the slots it holds only cost time.
// The gate measures it where it runs: decode steps (one token) go in short windows, reading and
// standing back (no reads, no holds: the policy alone) in the order ABBA BAAB..., so that what the
// tokens themselves cost, which drifts over a text, weighs on both arms alike. The arm with the lower
// mean step time keeps going for `keep` steps per block the probe took; then both are measured again. The mean, not the
// median: what prefetch costs comes as a few slow steps (the wasted reads paid when the disk gets to
// them), and the total time is what it must save. Prefetch has to show that it pays: no faster after
// a block, it stands back; faster by less than two standard errors, the probe goes on, up to
// `max_blocks` blocks. Other passes (prompts,
// batches of several sequences) always prefetch. Thread 0 (resolve) only.

#include <cstdint>
#include <vector>

class moetier_prefetch_gate {
  public:
    // enabled false: prefetch always reads. window: decode steps per window (the first step after a
    // switch is not timed: the other arm's reads and holds still act in it); rounds: windows per arm
    // in a block of the probe (made even); max_blocks: blocks a probe may take to decide
    explicit moetier_prefetch_gate(bool    enabled,
                                   int32_t window     = 2,
                                   int32_t rounds     = 16,
                                   int32_t keep       = 256,
                                   int32_t max_blocks = 3);

    // pass `pass` starts at now_us (its first layer resolves); decode: it is one token
    void step(uint64_t pass, bool decode, int64_t now_us);

    // whether the current pass's prefetch reads
    bool reads() const { return cur_on; }

    // decode steps with prefetch reading / standing back; mean step time of each in the latest probe (us, 0: none)
    uint64_t n_on   = 0;
    uint64_t n_off  = 0;
    int64_t  us_on  = 0;
    int64_t  us_off = 0;

  private:
    // whether the probe's block ends with a decision
    bool decide();

    // the arm of window k of a block: reading, standing back, standing back, reading, ...
    static bool arm(int32_t k) { return k % 4 == 0 || k % 4 == 3; }

    const bool           enabled;
    const int32_t        window;
    const int32_t        rounds;
    const int32_t        keep;
    const int32_t        max_blocks;
    bool                 on      = true;   // the arm of the next decode step
    bool                 probing = true;
    int32_t              idx     = 0;      // steps into the current window (probing) or into the keep period
    int32_t              win     = 0;      // windows done in this block
    int32_t              blocks  = 0;      // blocks done in this probe
    bool                 last_on = false;  // the arm of the probe's step before (valid when idx or win or blocks)
    std::vector<int64_t> samples[2];       // step times of the probe: [0] standing back, [1] reading

    // the current pass
    uint64_t cur_pass  = 0;
    int64_t  cur_start = 0;
    bool     cur_timed = false;
    bool     cur_on    = true;
};
