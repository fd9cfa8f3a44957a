// Drives moetier_prefetch_gate (csrc/moetier-gate.cpp) for tests/test_prefetch_gate.py: reads
// "pass decode now_us" per line from stdin, prints for each whether that pass's prefetch reads (1/0),
// and at the end the gate's counters: "n_on n_off us_on us_off".
#include "moetier-gate.h"

#include <cinttypes>
#include <cstdio>

int main(int argc, char ** argv) {
    const bool            enabled = argc < 2 || argv[1][0] != '0';
    moetier_prefetch_gate gate(enabled);
    uint64_t              pass   = 0;
    int                   decode = 0;
    int64_t               now    = 0;
    while (scanf("%" SCNu64 " %d %" SCNd64, &pass, &decode, &now) == 3) {
        gate.step(pass, decode != 0, now);
        printf("%d\n", gate.reads() ? 1 : 0);
    }
    printf("%" PRIu64 " %" PRIu64 " %" PRId64 " %" PRId64 "\n", gate.n_on, gate.n_off, gate.us_on, gate.us_off);
    return 0;
}
