#pragma once

// Prefetch: the cache holds a predictor through moetier_prefetch_i and asks it, while it resolves a
// layer, what became of the reads it started for that layer; the prefetch op hands it the predictor's
// input. One implementation today, HOBBIT's layer-level adaptive prefetch (sec. 3.3) on stacked
// routers; a learned predictor (DuoServe) is a second implementation of the same interface.
//
// Stacked routers: at layer L, once its experts are resolved, one matmul of L's gate input with the
// routers of the next p layers stacked ([n_embd, p * n_expert]) predicts their experts. Walking
// forward, a layer whose predicted experts are all cached has them held against eviction, and the
// walk goes on; the first layer with a missing one gets background reads (in the precision the rule
// gives the predicted weights; the surest predictions first, only as many as are read at once),
// held too, and the walk stops. When a layer resolves, its needed experts that a prefetch is still
// reading are waited for (or, if the read has not started, read at once: on-demand reads go
// first); queued prefetches it does not need are cancelled, and the ones already read count as waste.
//
// What the disk can take: a read holds its bytes of an allowance (the byte cap) from its start until
// its layer runs; a used or cancelled one gives them back, a wasted one keeps them. Every layer adds
// waste x the bytes it needed (its misses' reads and the prefetches it used), up to a ceiling, so
// the bytes read in vain never pass that share of the bytes that demand reads alone would move. And
// a walk that finds earlier prefetches still queued (not started) starts only as many as keep the
// queue within one walk's reads: when the disk is behind, a read started now would only evict a
// cached expert for a read that ends too late.

#include "ggml-backend.h"
#include "ggml-cpp.h"
#include "moetier-gate.h"
#include "moetier-iopool.h"
#include "moetier-layer.h"
#include "moetier-precision.h"
#include "moetier-slots.h"
#include "policies/policies.h"

#include <atomic>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

// what became of the prefetch read of an expert that the layer being resolved needs
enum moetier_prefetch_use {
    MOETIER_PREFETCH_USE_READY = 0,  // no read pending: the slot holds the expert
    MOETIER_PREFETCH_USE_WAIT  = 1,  // being read: the load op waits for the io task
    MOETIER_PREFETCH_USE_READ  = 2,  // not started, or failed: read it now with the layer's misses
};

// a prefetch read into a slot held for a later layer, not checked yet: while a load op waits for its
// own layer's reads, its idle threads check the ones that have landed
struct moetier_landing {
    const moetier_layer * layer  = nullptr;
    moetier_precision     prec   = MOETIER_PRECISION_HIGH;
    int32_t               slot   = -1;
    int32_t               expert = -1;
    int32_t               io_id  = -1;
};

struct moetier_prefetch_i {
    virtual ~moetier_prefetch_i() = default;

    // graph build: the input of the predictor run in layer il's prefetch op (the stacked routers of the
    // next layers, [n_embd, n * n_expert] F32), nullptr if none
    virtual ggml_tensor * router_stack(int32_t il) const = 0;

    // resolve, first: settles reads of unneeded prefetches that have ended since; for a decode token
    // (check), scores the predictions made for layer against its selection ids [n_used]
    virtual void begin(const moetier_layer & layer, const int32_t * ids, int64_t n_used, bool check, uint64_t pass) = 0;

    // resolve: slot s of pool prec holds a needed expert; *id is the io task to wait for (WAIT)
    virtual moetier_prefetch_use use(moetier_precision prec, int32_t s, int32_t * id) = 0;

    // resolve, after the layer's needs: releases what was held for layer and cancels (or counts as
    // waste) the prefetches it did not need
    virtual void settle(const moetier_layer & layer) = 0;

    // the prefetch op after predict: the unchecked reads into slots held
    // for the layers after layer, appended to out up to its capacity (no allocation: out is reserved)
    virtual void landing(const moetier_layer & layer, std::vector<moetier_landing> & out) const = 0;

    // the prefetch op (thread 0), after layer's resolve and before its load: logits [n_next * n_expert,
    // n_tokens] (row stride nb1) of the routers of the next layers on layer's gate input; n_used
    // experts per token
    virtual void predict(const moetier_layer &      layer,
                         const float *              logits,
                         int64_t                    n_tokens,
                         size_t                     nb1,
                         int32_t                    n_used,
                         const moetier_policy_ctx & ctx) noexcept = 0;

    virtual void add_stats(moetier_prefetch_stats & out) const = 0;
    virtual void reset_stats()                                 = 0;
};

using moetier_prefetch_ptr = std::unique_ptr<moetier_prefetch_i>;

// one layer of a pool group as the stacked-router predictor sees it
struct moetier_prefetch_layer {
    moetier_layer *                  layer = nullptr;
    std::vector<moetier_layer *>     next;     // the served layers after it in the same group (at most p)
    std::vector<const ggml_tensor *> routers;  // their routers (ffn_gate_inp), [n_embd, n_expert], or fitted maps
    std::vector<const float *>       biases;   // per next layer: [n_expert] added to its logits, or nullptr
    // per next layer: its selection bias (llama.cpp's exp_probs_b, [n_expert]: added to the
    // probabilities, softmax or sigmoid, for the top-k choice, never to the weights), or empty
    std::vector<std::vector<float>>  probs_biases;
    bool                             sigmoid = false;  // the model's probabilities: sigmoid of the logits, not softmax
};

