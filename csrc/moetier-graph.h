#pragma once

// What moetier adds to a compute graph: per served MoE layer the resolve, load and prefetch custom
// ops, the slot ids the mul_mat_ids use (and the low-precision product), and, once the graph is
// built, the node order that lets the nodes which do not need a layer's experts run while its reads
// do. Light on purpose: moetier-hooks.h, which patched llama.cpp includes, includes this.

#include <cstdint>

struct ggml_cgraph;
struct ggml_context;
struct ggml_tensor;
struct moetier_layer;
struct moetier_model;

// What build_moe_ffn keeps of a served MoE layer between routing and its mul_mat_ids (a local of
// the patched function: the two graph hooks share no other state).
struct moetier_moe {
    ggml_tensor *         ids = nullptr;  // what the mul_mat_ids take: slot ids of the high pools, or the expert ids
    ggml_tensor *         low_ids = nullptr;  // slot ids of the low pools; nullptr if the layer has none
    const moetier_layer * layer   = nullptr;  // nullptr if the layer is not served
};

// Once the top-k ids and their weights exist: for a served layer, inserts the resolve and load ops
// (and the prefetch op), points the expert tensors at the high-precision pools and returns the slot
// ids; otherwise returns the expert ids unchanged. See moetier_hook_moe_ids.
moetier_moe moetier_graph_moe_ids(ggml_context * ctx,
                                  ggml_tensor *  cur,
                                  ggml_tensor *  selected_experts,
                                  ggml_tensor *  weights,
                                  bool           warmup,
                                  ggml_tensor ** up_exps,
                                  ggml_tensor ** gate_exps,
                                  ggml_tensor ** down_exps,
                                  ggml_tensor ** gate_up_exps) noexcept;

// cur = mul_mat_id(as, b, moe.ids): if as is a high-precision pool whose group also has low-precision
// slots, cur + mul_mat_id(low pool, b, moe.low_ids) (each row comes from one of them; the other is
// zero); otherwise cur.
ggml_tensor * moetier_graph_mul_mat_id(ggml_context *      ctx,
                                       const moetier_moe & moe,
                                       ggml_tensor *       cur,
                                       ggml_tensor *       as,
                                       ggml_tensor *       b) noexcept;

// With io_uring, the reads of a served layer start at its routing: the nodes that do not need its
// experts (a shared expert, the stacked routers) move ahead of its load op.
void moetier_graph_reorder(const moetier_model & m, ggml_cgraph * gf) noexcept;
