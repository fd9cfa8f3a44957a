// moetier._core ggml ops on their own: mul_mat_id once, so tests can check the negative-id rule and
// the unchanged result for valid ids against a NumPy reference; and the stacked-router timing that
// bench/stacked_gate.py reports (HOBBIT Fig. 17a).

#include "bindings.h"

#include "ggml-cpu.h"
#include "ggml.h"

#include <pybind11/numpy.h>

#include <chrono>
#include <algorithm>
#include <cstring>
#include <memory>
#include <random>
#include <stdexcept>

namespace py = pybind11;

namespace {

struct ggml_ctx_deleter {
    void operator()(ggml_context * c) const { ggml_free(c); }
};

using f32_array = py::array_t<float, py::array::c_style | py::array::forcecast>;
using i32_array = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;

// as: [E, N, K] (E matrices of N rows), b: [T, U, K], ids: [T, U] -> [T, U, N]
py::array_t<float> mul_mat_id(f32_array as, f32_array b, i32_array ids, int n_threads) {
    if (as.ndim() != 3 || b.ndim() != 3 || ids.ndim() != 2) {
        throw std::invalid_argument("mul_mat_id: as [E,N,K], b [T,U,K], ids [T,U]");
    }
    const int64_t E = as.shape(0), N = as.shape(1), K = as.shape(2);
    const int64_t T = b.shape(0), U = b.shape(1);
    if (b.shape(2) != K || ids.shape(0) != T || ids.shape(1) != U) {
        throw std::invalid_argument("mul_mat_id: shapes do not agree");
    }
    ggml_init_params ip = { /*.mem_size =*/ (size_t) (E * N * K + T * U * K + T * U * N + T * U) * 4 + 16 * 1024 * 1024,
                            /*.mem_buffer =*/ nullptr, /*.no_alloc =*/ false };
    std::unique_ptr<ggml_context, ggml_ctx_deleter> ctx(ggml_init(ip));
    ggml_tensor * ta = ggml_new_tensor_3d(ctx.get(), GGML_TYPE_F32, K, N, E);
    ggml_tensor * tb = ggml_new_tensor_3d(ctx.get(), GGML_TYPE_F32, K, U, T);
    ggml_tensor * ti = ggml_new_tensor_2d(ctx.get(), GGML_TYPE_I32, U, T);
    memcpy(ta->data, as.data(), ggml_nbytes(ta));
    memcpy(tb->data, b.data(), ggml_nbytes(tb));
    memcpy(ti->data, ids.data(), ggml_nbytes(ti));
    ggml_tensor * out = ggml_mul_mat_id(ctx.get(), ta, tb, ti); // [N, U, T]
    ggml_cgraph * gf = ggml_new_graph(ctx.get());
    ggml_build_forward_expand(gf, out);
    {
        py::gil_scoped_release release;
        if (ggml_graph_compute_with_ctx(ctx.get(), gf, n_threads) != GGML_STATUS_SUCCESS) {
            throw std::runtime_error("mul_mat_id: graph compute failed");
        }
    }
    py::array_t<float> res({ T, U, N });
    memcpy(res.mutable_data(), out->data, ggml_nbytes(out));
    return res;
}

// Median microseconds of: one router [n_embd, n_expert] on x [n_embd, n_tokens]; p routers run one
// after another; p routers stacked into one [n_embd, p * n_expert] matmul (what prefetch runs).
py::dict bench_stacked_gate(int64_t n_embd, int64_t n_expert, int64_t p, int64_t n_tokens, int reps, int n_threads) {
    if (n_embd < 1 || n_expert < 1 || p < 1 || n_tokens < 1 || reps < 1) {
        throw std::invalid_argument("bench_stacked_gate: sizes and reps must be positive");
    }
    const size_t bytes = (size_t) (2 * p * n_expert * n_embd + n_embd * n_tokens + 2 * p * n_expert * n_tokens) * 4;
    ggml_init_params ip = { bytes + 64 * ggml_tensor_overhead() + ggml_graph_overhead() * 3 + (1 << 20), nullptr, false };
    std::unique_ptr<ggml_context, ggml_ctx_deleter> ctx(ggml_init(ip));
    std::mt19937 rng(0);
    std::normal_distribution<float> nd;
    auto fill = [&](ggml_tensor * t) {
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
                throw std::runtime_error("bench_stacked_gate: graph compute failed");
            }
            t.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
        }
        std::sort(t.begin(), t.end());
        return t[t.size() / 2];
    };
    py::dict d;
    {
        py::gil_scoped_release release;
        time_us(g_stk); // warm caches and threads
        const double one = time_us(g_one), seq = time_us(g_seq), stk = time_us(g_stk);
        py::gil_scoped_acquire acquire;
        d["single_us"] = one;
        d["sequential_us"] = seq;
        d["stacked_us"] = stk;
    }
    return d;
}

} // namespace

void register_ops(py::module_ & m) {
    m.def("mul_mat_id", &mul_mat_id, py::arg("as_"), py::arg("b"), py::arg("ids"), py::arg("n_threads") = 1,
          "ggml-cpu mul_mat_id on f32 arrays: as [E,N,K], b [T,U,K], ids [T,U] (negative = zero row) -> [T,U,N]");
    m.def("bench_stacked_gate", &bench_stacked_gate, py::arg("n_embd"), py::arg("n_expert"), py::arg("p"),
          py::arg("n_tokens") = 1, py::arg("reps") = 200, py::arg("n_threads") = 1,
          "median us of one router, p routers one after another, and p routers stacked in one matmul");
}
