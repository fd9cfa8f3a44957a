#pragma once

// The only moetier header that the patched llama.cpp includes: the patch passes upstream objects in
// and uses the result. The load hooks (moetier-hooks.cpp) are thin adapters over moetier_model; the
// graph hooks are the graph logic itself (moetier-graph.cpp: custom ops, slot ids, node order).
//
// Load-time hooks throw std::runtime_error, as llama.cpp's loader does (llama_model_load catches
// and reports it); graph hooks are noexcept.

#include "moetier.h"

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

struct ggml_backend;
struct ggml_backend_buffer_type;
struct ggml_backend_sched;
struct ggml_cgraph;
struct ggml_context;
struct ggml_tensor;
struct llama_model;
struct moetier_layer;
struct moetier_model;

struct moetier_model_deleter {
    void operator()(moetier_model * m) const;
};

using moetier_model_ptr = std::unique_ptr<moetier_model, moetier_model_deleter>;

// llama_model_load, before the loader: takes the configuration pending for fname
// (moetier_model_configure); nullptr if there is none or the cache is off. Served experts must never
// be faulted in: the loader keeps them out of the mapping's prefetch, and mmap+mlock becomes
// read+mlock (*load_mode).
moetier_model_ptr moetier_hook_model_init(const std::string &              fname,
                                          const std::vector<std::string> & splits,
                                          int *                            load_mode);

// llama_model_loader::create_tensor: the data-less tensor of a served expert tensor, or nullptr.
// buft: the buffer type the loader would give the tensor (asked for expert tensors only): an expert
// tensor on an RPC server is not served, it loads there as usual
ggml_tensor * moetier_hook_create_tensor(moetier_model *                                     m,
                                         const std::string &                                 name,
                                         const ggml_tensor *                                 cur,
                                         uint16_t                                            file_idx,
                                         size_t                                              offs,
                                         const std::function<ggml_backend_buffer_type *()> & buft);

// llama_model_load, after load_tensors: allocates the slot pools from the budget, starts the I/O
// pool and, with prefetch, stacks the routers of the loaded model
void moetier_hook_model_loaded(llama_model & model);

// What build_moe_ffn keeps of a served MoE layer between routing and its mul_mat_ids (a local of
// the patched function: the two graph hooks share no other state).
struct moetier_moe {
    ggml_tensor *         ids = nullptr;  // what the mul_mat_ids take: slot ids of the high pools, or the expert ids
    ggml_tensor *         low_ids     = nullptr;  // slot ids of the second pools; nullptr if the layer has none
    const moetier_layer * layer       = nullptr;  // nullptr if the layer is not served
    // the second pools: the low-precision ones, or (cooperative compute under a VRAM tier, whose pools
    // the mul_mat_ids take with ids) the RAM tier's high ones, computed on the CPU
    bool                  second_ram  = false;
    // the second pools are the VRAM tier's low-precision ones (mixed precision under a VRAM tier)
    bool                  second_vram = false;
};

// build_moe_ffn, once the top-k ids and their weights exist: if the layer's experts are served,
// inserts the resolve and load ops, points the expert tensors at the high-precision slot pools and
// returns the slot ids that the mul_mat_ids must use (moe.ids); otherwise moe.ids is
// selected_experts. weights: the gate weights of the selected experts [1, n_expert_used, n_tokens]
// (they decide the precision of a miss); cur: the gate input [n_embd, n_tokens] (the stacked routers
// of the next layers run on it for prefetch); warmup: cparams.warmup. The caller keeps the result
// for moetier_hook_mul_mat_id.
moetier_moe moetier_hook_moe_ids(ggml_context * ctx,
                                 ggml_tensor *  cur,
                                 ggml_tensor *  selected_experts,
                                 ggml_tensor *  weights,
                                 bool           warmup,
                                 ggml_tensor ** up_exps,
                                 ggml_tensor ** gate_exps,
                                 ggml_tensor ** down_exps,
                                 ggml_tensor ** gate_up_exps) noexcept;

// build_moe_ffn, after each mul_mat_id: cur = mul_mat_id(as, b, moe.ids). If as is a high-precision
// pool whose group also has low-precision slots, returns cur + mul_mat_id(low pool, b, moe.low_ids)
// (each row comes from exactly one of them; the other is zero); otherwise returns cur.
ggml_tensor * moetier_hook_mul_mat_id(ggml_context *      ctx,
                                      const moetier_moe & moe,
                                      ggml_tensor *       cur,
                                      ggml_tensor *       as,
                                      ggml_tensor *       b) noexcept;

// llama_model::build_graph, once the graph is complete (before it is allocated): with io_uring, the
// reads of a served layer start at its routing, so the nodes that do not need its experts (a
// shared expert, the stacked routers) are moved ahead of its load op to compute while they run
void moetier_hook_graph_built(const llama_model & model, ggml_cgraph * gf) noexcept;

// llama_context, before each graph compute (a reused graph too): the VRAM tiers' copies are waited
// for on this context's backend of their device, not on the host (several contexts of one model each
// set theirs before they compute)
void moetier_hook_graph_compute(const llama_model & model, ggml_backend_sched * sched) noexcept;

// llama_context, after each graph compute: the VRAM tiers note where the work this graph queued ends
void moetier_hook_graph_computed(const llama_model & model) noexcept;

// llama_context::graph_max_nodes: the nodes a graph needs beyond stock's for the expert cache (its ops
// per served layer, and the scheduler's copies of their inputs between backends, which its hash set
// must hold); 0 without a cache
uint32_t moetier_hook_graph_extra_nodes(const llama_model & model) noexcept;

// llama_context, after a graph is built and before the scheduler splits it: the mul_mat_ids over the
// RAM tier's pools (and over a VRAM tier's pools in host memory, vram_host) run on the CPU backend; a
// VRAM tier's pools in a GPU's memory are left to the scheduler, which runs them there. Another backend cannot run them: the pools' slots are padded
// for O_DIRECT reads, which CUDA's quantized matmul refuses (it asserts a contiguous src0) and its
// f16 path turns into NaN (measured on an H100), and it leaves the row of a negative slot id (a
// skipped expert, the other precision's rows) unwritten where the CPU gives a zero row (patch 0003).
// The scheduler would move them there with op offload (a batch of 32 tokens or more) or next to
// offloaded layers. The cache's own ops (resolve, load, prefetch, upload) run on the CPU backend
// too: a backend that claims every op (an RPC server's) would get pointers into this process.
// sched, backend_cpu: the context's; nothing to do with one backend.
void moetier_hook_graph_sched(const llama_model &  model,
                              ggml_backend_sched * sched,
                              ggml_backend *       backend_cpu,
                              ggml_cgraph *        gf) noexcept;
