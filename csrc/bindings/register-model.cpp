// moetier._core.Model: a llama.cpp model + context, with or without the expert cache.

#include "bindings.h"

#include "ggml-backend.h"
#include "ggml.h"
#include "llama.h"
#include "moetier.h"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

struct model_deleter   { void operator()(llama_model * m)   const { llama_model_free(m); } };
struct context_deleter { void operator()(llama_context * c) const { llama_free(c); } };
struct sampler_deleter { void operator()(llama_sampler * s) const { llama_sampler_free(s); } };

class py_model {
public:
    py_model(const std::string & path, uint64_t cache_bytes, const std::string & store_dir, const std::string & policy,
             bool direct_io, uint32_t n_ctx, int32_t n_threads, uint32_t n_batch, uint32_t n_ubatch, bool repack,
             const std::string & opts, const std::string & type_k, const std::string & type_v, int flash_attn)
            : path_(path), store_(store_dir), policy_(policy), n_threads_(n_threads),
              type_k_(kv_type_of("type_k", type_k)), type_v_(kv_type_of("type_v", type_v)), flash_attn_(flash_attn) {
        if (flash_attn < -1 || flash_attn > 1) {
            throw std::invalid_argument("flash_attn: expected -1 (auto), 0 (off) or 1 (on)");
        }
        moetier_params mp = moetier_default_params();
        mp.cache_bytes = cache_bytes;
        mp.direct_io   = direct_io;
        moetier_params_from_strings(&mp, store_.c_str(), policy_.c_str());
        if (const char * err = moetier_params_set_opts(&mp, opts.c_str())) {
            throw std::invalid_argument(err);
        }

        llama_model_params params = llama_model_default_params();
        params.moetier = &mp;
        // repacked weights are anonymous copies: a memory cap cannot page them out like mmap'ed ones
        params.use_extra_bufts = repack;

        llama_model * m = nullptr;
        {
            py::gil_scoped_release release;
            moetier_py_clear_logged_error();
            m = llama_model_load_from_file(path.c_str(), params);
        }
        if (!m) {
            std::string why = moetier_last_error();
            if (why.empty()) {
                why = moetier_py_last_logged_error();
            }
            throw std::runtime_error(path + ": failed to load model: " + (why.empty() ? "unknown error (see the log)" : why));
        }
        model_.reset(m);
        vocab_ = llama_model_get_vocab(m);

        llama_context * c = llama_init_from_model(m, context_params(n_ctx, n_batch, n_ubatch));
        if (!c) {
            throw std::runtime_error(path + ": failed to create a context: " + moetier_py_last_logged_error());
        }
        ctx_.reset(c);
        if (moetier_model_has_cache(m)) {
            llama_set_abort_callback(c, moetier_abort_callback, m);
        }
    }

    std::vector<llama_token> tokenize(const std::string & text, bool add_special) const {
        std::vector<llama_token> out(text.size() + 8);
        int32_t n = llama_tokenize(vocab_, text.data(), (int32_t) text.size(), out.data(), (int32_t) out.size(), add_special, true);
        if (n < 0) {
            out.resize(-n);
            n = llama_tokenize(vocab_, text.data(), (int32_t) text.size(), out.data(), (int32_t) out.size(), add_special, true);
        }
        if (n < 0) {
            throw std::runtime_error("tokenize failed");
        }
        out.resize(n);
        return out;
    }

    py::bytes detokenize(const std::vector<llama_token> & tokens) const {
        std::string out;
        char buf[256];
        for (llama_token t : tokens) {
            check_token(t);
            const int32_t n = llama_token_to_piece(vocab_, t, buf, sizeof(buf), 0, false);
            if (n > 0) {
                out.append(buf, n);
            }
        }
        return py::bytes(out);
    }

    // last-position logits of tokens, from an empty context
    py::array_t<float> logits(const std::vector<llama_token> & tokens) {
        if (tokens.empty()) {
            throw std::invalid_argument("logits: no tokens");
        }
        {
            py::gil_scoped_release release;
            start_sequence();
            eval(tokens);
        }
        const int32_t n_vocab = llama_vocab_n_tokens(vocab_);
        py::array_t<float> out(n_vocab);
        const float * l = llama_get_logits_ith(ctx_.get(), -1);
        std::copy(l, l + n_vocab, out.mutable_data());
        return out;
    }

