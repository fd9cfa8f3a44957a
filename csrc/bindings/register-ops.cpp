// moetier._core ggml ops on their own: mul_mat_id once, so tests can check the negative-id rule and
// the unchanged result for valid ids against a NumPy reference.

#include "bindings.h"
#include "ggml-cpu.h"
#include "ggml.h"

#include <pybind11/numpy.h>

#include <algorithm>
#include <cstring>
#include <memory>
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
    ggml_init_params ip = { /*.mem_size =*/(size_t) (E * N * K + T * U * K + T * U * N + T * U) * 4 + 16 * 1024 * 1024,
                            /*.mem_buffer =*/nullptr, /*.no_alloc =*/false };
    std::unique_ptr<ggml_context, ggml_ctx_deleter> ctx(ggml_init(ip));
    ggml_tensor *                                   ta = ggml_new_tensor_3d(ctx.get(), GGML_TYPE_F32, K, N, E);
    ggml_tensor *                                   tb = ggml_new_tensor_3d(ctx.get(), GGML_TYPE_F32, K, U, T);
    ggml_tensor *                                   ti = ggml_new_tensor_2d(ctx.get(), GGML_TYPE_I32, U, T);
    memcpy(ta->data, as.data(), ggml_nbytes(ta));
    memcpy(tb->data, b.data(), ggml_nbytes(tb));
    memcpy(ti->data, ids.data(), ggml_nbytes(ti));
    ggml_tensor * out = ggml_mul_mat_id(ctx.get(), ta, tb, ti);  // [N, U, T]
    ggml_cgraph * gf  = ggml_new_graph(ctx.get());
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

}  // namespace

void register_ops(py::module_ & m) {
    m.def("mul_mat_id", &mul_mat_id, py::arg("as_"), py::arg("b"), py::arg("ids"), py::arg("n_threads") = 1,
          "ggml-cpu mul_mat_id on f32 arrays: as [E,N,K], b [T,U,K], ids [T,U] (negative = zero row) -> [T,U,N]");
}
