// Micro-benchmark of prefetch's stacked routers (HOBBIT Fig. 17a), on ggml's CPU backend: median
// microseconds of one router [n_embd, n_expert] on x [n_embd, n_tokens]; p routers run one after
// another; p routers stacked into one [n_embd, p * n_expert] matmul (what prefetch runs). Prints one
// JSON object. Built on demand (cmake --build BUILD --target moetier-stacked-gate), not shipped:
// bench/stacked_gate.py runs it.
//
//   moetier-stacked-gate N_EMBD N_EXPERT P [N_TOKENS REPS THREADS]

#include "ggml-cpu.h"
#include "ggml.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <vector>

struct ggml_ctx_deleter {
    void operator()(ggml_context * c) const { ggml_free(c); }
};

// Median microseconds of: one router [n_embd, n_expert] on x [n_embd, n_tokens]; p routers run one
// after another; p routers stacked into one [n_embd, p * n_expert] matmul (what prefetch runs).
static int bench_stacked_gate(int64_t n_embd, int64_t n_expert, int64_t p, int64_t n_tokens, int reps, int n_threads) {
    if (n_embd < 1 || n_expert < 1 || p < 1 || n_tokens < 1 || reps < 1) {
        fprintf(stderr, "moetier-stacked-gate: sizes and reps must be positive\n");
        return 2;
    }
    const size_t     bytes = (size_t) (2 * p * n_expert * n_embd + n_embd * n_tokens + 2 * p * n_expert * n_tokens) * 4;
    ggml_init_params ip    = { bytes + 64 * ggml_tensor_overhead() + ggml_graph_overhead() * 3 + (1 << 20), nullptr,
                               false };
    std::unique_ptr<ggml_context, ggml_ctx_deleter> ctx(ggml_init(ip));
    std::mt19937                                    rng(0);
    std::normal_distribution<float>                 nd;
    auto                                            fill = [&](ggml_tensor * t) {
        float * d = (float *) t->data;
        for (int64_t i = 0; i < ggml_nelements(t); ++i) {
            d[i] = nd(rng);
        }
    };
    ggml_tensor * x = ggml_new_tensor_2d(ctx.get(), GGML_TYPE_F32, n_embd, n_tokens);
    fill(x);
    ggml_tensor * stacked = ggml_new_tensor_2d(ctx.get(), GGML_TYPE_F32, n_embd, p * n_expert);
    fill(stacked);
    ggml_cgraph * g_one = ggml_new_graph(ctx.get());
    ggml_cgraph * g_seq = ggml_new_graph(ctx.get());
    ggml_cgraph * g_stk = ggml_new_graph(ctx.get());
    for (int64_t j = 0; j < p; ++j) {
        ggml_tensor * w = ggml_new_tensor_2d(ctx.get(), GGML_TYPE_F32, n_embd, n_expert);
        fill(w);
        ggml_tensor * y = ggml_mul_mat(ctx.get(), w, x);
        ggml_build_forward_expand(g_seq, y);
        if (j == 0) {
            ggml_build_forward_expand(g_one, y);
        }
    }
    ggml_build_forward_expand(g_stk, ggml_mul_mat(ctx.get(), stacked, x));
    auto time_us = [&](ggml_cgraph * g) {
        std::vector<double> t;
        for (int r = 0; r < reps; ++r) {
            const auto t0 = std::chrono::steady_clock::now();
            if (ggml_graph_compute_with_ctx(ctx.get(), g, n_threads) != GGML_STATUS_SUCCESS) {
                fprintf(stderr, "moetier-stacked-gate: graph compute failed\n");
                exit(1);
            }
            t.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
        }
        std::sort(t.begin(), t.end());
        return t[t.size() / 2];
    };
    time_us(g_stk);  // warm caches and threads
    const double one = time_us(g_one), seq = time_us(g_seq), stk = time_us(g_stk);
    printf("{\"single_us\": %.3f, \"sequential_us\": %.3f, \"stacked_us\": %.3f}\n", one, seq, stk);
    return 0;
}

int main(int argc, char ** argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s N_EMBD N_EXPERT P [N_TOKENS REPS THREADS]\n", argv[0]);
        return 2;
    }
    const int64_t n_embd   = atoll(argv[1]);
    const int64_t n_expert = atoll(argv[2]);
    const int64_t p        = atoll(argv[3]);
    const int64_t n_tokens = argc > 4 ? atoll(argv[4]) : 1;
    const int     reps     = argc > 5 ? atoi(argv[5]) : 200;
    const int     threads  = argc > 6 ? atoi(argv[6]) : 1;
    return bench_stacked_gate(n_embd, n_expert, p, n_tokens, reps, threads);
}