    // generated tokens after prompt (temperature 0 = greedy), with the prompt-processing time (up
    // to the first sampled token) and the decode time of the rest
    py::dict generate(const std::vector<llama_token> & prompt, int32_t max_tokens, float temperature, uint32_t seed) {
        if (prompt.empty()) {
            throw std::invalid_argument("generate: empty prompt");
        }
        std::vector<llama_token> out;
        int64_t t0 = 0, t1 = 0, t2 = 0;
        {
            py::gil_scoped_release release;

            std::unique_ptr<llama_sampler, sampler_deleter> smpl(llama_sampler_chain_init(llama_sampler_chain_default_params()));
            if (temperature <= 0.0f) {
                llama_sampler_chain_add(smpl.get(), llama_sampler_init_greedy());
            } else {
                llama_sampler_chain_add(smpl.get(), llama_sampler_init_temp(temperature));
                llama_sampler_chain_add(smpl.get(), llama_sampler_init_dist(seed));
            }

            t0 = ggml_time_us();
            start_sequence();
            eval(prompt);
            t1 = ggml_time_us();
            for (int32_t i = 0; i < max_tokens; ++i) {
                const llama_token t = llama_sampler_sample(smpl.get(), ctx_.get(), -1);
                if (i == 0) {
                    t1 = ggml_time_us(); // time to first token includes its sampling
                }
                if (llama_vocab_is_eog(vocab_, t)) {
                    break;
                }
                out.push_back(t);
                if (i + 1 < max_tokens) {
                    eval({ t });
                }
            }
            t2 = ggml_time_us();
        }
        py::dict d;
        d["tokens"]    = out;
        d["prefill_s"] = (t1 - t0) / 1e6;
        d["decode_s"]  = (t2 - t1) / 1e6;
        return d;
    }

    // Runs tokens through a fresh context in chunks of n_chunk (each chunk from an empty KV cache)
    // and returns, for each graph tensor named in names (e.g. "ffn_norm-3", "ffn_moe_topk-3"), its
    // rows: {name: float32 [n_rows, ne0]} (I32 tensors converted). For calibration tools (moefy,
    // routing traces).
    // a context of n_ctx tokens (one batch) whose graph evaluation calls cb on every node
    std::unique_ptr<llama_context, context_deleter> eval_context(uint32_t n_ctx, uint32_t n_ubatch, ggml_backend_sched_eval_callback cb,
                                                                 void * ud) const {
        llama_context_params cp = context_params(n_ctx, n_ctx, n_ubatch);
        cp.cb_eval           = cb;
        cp.cb_eval_user_data = ud;
        return std::unique_ptr<llama_context, context_deleter>(llama_init_from_model(model_.get(), cp));
    }

    // names of the graph nodes in the order one decode of tokens runs them (the scheduler asks the
    // eval callback about every node, in order)
    std::vector<std::string> node_order(const std::vector<llama_token> & tokens) {
        if (tokens.empty()) {
            throw std::invalid_argument("node_order: no tokens");
        }
        for (llama_token t : tokens) {
            check_token(t);
        }
        std::vector<std::string> names;
        auto cb = [](ggml_tensor * t, bool ask, void * ud) -> bool {
            if (ask) {
                ((std::vector<std::string> *) ud)->push_back(ggml_get_name(t));
            }
            return false;
        };
        py::gil_scoped_release release;
        std::unique_ptr<llama_context, context_deleter> c = eval_context((uint32_t) tokens.size(), (uint32_t) tokens.size(), cb, &names);
        if (!c) {
            throw std::runtime_error(path_ + ": node_order: failed to create a context");
        }
        std::vector<llama_token> tok = tokens;
        if (llama_decode(c.get(), llama_batch_get_one(tok.data(), (int32_t) tok.size())) != 0) {
            throw std::runtime_error(path_ + ": node_order: decode failed");
        }
        return names;
    }