class moetier_prefetch_stacked : public moetier_prefetch_i {
  public:
    // layers: the group's served layers; slots: its pools (high, low); depth: p; waste: the byte cap's
    // share (moetier_params.prefetch_waste); gate: prefetch measures whether it pays (moetier_prefetch_gate).
    // throws std::runtime_error
    moetier_prefetch_stacked(const std::vector<moetier_prefetch_layer> & layers,
                             int32_t                                     depth,
                             int32_t                                     n_expert,
                             moetier_slots &                             hi,
                             moetier_slots &                             lo,
                             moetier_io_pool &                           io,
                             const moetier_precision_rule &              rule,
                             float                                       waste,
                             bool                                        gate);

    // moetier_prefetch_i
    ggml_tensor * router_stack(int32_t il) const override;
    void begin(const moetier_layer & layer, const int32_t * ids, int64_t n_used, bool check, uint64_t pass) override;
    moetier_prefetch_use use(moetier_precision prec, int32_t s, int32_t * id) override;
    void                 settle(const moetier_layer & layer) override;
    void                 landing(const moetier_layer & layer, std::vector<moetier_landing> & out) const override;
    void                 predict(const moetier_layer &      layer,
                                 const float *              logits,
                                 int64_t                    n_tokens,
                                 size_t                     nb1,
                                 int32_t                    n_used,
                                 const moetier_policy_ctx & ctx) noexcept override;
    void                 add_stats(moetier_prefetch_stats & out) const override;
    void                 reset_stats() override;

  private:
    // per model layer: what this predictor keeps for it
    struct layer_state {
        moetier_layer *                                    layer = nullptr;
        std::vector<moetier_layer *>                       next;
        ggml_tensor *                                      router_stack = nullptr;
        std::vector<std::vector<float>>                    bias;        // per next layer: [n_expert], or empty
        std::vector<std::vector<float>>                    probs_bias;  // per next layer: [n_expert], or empty
        bool                                               sigmoid = false;
        std::vector<std::pair<moetier_precision, int32_t>> prefetched;  // (prec, slot) read or held for it
        std::vector<std::vector<uint8_t>>                  pred_set;    // [distance - 1][n_expert] predicted for it
        std::vector<uint64_t>                              pred_pass;  // [distance - 1] pass the prediction was made in
        std::vector<int32_t>                               pred_top1;  // [distance - 1]
    };

    void settle_zombies();

    const int32_t          n_expert;
    const int32_t          depth;
    moetier_slots *        slots[MOETIER_N_PRECISIONS];
    moetier_io_pool &      io;
    moetier_precision_rule rule;

    std::vector<layer_state> states;  // by model layer index
    ggml_context_ptr         router_ctx;
    ggml_backend_buffer_ptr  router_buf;

    std::vector<std::pair<moetier_precision, int32_t>> zombies;  // unneeded prefetches still being read
    // high slots this predictor keeps from the layers' own loads (held, or zombies): at most the pool's
    // slots less one layer's experts, so a ubatch that routes every expert of a layer always finds
    // slots (at the minimum budget prefetch holds nothing)
    int32_t                                            n_held_high = 0;
    bool                                               may_hold(moetier_precision prec) const;
    bool                                               is_zombie(moetier_precision prec, int32_t s) const;
    void                                               unhold(moetier_precision prec);
    uint64_t                                           pass = 0;  // of the layer being resolved

    // scratch of predict, sized to one layer's experts
    std::vector<moetier_need> pred_need;
    std::vector<float>        pred_w;     // highest predicted weight
    std::vector<int32_t>      pred_rank;  // predicted experts, surest first
    std::vector<float>        pred_row;   // one token's logits plus the bias
    std::vector<float>        pred_sel;   // one token's probabilities plus the selection bias

    // the byte cap (thread 0): credit may be spent on reads; it grows by waste x the bytes each layer
    // needed, up to credit_max (a few walks' reads: a long run of good guesses banks no more)
    const double          waste;
    int64_t               credit     = 0;
    int64_t               credit_max = 0;
    const moetier_layer * cur        = nullptr;  // the layer being resolved
    uint64_t              cur_demand = 0;        // its stats.n_bytes_read when begin() saw it
    uint64_t              cur_used   = 0;        // bytes of the prefetches it used
    void                  refund(const moetier_layer & layer, moetier_precision prec);

    moetier_prefetch_gate  gate;
    moetier_prefetch_stats pf = {};          // resolve-side counters (thread 0)
    std::atomic<uint64_t>  bytes_read{ 0 };  // added by the read callbacks (io tasks' bytes_done)
};
