// moetier._core.trace: what a decode computes, for calibration tools (moefy, routing traces) and
// tests: graph tensors by name, and the order of the graph's nodes. Not part of generation.

#include "ggml-backend.h"
#include "ggml.h"
#include "llama.h"
#include "py-model.h"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

// names of the graph nodes in the order one decode of tokens runs them (the scheduler asks the
// eval callback about every node, in order)
std::vector<std::string> node_order(const py_model & pm, const std::vector<llama_token> & tokens) {
    if (tokens.empty()) {
        throw std::invalid_argument("node_order: no tokens");
    }
    for (llama_token t : tokens) {
        pm.check_token(t);
    }
    std::vector<std::string> names;
    auto                     cb = [](ggml_tensor * t, bool ask, void * ud) -> bool {
        if (ask) {
            ((std::vector<std::string> *) ud)->push_back(ggml_get_name(t));
        }
        return false;
    };
    py::gil_scoped_release release;
    py_context_ptr         c = pm.eval_context((uint32_t) tokens.size(), (uint32_t) tokens.size(), cb, &names);
    if (!c) {
        throw std::runtime_error(pm.path() + ": node_order: failed to create a context");
    }
    std::vector<llama_token> tok = tokens;
    if (llama_decode(c.get(), llama_batch_get_one(tok.data(), (int32_t) tok.size())) != 0) {
        throw std::runtime_error(pm.path() + ": node_order: decode failed");
    }
    return names;
}

// Runs tokens through a fresh context in chunks of n_chunk (each chunk from an empty KV cache) and
// returns, for each graph tensor named in names (e.g. "ffn_norm-3", "ffn_moe_topk-3"), its rows:
// {name: float32 [n_rows, ne0]} (I32 tensors converted).
py::dict collect(const py_model &                 pm,
                 const std::vector<llama_token> & tokens,
                 const std::vector<std::string> & names,
                 int32_t                          n_chunk) {
    for (llama_token t : tokens) {
        pm.check_token(t);
    }
    if (n_chunk < 1) {
        throw std::invalid_argument("collect: n_chunk must be positive");
    }

    struct collector {
        std::map<std::string, std::vector<float>> rows;
        std::map<std::string, int64_t>            width;
        std::vector<float>                        tmp;
    } col;

    for (const auto & n : names) {
        col.rows[n];
    }
    auto cb = [](ggml_tensor * t, bool ask, void * ud) -> bool {
        collector * c  = (collector *) ud;
        auto        it = c->rows.find(ggml_get_name(t));
        if (it == c->rows.end()) {
            return false;
        }
        if (ask) {
            return true;
        }
        if (t->type != GGML_TYPE_F32 && t->type != GGML_TYPE_I32) {
            return true;
        }
        // rows of ne[0] elements, read one by one: views (e.g. the top-k ids) are strided
        const int64_t n_rows = t->ne[1] * t->ne[2] * t->ne[3];
        c->tmp.resize(t->ne[0]);
        std::vector<int32_t> tmp_i(t->type == GGML_TYPE_I32 ? t->ne[0] : 0);
        for (int64_t r = 0; r < n_rows; ++r) {
            const int64_t i1 = r % t->ne[1], i2 = (r / t->ne[1]) % t->ne[2], i3 = r / (t->ne[1] * t->ne[2]);
            const size_t  off = i1 * t->nb[1] + i2 * t->nb[2] + i3 * t->nb[3];
            if (t->type == GGML_TYPE_I32) {
                ggml_backend_tensor_get(t, tmp_i.data(), off, t->ne[0] * sizeof(int32_t));
                std::copy(tmp_i.begin(), tmp_i.end(), c->tmp.begin());  // expert ids are exact in float
            } else {
                ggml_backend_tensor_get(t, c->tmp.data(), off, t->ne[0] * sizeof(float));
            }
            it->second.insert(it->second.end(), c->tmp.begin(), c->tmp.end());
        }
        c->width[it->first] = t->ne[0];
        return true;
    };
    {
        py::gil_scoped_release release;
        py_context_ptr         c = pm.eval_context((uint32_t) n_chunk, (uint32_t) std::min(n_chunk, 512), cb, &col);
        if (!c) {
            throw std::runtime_error(pm.path() + ": collect: failed to create a context");
        }
        llama_batch batch = llama_batch_init(n_chunk, 0, 1);
        for (size_t i = 0; i < tokens.size(); i += n_chunk) {
            const int32_t n = (int32_t) std::min<size_t>(n_chunk, tokens.size() - i);
            llama_memory_clear(llama_get_memory(c.get()), true);
            batch.n_tokens = n;
            for (int32_t j = 0; j < n; ++j) {
                batch.token[j]     = tokens[i + j];
                batch.pos[j]       = j;
                batch.n_seq_id[j]  = 1;
                batch.seq_id[j][0] = 0;
                batch.logits[j]    = 1;  // every row survives to the last layer
            }
            if (llama_decode(c.get(), batch) != 0) {
                llama_batch_free(batch);
                throw std::runtime_error(pm.path() + ": collect: decode failed");
            }
        }
        llama_batch_free(batch);
    }
    py::dict out;
    for (auto & [name, rows] : col.rows) {
        const int64_t w = col.width.count(name) ? col.width[name] : 0;
        if (w == 0) {
            throw std::invalid_argument("collect: no tensor named '" + name + "' in the graph");
        }
        py::array_t<float> a({ (int64_t) rows.size() / w, w });
        std::copy(rows.begin(), rows.end(), a.mutable_data());
        out[py::str(name)] = a;
    }
    return out;
}

}  // namespace

void register_trace(py::module_ & m) {
    py::module_ t = m.def_submodule("trace", "what a decode computes: graph tensors by name, node order");
    t.def("collect", &collect, py::arg("model"), py::arg("tokens"), py::arg("names"), py::arg("n_chunk") = 512,
          "{name: float32 [n_rows, ne0]} of the named graph tensors over tokens, in chunks of n_chunk");
    t.def("node_order", &node_order, py::arg("model"), py::arg("tokens"),
          "names of the graph nodes in the order one decode of tokens runs them");
}