    py::dict collect(const std::vector<llama_token> & tokens, const std::vector<std::string> & names, int32_t n_chunk) {
        for (llama_token t : tokens) {
            check_token(t);
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
            collector * c = (collector *) ud;
            auto it = c->rows.find(ggml_get_name(t));
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
                const size_t off = i1 * t->nb[1] + i2 * t->nb[2] + i3 * t->nb[3];
                if (t->type == GGML_TYPE_I32) {
                    ggml_backend_tensor_get(t, tmp_i.data(), off, t->ne[0] * sizeof(int32_t));
                    std::copy(tmp_i.begin(), tmp_i.end(), c->tmp.begin()); // expert ids are exact in float
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
            std::unique_ptr<llama_context, context_deleter> c = eval_context((uint32_t) n_chunk, (uint32_t) std::min(n_chunk, 512), cb, &col);
            if (!c) {
                throw std::runtime_error(path_ + ": collect: failed to create a context");
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
                    batch.logits[j]    = 1; // every row survives to the last layer
                }
                if (llama_decode(c.get(), batch) != 0) {
                    llama_batch_free(batch);
                    throw std::runtime_error(path_ + ": collect: decode failed");
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

    py::dict stats() const {
        py::dict d;
        moetier_cache_info info;
        if (moetier_model_cache_info(model_.get(), &info) != 0) {
            return d;
        }
        std::vector<moetier_layer_stats> ls(info.n_layers);
        moetier_model_layer_stats(model_.get(), ls.data(), (int32_t) ls.size());
        py::list layers;
        for (const auto & l : ls) {
            py::dict x;
            x["layer"]      = l.layer;
            x["lookups"]    = l.n_lookups;
            x["hits"]       = l.n_hits;
            x["misses"]     = l.n_misses;
            x["bytes_read"] = l.n_bytes_read;
            x["read_seconds"] = l.read_us / 1e6;
            x["hits_low"]   = l.n_hits_low;
            x["loads_high"] = l.n_loads_high;
            x["loads_low"]  = l.n_loads_low;
            x["skipped"]    = l.n_skipped;
            x["bytes_low"]  = l.n_bytes_low;
            layers.append(x);
        }
        d["layers"] = layers;
        return d;
    }

    py::dict cache_info() const {
        py::dict d;
        moetier_cache_info info;
        if (moetier_model_cache_info(model_.get(), &info) != 0) {
            return d;
        }
        d["n_layers"]        = info.n_layers;
        d["n_expert"]        = info.n_expert;
        d["n_groups"]        = info.n_groups;
        d["n_slots"]         = info.n_slots;
        d["n_slots_low"]     = info.n_slots_low;
        d["expert_bytes_low"] = info.expert_bytes_low;
        d["cache_bytes"]     = info.cache_bytes;
        d["expert_bytes"]    = info.expert_bytes;
        d["min_cache_bytes"] = info.min_cache_bytes;
        d["from_store"]      = info.from_store;
        d["direct_io"]       = info.direct_io;
        d["io_uring"]        = info.io_uring;
        return d;
    }

    void reset_stats() { moetier_model_reset_stats(model_.get()); }

    py::dict prefetch_stats() const {
        py::dict d;
        moetier_prefetch_stats ps;
        if (moetier_model_prefetch_stats(model_.get(), &ps) != 0) {
            return d;
        }
        d["issued"]       = ps.n_issued;
        d["hits"]         = ps.n_hits;
        d["waits"]        = ps.n_waits;
        d["claimed"]      = ps.n_claimed;
        d["cancelled"]    = ps.n_cancelled;
        d["wasted"]       = ps.n_wasted;
        d["bytes_read"]   = ps.bytes_read;
        d["bytes_wasted"] = ps.bytes_wasted;
        std::vector<uint64_t> pred(ps.n_pred, ps.n_pred + MOETIER_MAX_PREFETCH);
        std::vector<uint64_t> top1(ps.n_top1, ps.n_top1 + MOETIER_MAX_PREFETCH);
        std::vector<uint64_t> allk(ps.n_allk, ps.n_allk + MOETIER_MAX_PREFETCH);
        std::vector<uint64_t> any(ps.n_any, ps.n_any + MOETIER_MAX_PREFETCH);
        d["predictions"] = pred;
        d["top1"]        = top1;
        d["allk"]        = allk;
        d["any"]         = any;
        return d;
    }

    int32_t n_vocab() const { return llama_vocab_n_tokens(vocab_); }
    bool    has_cache() const { return moetier_model_has_cache(model_.get()); }

private:
    void check_token(llama_token t) const {
        if (t < 0 || t >= llama_vocab_n_tokens(vocab_)) {
            throw std::invalid_argument("token id " + std::to_string(t) + " is out of the vocabulary");
        }
    }

    void start_sequence() {
        llama_memory_clear(llama_get_memory(ctx_.get()), true);
        moetier_model_reset_sequence(model_.get());
    }

    // decodes tokens in n_batch pieces, logits for the last one only
    void eval(const std::vector<llama_token> & tokens) {
        for (llama_token t : tokens) {
            check_token(t);
        }
        const int32_t n_batch = (int32_t) llama_n_batch(ctx_.get());
        for (size_t i = 0; i < tokens.size(); i += n_batch) {
            const int32_t n = (int32_t) std::min<size_t>(n_batch, tokens.size() - i);
            llama_batch batch = llama_batch_get_one(const_cast<llama_token *>(tokens.data() + i), n);
            const int32_t rc = llama_decode(ctx_.get(), batch);
            if (rc != 0) {
                std::string why = moetier_model_error(model_.get());
                moetier_model_clear_error(model_.get());
                if (why.empty()) {
                    why = "llama_decode returned " + std::to_string(rc);
                }
                throw std::runtime_error(path_ + ": decode failed: " + why);
            }
        }
    }

    std::string path_;
    std::string store_;
    std::string policy_;
    int32_t     n_threads_ = 1;
    std::unique_ptr<llama_model, model_deleter>     model_;
    std::unique_ptr<llama_context, context_deleter> ctx_;
    const llama_vocab * vocab_ = nullptr;

    ggml_type type_k_;
    ggml_type type_v_;
    int       flash_attn_;

    static ggml_type kv_type_of(const char * what, const std::string & name) {
        // the types the KV cache can hold (llama.cpp's common/arg.cpp kv_cache_types): others fail
        // deep in llama.cpp, or abort in compute
        static const ggml_type kv_types[] = {
            GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_BF16, GGML_TYPE_Q8_0, GGML_TYPE_Q4_0,
            GGML_TYPE_Q4_1, GGML_TYPE_IQ4_NL, GGML_TYPE_Q5_0, GGML_TYPE_Q5_1,
        };
        std::string names;
        for (ggml_type t : kv_types) {
            if (name == ggml_type_name(t)) {
                return t;
            }
            names += std::string(names.empty() ? "" : ", ") + ggml_type_name(t);
        }
        throw std::invalid_argument(std::string(what) + ": '" + name + "' is not a KV cache type (one of " + names + ")");
    }

    // every context of the model (generation, collect, node_order): the same threads and attention
    llama_context_params context_params(uint32_t n_ctx, uint32_t n_batch, uint32_t n_ubatch) const {
        llama_context_params cp = llama_context_default_params();
        cp.n_ctx           = n_ctx;
        cp.n_batch         = n_batch;
        cp.n_ubatch        = n_ubatch;
        cp.n_threads       = n_threads_;
        cp.n_threads_batch = n_threads_;
        cp.no_perf         = true;
        cp.type_k          = type_k_;
        cp.type_v          = type_v_;
        cp.flash_attn_type = (llama_flash_attn_type) flash_attn_;
        return cp;
    }
};

} // namespace

void register_model(py::module_ & m) {
    py::class_<py_model>(m, "Model")
        .def(py::init<const std::string &, uint64_t, const std::string &, const std::string &, bool, uint32_t, int32_t, uint32_t,
                      uint32_t, bool, const std::string &, const std::string &, const std::string &, int>(),
             py::arg("path"), py::arg("cache_bytes"), py::arg("store_dir"), py::arg("policy"), py::arg("direct_io"),
             py::arg("n_ctx"), py::arg("n_threads"), py::arg("n_batch"), py::arg("n_ubatch"), py::arg("repack") = true, py::arg("opts") = "", py::arg("type_k") = "f16",
             py::arg("type_v") = "f16", py::arg("flash_attn") = -1)
        .def("tokenize", &py_model::tokenize, py::arg("text"), py::arg("add_special") = true)
        .def("detokenize", &py_model::detokenize, py::arg("tokens"))
        .def("logits", &py_model::logits, py::arg("tokens"))
        .def("generate", &py_model::generate, py::arg("prompt"), py::arg("max_tokens"), py::arg("temperature") = 0.0f,
             py::arg("seed") = 0)
        .def("collect", &py_model::collect, py::arg("tokens"), py::arg("names"), py::arg("n_chunk") = 512)
        .def("node_order", &py_model::node_order, py::arg("tokens"))
        .def("stats", &py_model::stats)
        .def("cache_info", &py_model::cache_info)
        .def("reset_stats", &py_model::reset_stats)
        .def("prefetch_stats", &py_model::prefetch_stats)
        .def_property_readonly("n_vocab", &py_model::n_vocab)
        .def_property_readonly("has_cache", &py_model::has_cache);
}
