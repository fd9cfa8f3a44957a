// moetier._core ggml ops on their own: mul_mat_id once, so tests can check the negative-id rule and
// the unchanged result for valid ids against a NumPy reference, on the plain and the repacked kernels; quantize, so moefy writes trained
// weights in any type ggml has (K-quants included), with llama-quantize's importance weighting.

#include "bindings.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

struct ggml_ctx_deleter {
    void operator()(ggml_context * c) const { ggml_free(c); }
};

using f32_array = py::array_t<float, py::array::c_style | py::array::forcecast>;
using i64_array = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

ggml_type type_by_name(const std::string & type_name, const char * who) {
    for (int t = 0; t < GGML_TYPE_COUNT; ++t) {
        const char * name = ggml_type_name((ggml_type) t);
        if (name && type_name == name && ggml_get_type_traits((ggml_type) t)->blck_size > 0) {
            return (ggml_type) t;
        }
    }
    throw std::invalid_argument(std::string(who) + ": unknown ggml type '" + type_name + "'");
}

// the CPU backend's CPU_REPACK buffer type, nullptr if this build has none
ggml_backend_buffer_type_t cpu_repack_buft() {
    ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    if (cpu == nullptr) {
        return nullptr;
    }
    auto get_extra = (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(
        ggml_backend_dev_backend_reg(cpu), "ggml_backend_dev_get_extra_bufts");
    for (ggml_backend_buffer_type_t * t = get_extra ? get_extra(cpu) : nullptr; t && *t; ++t) {
        if (std::string(ggml_backend_buft_name(*t)) == "CPU_REPACK") {
            return *t;
        }
    }
    return nullptr;
}

struct buffer_deleter {
    void operator()(ggml_backend_buffer_t b) const { ggml_backend_buffer_free(b); }
};

// as: [E, N, K] (E matrices of N rows), b: [T, U, K], ids: [T, U] -> [T, U, N]; as quantized to
// type first, and with repack on the repacked kernels, as the expert cache's repacked pools run them
py::array_t<float> mul_mat_id(f32_array           as,
                              f32_array           b,
                              i64_array           ids,
                              int                 n_threads,
                              const std::string & type_name,
                              bool                repack) {
    if (as.ndim() != 3 || b.ndim() != 3 || ids.ndim() != 2) {
        throw std::invalid_argument("mul_mat_id: as [E,N,K], b [T,U,K], ids [T,U]");
    }
    const int64_t E = as.shape(0), N = as.shape(1), K = as.shape(2);
    const int64_t T = b.shape(0), U = b.shape(1);
    if (b.shape(2) != K || ids.shape(0) != T || ids.shape(1) != U) {
        throw std::invalid_argument("mul_mat_id: shapes do not agree");
    }
    for (int64_t i = 0; i < T * U; ++i) {  // ggml asserts only in debug builds: a bad id writes past its rows
        if (ids.data()[i] >= E || ids.data()[i] < INT32_MIN) {  // taken as int64: no id wraps into range
            throw std::invalid_argument("mul_mat_id: id " + std::to_string(ids.data()[i]) + " at position " +
                                        std::to_string(i) + " is not below E=" + std::to_string(E) +
                                        " (negative ids yield zero rows)");
        }
    }
    const ggml_type type = type_by_name(type_name, "mul_mat_id");
    if (K % ggml_blck_size(type) != 0) {
        throw std::invalid_argument("mul_mat_id: rows of K values do not split into " + type_name + " blocks");
    }
    ggml_init_params ip = { /*.mem_size =*/(size_t) (E * N * K + T * U * K + T * U * N + T * U) * 4 + 16 * 1024 * 1024,
                            /*.mem_buffer =*/nullptr, /*.no_alloc =*/false };
    std::unique_ptr<ggml_context, ggml_ctx_deleter> ctx(ggml_init(ip));
    ggml_tensor *                                   ta = ggml_new_tensor_3d(ctx.get(), type, K, N, E);
    ggml_tensor *                                   tb = ggml_new_tensor_3d(ctx.get(), GGML_TYPE_F32, K, U, T);
    ggml_tensor *                                   ti = ggml_new_tensor_2d(ctx.get(), GGML_TYPE_I32, U, T);
    std::vector<uint8_t>                            qa(ggml_nbytes(ta));
    if (type == GGML_TYPE_F32) {
        memcpy(qa.data(), as.data(), qa.size());
    } else {
        ggml_quantize_init(type);
        ggml_quantize_chunk(type, as.data(), qa.data(), 0, E * N, K, nullptr);
    }
    std::unique_ptr<ggml_backend_buffer, buffer_deleter> token;
    if (repack) {
        // as the expert cache does: the tensor keeps its memory, names a CPU_REPACK buffer (which picks
        // the kernels) and gets its data through that buffer's set_tensor (which repacks it)
        ggml_backend_buffer_type_t buft = cpu_repack_buft();
        token.reset(buft ? ggml_backend_buft_alloc_buffer(buft, 64) : nullptr);
        ta->buffer = token.get();
        if (!token || ggml_backend_buffer_init_tensor(token.get(), ta) != GGML_STATUS_SUCCESS || ta->extra == nullptr) {
            throw std::runtime_error("mul_mat_id: no repacked kernel for " + type_name + " [" + std::to_string(K) +
                                     ", " + std::to_string(N) + "] on this CPU");
        }
        ggml_backend_tensor_set(ta, qa.data(), 0, qa.size());
    } else {
        memcpy(ta->data, qa.data(), qa.size());
    }
    memcpy(tb->data, b.data(), ggml_nbytes(tb));
    for (int64_t i = 0; i < T * U; ++i) {
        ((int32_t *) ti->data)[i] = (int32_t) ids.data()[i];
    }
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

// rows [n_rows, n_per_row] f32 -> the bytes of those rows in type_name (a ggml type name, e.g. "q4_K");
// imatrix [n_per_row] (mean squared input per column, as llama-imatrix computes) weights the rounding
py::array_t<uint8_t> quantize(f32_array rows, const std::string & type_name, std::optional<f32_array> imatrix) {
    if (rows.ndim() != 2) {
        throw std::invalid_argument("quantize: rows must be 2-D [n_rows, n_per_row]");
    }
    const ggml_type type   = type_by_name(type_name, "quantize");
    const int64_t   n_rows = rows.shape(0), n_per_row = rows.shape(1);
    if (n_per_row % ggml_blck_size(type) != 0) {
        throw std::invalid_argument("quantize: rows of " + std::to_string(n_per_row) + " values do not split into " +
                                    type_name + " blocks of " + std::to_string(ggml_blck_size(type)));
    }
    if (imatrix && (imatrix->ndim() != 1 || imatrix->shape(0) != n_per_row)) {
        throw std::invalid_argument("quantize: imatrix must have one value per column");
    }
    if (ggml_quantize_requires_imatrix(type) && !imatrix) {
        throw std::invalid_argument("quantize: " + type_name + " needs an imatrix");
    }
    const size_t         row_size = ggml_row_size(type, n_per_row);
    py::array_t<uint8_t> out({ n_rows, (int64_t) row_size });
    {
        py::gil_scoped_release release;
        ggml_quantize_init(type);
        const size_t n = ggml_quantize_chunk(type, rows.data(), out.mutable_data(), 0, n_rows, n_per_row,
                                             imatrix ? imatrix->data() : nullptr);
        if (n != row_size * n_rows) {
            throw std::runtime_error("quantize: ggml_quantize_chunk wrote an unexpected size");
        }
    }
    return out;
}

}  // namespace

void register_ops(py::module_ & m) {
    m.def("mul_mat_id", &mul_mat_id, py::arg("as_"), py::arg("b"), py::arg("ids"), py::arg("n_threads") = 1,
          py::arg("type") = "f32", py::arg("repack") = false,
          "ggml-cpu mul_mat_id on f32 arrays: as [E,N,K] (quantized to type first; repack: on llama.cpp's "
          "repacked kernels, RuntimeError if this CPU has none for it), b [T,U,K], ids [T,U] (negative = zero row) "
          "-> [T,U,N]");
    m.def("quantize", &quantize, py::arg("rows"), py::arg("type"), py::arg("imatrix") = py::none(),
          "f32 rows [n_rows, n_per_row] -> uint8 [n_rows, row bytes] in a ggml type (e.g. 'q4_K'), optionally "
          "weighted by an importance matrix [n_per_row]");
}
