#pragma once

// Whether prefetch pays for itself here. With a fast disk and a small model a layer's reads may
// already hide behind compute; then the reads prefetch wastes and the slots it holds only cost time.
// The gate measures it where it runs: decode steps (one token) go in windows that alternate between
// prefetch reading and standing back (no reads, no holds: the policy alone), and the arm with the
// lower median step time keeps going for `keep` steps; then both are measured again. Other passes
// (prompts, batches of several sequences) always prefetch. Thread 0 (resolve) only.

#include <cstdint>
#include <vector>

class moetier_prefetch_gate {
  public:
    // enabled false: prefetch always reads. window: decode steps per window (the first of each is not
    // timed: the other arm's reads and holds still act in it); rounds: windows per arm in a probe
    explicit moetier_prefetch_gate(bool enabled, int32_t window = 8, int32_t rounds = 2, int32_t keep = 256);

    // pass `pass` starts at now_us (its first layer resolves); decode: it is one token
    void step(uint64_t pass, bool decode, int64_t now_us);

    // whether the current pass's prefetch reads
    bool reads() const { return cur_on; }

    // decode steps with prefetch reading / standing back; median step time of each in the latest probe (us, 0: none)
    uint64_t n_on   = 0;
    uint64_t n_off  = 0;
    int64_t  us_on  = 0;
    int64_t  us_off = 0;

  private:
    void decide();

    const bool           enabled;
    const int32_t        window;
    const int32_t        rounds;
    const int32_t        keep;
    bool                 on      = true;  // the arm of the next decode step
    bool                 probing = true;
    int32_t              idx     = 0;     // steps into the current window (probing) or into the keep period
    int32_t              win     = 0;     // windows done in this probe
    std::vector<int64_t> samples[2];      // step times of the probe: [0] standing back, [1] reading

    // the current pass
    uint64_t cur_pass  = 0;
    int64_t  cur_start = 0;
    bool     cur_timed = false;
    bool     cur_on    = true;
};
