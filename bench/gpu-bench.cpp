// moetier-gpu-bench: prompt and decode speed of a model loaded as the shipped tools load it
// (common_init_from_params, so --expert-cache and --expert-opt apply, unlike llama-batched-bench,
// which loads the model itself). Rounds of a random prompt of -npp tokens and -ntg decoded tokens
// (random tokens, as llama-batched-bench: speed, not text); the first round warms the caches, each
// round prints its speeds. Built on demand (bench/gpu.py): cmake --build B --target moetier-gpu-bench
//
// usage: moetier-gpu-bench -m MODEL -npp 512 -ntg 64 [-ngl 99 ...] [--expert-cache ... --expert-opt ...]
//        (MOETIER_ROUNDS=N rounds, default 3)

#include "arg.h"
#include "common.h"
#include "llama.h"
#include "moetier.h"

#include <cstdio>
#include <cstdlib>
#include <vector>

static void batch_add(llama_batch & b, llama_token t, llama_pos pos, bool logits) {
    const int i    = b.n_tokens++;
    b.token[i]     = t;
    b.pos[i]       = pos;
    b.n_seq_id[i]  = 1;
    b.seq_id[i][0] = 0;
    b.logits[i]    = logits;
}

int main(int argc, char ** argv) {
    common_params params;
    if (!common_params_parse(argc, argv, params, LLAMA_EXAMPLE_BENCH)) {
        return 1;
    }
    const int n_pp     = params.n_pp.empty() ? 512 : params.n_pp[0];
    const int n_tg     = params.n_tg.empty() ? 64 : params.n_tg[0];
    const int n_rounds = getenv("MOETIER_ROUNDS") ? atoi(getenv("MOETIER_ROUNDS")) : 3;
    if (params.n_ctx < n_pp + n_tg) {
        params.n_ctx = n_pp + n_tg;
    }
    common_init();
    llama_backend_init();
    auto            init  = common_init_from_params(params);
    llama_model *   model = init->model();
    llama_context * ctx   = init->context();
    if (model == nullptr || ctx == nullptr) {
        fprintf(stderr, "moetier-gpu-bench: failed to load %s\n", params.model.path.c_str());
        return 1;
    }
    const int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    const int32_t n_batch = (int32_t) llama_n_batch(ctx);
    srand(1);
    llama_batch batch = llama_batch_init(n_batch, 0, 1);
    for (int round = 0; round < n_rounds; ++round) {
        llama_memory_clear(llama_get_memory(ctx), true);
        const int64_t t0 = ggml_time_us();
        for (int i = 0; i < n_pp; i += n_batch) {
            const int n    = n_pp - i < n_batch ? n_pp - i : n_batch;
            batch.n_tokens = 0;
            for (int j = 0; j < n; ++j) {
                batch_add(batch, rand() % n_vocab, i + j, i + j == n_pp - 1);
            }
            if (llama_decode(ctx, batch) != 0) {
                fprintf(stderr, "moetier-gpu-bench: prompt decode failed\n");
                return 1;
            }
        }
        llama_synchronize(ctx);
        const int64_t t1 = ggml_time_us();
        for (int i = 0; i < n_tg; ++i) {
            batch.n_tokens = 0;
            batch_add(batch, rand() % n_vocab, n_pp + i, true);
            if (llama_decode(ctx, batch) != 0) {
                fprintf(stderr, "moetier-gpu-bench: decode failed\n");
                return 1;
            }
        }
        llama_synchronize(ctx);
        const int64_t t2 = ggml_time_us();
        printf("round %d: pp %d tok %.2f tok/s, tg %d tok %.2f tok/s\n", round, n_pp, 1e6 * n_pp / (double) (t1 - t0),
               n_tg, 1e6 * n_tg / (double) (t2 - t1));
        fflush(stdout);
    }
    llama_batch_free(batch);
    if (moetier_model_has_cache(model)) {
        const moetier_layer_stats t = moetier_model_stats_total(model);
        moetier_cache_info        c = {};
        moetier_model_cache_info(model, &c);
        printf(
            "moetier: %llu lookups, RAM tier %llu hits %llu misses %llu bytes read; VRAM tier %d slots, %llu hits, "
            "%llu copies, %llu bytes copied in %.1f ms, %llu on the CPU\n",
            (unsigned long long) t.n_lookups, (unsigned long long) t.n_hits, (unsigned long long) t.n_misses,
            (unsigned long long) t.n_bytes_read, c.n_slots_vram, (unsigned long long) t.n_vram_hits,
            (unsigned long long) t.n_vram_copies, (unsigned long long) t.n_vram_bytes, t.vram_copy_us / 1000.0,
            (unsigned long long) t.n_vram_cpu);
        if (c.vram_cpu_us > 0) {
            printf("moetier: cooperative compute's costs: %.0f us to copy one expert, %.0f us on the CPU\n",
                   c.vram_copy_us, c.vram_cpu_us);
        }
    }
    return 0;
}
