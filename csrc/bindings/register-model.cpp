// moetier._core.Model: generation, logits and the expert cache's counters of one model. The stats
// cross as the C structs themselves (moetier_layer_stats, moetier_prefetch_stats), bound field for
// field from one list each.

#include "ggml.h"
#include "llama.h"
#include "moetier.h"
#include "py-model.h"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace py = pybind11;

// the fields of moetier_layer_stats and moetier_prefetch_stats, in struct order
// clang-format off
#define MOETIER_LAYER_STATS_FIELDS(X) \
    X(layer) X(n_lookups) X(n_hits) X(n_misses) X(n_bytes_read) X(read_us) X(n_hits_low) X(n_loads_high) \
    X(n_loads_low) X(n_skipped) X(n_bytes_low) X(n_vram_hits) X(n_vram_copies) X(n_vram_bytes) X(vram_copy_us) X(n_vram_cpu)
#define MOETIER_PREFETCH_STATS_FIELDS(X) \
    X(n_issued) X(n_hits) X(n_waits) X(n_claimed) X(n_cancelled) X(n_wasted) X(bytes_read) X(bytes_wasted) \
    X(n_capped) X(n_busy) X(n_steps_on) X(n_steps_off) X(step_us_on) X(step_us_off)
#define MOETIER_PREFETCH_STATS_ARRAYS(X) X(n_pred) X(n_top1) X(n_allk) X(n_any)
// clang-format on

namespace {

void start_sequence(py_model & pm) {
    llama_memory_clear(llama_get_memory(pm.ctx()), true);
    moetier_model_reset_sequence(pm.model());
}

// decodes tokens in n_batch pieces, logits for the last one only; false + rc on failure
bool eval(py_model & pm, const std::vector<llama_token> & tokens, int32_t & rc) {
    const int32_t n_batch = (int32_t) llama_n_batch(pm.ctx());
    for (size_t i = 0; i < tokens.size(); i += n_batch) {
        const int32_t n     = (int32_t) std::min<size_t>(n_batch, tokens.size() - i);
        llama_batch   batch = llama_batch_get_one(const_cast<llama_token *>(tokens.data() + i), n);
        rc                  = llama_decode(pm.ctx(), batch);
        if (rc != 0) {
            return false;
        }
    }
    return true;
}

// tokens past the context would make llama_decode fail with a bare code: say what is wrong instead
void check_fits(const py_model & pm, size_t n_tokens, const char * what) {
    const uint32_t n_ctx = llama_n_ctx(pm.ctx());
    if (n_tokens > n_ctx) {
        throw moetier_py_error{ MOETIER_ERROR_CONFIG, pm.path() + ": " + what + " of " + std::to_string(n_tokens) +
                                                          " tokens does not fit the context of " +
                                                          std::to_string(n_ctx) +
                                                          " tokens; load the model with a larger n_ctx" };
    }
}

std::vector<llama_token> tokenize(const py_model & pm, const std::string & text, bool add_special) {
    std::vector<llama_token> out(text.size() + 8);
    int32_t n = llama_tokenize(pm.vocab(), text.data(), (int32_t) text.size(), out.data(), (int32_t) out.size(),
                               add_special, true);
    if (n < 0) {
        out.resize(-n);
        n = llama_tokenize(pm.vocab(), text.data(), (int32_t) text.size(), out.data(), (int32_t) out.size(),
                           add_special, true);
    }
    if (n < 0) {
        throw std::runtime_error("tokenize failed");
    }
    out.resize(n);
    return out;
}

py::bytes detokenize(const py_model & pm, const std::vector<llama_token> & tokens) {
    std::string out;
    char        buf[256];
    for (llama_token t : tokens) {
        pm.check_token(t);
        const int32_t n = llama_token_to_piece(pm.vocab(), t, buf, sizeof(buf), 0, false);
        if (n > 0) {
            out.append(buf, n);
        }
    }
    return py::bytes(out);
}

// messages (role, content) rendered by the model's chat template (the GGUF's tokenizer.chat_template,
// through llama.cpp's built-in renderers, as llama-server's legacy path) with the assistant's turn opened
std::string chat_prompt(const py_model & pm, const std::vector<std::pair<std::string, std::string>> & messages) {
    const char * tmpl = llama_model_chat_template(pm.model(), nullptr);
    if (tmpl == nullptr) {
        throw moetier_py_error{ MOETIER_ERROR_MODEL, pm.path() +
                                                         ": the model has no chat template (tokenizer.chat_template); "
                                                         "send a plain completion instead" };
    }
    std::vector<llama_chat_message> msgs;
    size_t                          total = 0;
    for (const auto & [role, content] : messages) {
        msgs.push_back({ role.c_str(), content.c_str() });
        total += role.size() + content.size();
    }
    std::vector<char> buf(2 * total + 256);
    int32_t n = llama_chat_apply_template(tmpl, msgs.data(), msgs.size(), true, buf.data(), (int32_t) buf.size());
    if (n > (int32_t) buf.size()) {
        buf.resize(n);
        n = llama_chat_apply_template(tmpl, msgs.data(), msgs.size(), true, buf.data(), (int32_t) buf.size());
    }
    if (n < 0) {
        throw moetier_py_error{ MOETIER_ERROR_MODEL, pm.path() +
                                                         ": llama.cpp has no built-in renderer for this chat "
                                                         "template; send a plain completion instead" };
    }
    return std::string(buf.data(), n);
}

// last-position logits of tokens, from an empty context
py::array_t<float> logits(py_model & pm, const std::vector<llama_token> & tokens) {
    if (tokens.empty()) {
        throw std::invalid_argument("logits: no tokens");
    }
    for (llama_token t : tokens) {
        pm.check_token(t);
    }
    check_fits(pm, tokens.size(), "logits: the input");
    int32_t rc = 0;
    bool    ok;
    {
        py::gil_scoped_release release;
        start_sequence(pm);
        ok = eval(pm, tokens, rc);
    }
    if (!ok) {
        pm.throw_model_error("decode failed", rc);
    }
    const int32_t      n_vocab = llama_vocab_n_tokens(pm.vocab());
    py::array_t<float> out(n_vocab);
    const float *      l = llama_get_logits_ith(pm.ctx(), -1);
    std::copy(l, l + n_vocab, out.mutable_data());
    return out;
}

// generated tokens after prompt (temperature 0 = greedy), with the prompt-processing time (up to
// the first sampled token) and the decode time of the rest; on_first_token (if not None) is called
// once between the two, outside both times, so a caller can split its own counters there
py::dict generate(py_model &                       pm,
                  const std::vector<llama_token> & prompt,
                  int32_t                          max_tokens,
                  float                            temperature,
                  uint32_t                         seed,
                  const py::object &               on_first_token) {
    if (prompt.empty()) {
        throw moetier_py_error{ MOETIER_ERROR_CONFIG, "generate: empty prompt" };  // a ConfigError
    }
    for (llama_token t : prompt) {
        pm.check_token(t);
    }
    check_fits(pm, prompt.size(), "generate: the prompt");
    // generation stops where the context is full, as llama.cpp's tools stop
    const int32_t n_room = (int32_t) llama_n_ctx(pm.ctx()) - (int32_t) prompt.size();

    struct sampler_deleter {
        void operator()(llama_sampler * s) const { llama_sampler_free(s); }
    };

    std::vector<llama_token> out;
    int64_t                  t0 = 0, t1 = 0, t2 = 0, t_cb = 0;
    int32_t                  rc  = 0;
    bool                     ok  = true;
    bool                     eog = false;  // the model ended its answer (else the tokens or the context ran out)
    {
        py::gil_scoped_release release;

        std::unique_ptr<llama_sampler, sampler_deleter> smpl(
            llama_sampler_chain_init(llama_sampler_chain_default_params()));
        if (temperature <= 0.0f) {
            llama_sampler_chain_add(smpl.get(), llama_sampler_init_greedy());
        } else {
            llama_sampler_chain_add(smpl.get(), llama_sampler_init_temp(temperature));
            llama_sampler_chain_add(smpl.get(), llama_sampler_init_dist(seed));
        }

        t0 = ggml_time_us();
        start_sequence(pm);
        ok = eval(pm, prompt, rc);
        t1 = ggml_time_us();
        for (int32_t i = 0; ok && i < max_tokens && (int32_t) out.size() < n_room; ++i) {
            const llama_token t = llama_sampler_sample(smpl.get(), pm.ctx(), -1);
            if (i == 0) {
                t1 = ggml_time_us();  // time to first token includes its sampling
                if (!on_first_token.is_none()) {
                    py::gil_scoped_acquire gil;
                    on_first_token();  // a Python exception propagates (the sampler is freed by RAII)
                    t_cb = ggml_time_us() - t1;
                }
            }
            if (llama_vocab_is_eog(pm.vocab(), t)) {
                eog = true;
                break;
            }
            out.push_back(t);
            if (i + 1 < max_tokens && (int32_t) out.size() < n_room) {
                ok = eval(pm, { t }, rc);
            }
        }
        t2 = ggml_time_us();
    }
    if (!ok) {
        pm.throw_model_error("decode failed", rc);
    }
    py::dict d;
    d["tokens"]    = out;
    d["prefill_s"] = (t1 - t0) / 1e6;
    d["decode_s"]  = (t2 - t1 - t_cb) / 1e6;
    d["stop"]      = eog ? "eog" : (int32_t) out.size() >= n_room ? "context" : "length";
    return d;
}

py::dict cache_info(const llama_model * model) {
    py::dict           d;
    moetier_cache_info info;
    if (moetier_model_cache_info(model, &info) != 0) {
        return d;
    }
    d["n_layers"]         = info.n_layers;
    d["n_expert"]         = info.n_expert;
    d["n_groups"]         = info.n_groups;
    d["n_slots"]          = info.n_slots;
    d["n_slots_low"]      = info.n_slots_low;
    d["n_held"]           = info.n_held;
    d["expert_bytes_low"] = info.expert_bytes_low;
    d["cache_bytes"]      = info.cache_bytes;
    d["expert_bytes"]     = info.expert_bytes;
    d["min_cache_bytes"]  = info.min_cache_bytes;
    d["n_slots_vram"]     = info.n_slots_vram;
    d["n_repacked"]       = info.n_repacked;
    d["n_huge"]           = info.n_huge;
    d["vram_bytes"]       = info.vram_bytes;
    d["vram_copy_us"]     = info.vram_copy_us;
    d["vram_cpu_us"]      = info.vram_cpu_us;
    d["weights_locked"]   = info.weights_locked;
    d["reads_checked"]    = info.reads_checked;
    d["t1"]               = info.t1;
    d["t2"]               = info.t2;
    d["exact"]            = info.exact;
    d["from_store"]       = info.from_store;
    d["direct_io"]        = info.direct_io;
    d["io_uring"]         = info.io_uring;
    d["grow"]             = info.grow;
    d["n_slots_budget"]   = info.n_slots_budget;
    d["n_slots_max"]      = info.n_slots_max;
    d["budget_bytes"]     = info.budget_bytes;
    d["n_grown"]          = info.n_grown;
    d["n_shrunk"]         = info.n_shrunk;
    d["free_bytes"]       = info.free_bytes;
    d["free_margin"]      = info.free_margin;
    return d;
}

std::vector<moetier_layer_stats> layer_stats(const llama_model * model) {
    moetier_cache_info info;
    if (moetier_model_cache_info(model, &info) != 0) {
        return {};
    }
    std::vector<moetier_layer_stats> ls(info.n_layers);
    moetier_model_layer_stats(model, ls.data(), (int32_t) ls.size());
    return ls;
}

// a llama_model that another binding loaded (llama-cpp-python's ctypes): its address
const llama_model * model_at(uintptr_t addr) {
    if (addr == 0) {
        throw std::invalid_argument("no model (null pointer)");
    }
    return reinterpret_cast<const llama_model *>(addr);
}

moetier_prefetch_stats prefetch_stats(const py_model & pm) {
    moetier_prefetch_stats ps;
    moetier_model_prefetch_stats(pm.model(), &ps);  // all zero without a cache
    return ps;
}

}  // namespace

void register_model(py::module_ & m) {
    py::class_<moetier_layer_stats> ls(
        m, "LayerStats", "moetier_layer_stats: the counters of one MoE layer (layer = -1: summed over layers)");
    ls.def(py::init([]() {
        moetier_layer_stats s = {};
        s.layer               = -1;
        return s;
    }));
#define X(f) ls.def_readonly(#f, &moetier_layer_stats::f);
    MOETIER_LAYER_STATS_FIELDS(X)
#undef X
    ls.def("_asdict", [](const moetier_layer_stats & s) {
        py::dict d;
#define X(f) d[#f] = s.f;
        MOETIER_LAYER_STATS_FIELDS(X)
#undef X
        return d;
    });
    ls.def("__repr__", [](const moetier_layer_stats & s) {
        std::string r = "LayerStats(";
#define X(f) r += std::string(#f) + "=" + std::to_string(s.f) + ", ";
        MOETIER_LAYER_STATS_FIELDS(X)
#undef X
        r.resize(r.size() - 2);
        return r + ")";
    });

    py::class_<moetier_prefetch_stats> ps(
        m, "PrefetchStats",
        "moetier_prefetch_stats: prefetch counters; the n_pred..n_any lists hold one entry per distance 1..8");
    ps.def(py::init([]() {
        moetier_prefetch_stats s = {};
        return s;
    }));
#define X(f) ps.def_readonly(#f, &moetier_prefetch_stats::f);
    MOETIER_PREFETCH_STATS_FIELDS(X)
#undef X
#define X(f)                  \
    ps.def_property_readonly( \
        #f, [](const moetier_prefetch_stats & s) { return std::vector<uint64_t>(s.f, s.f + MOETIER_MAX_PREFETCH); });
    MOETIER_PREFETCH_STATS_ARRAYS(X)
#undef X
    ps.def("_asdict", [](const moetier_prefetch_stats & s) {
        py::dict d;
#define X(f) d[#f] = s.f;
        MOETIER_PREFETCH_STATS_FIELDS(X)
#undef X
#define X(f) d[#f] = std::vector<uint64_t>(s.f, s.f + MOETIER_MAX_PREFETCH);
        MOETIER_PREFETCH_STATS_ARRAYS(X)
#undef X
        return d;
    });

    // the cache of a model that llama-cpp-python loaded on this libllama (moetier.Llama)
    m.def(
        "configure_load",
        [](const std::string & path, const py::object & params) {
            const bool ok = params.is_none() ? moetier_model_configure(path.c_str(), nullptr) :
                                               moetier_model_configure(path.c_str(), &moetier_py_params_of(params));
            if (!ok) {
                throw moetier_py_error{ moetier_last_error_kind(), path + ": " + moetier_last_error() };
            }
        },
        py::arg("path"), py::arg("params"),
        "configures the expert cache of the next load of path (None: removes a pending configuration)");
    m.def(
        "last_error", []() { return std::string(moetier_last_error()); },
        "the last moetier error of this thread ('' if none)");
    m.def(
        "has_cache_at", [](uintptr_t addr) { return moetier_model_has_cache(model_at(addr)); }, py::arg("model"),
        "whether the llama_model at this address serves its experts from the cache");
    m.def(
        "stats_at",
        [](uintptr_t addr) {
            const llama_model * model = model_at(addr);
            return py::make_tuple(moetier_model_stats_total(model), layer_stats(model));
        },
        py::arg("model"), "(total, per-layer) counters of the llama_model at this address");
    m.def(
        "cache_info_at", [](uintptr_t addr) { return cache_info(model_at(addr)); }, py::arg("model"),
        "the cache_info of the llama_model at this address");
    m.def(
        "budget_note_at", [](uintptr_t addr) { return std::string(moetier_model_budget_note(model_at(addr))); },
        py::arg("model"), "the budget_note of the llama_model at this address");
    m.def(
        "raise_read_error_at",
        [](uintptr_t addr, const std::string & what) {
            // the model is llama-cpp-python's: clearing its error is not a change of its weights
            auto *             model = const_cast<llama_model *>(model_at(addr));
            std::string        why   = moetier_model_error(model);
            moetier_error_kind kind  = moetier_model_error_kind(model);
            if (why.empty()) {
                return;
            }
            moetier_model_clear_error(model);
            throw moetier_py_error{ kind, what + ": " + why };
        },
        py::arg("model"), py::arg("what"),
        "if an expert read of the llama_model at this address failed (its decode returned 2), raises the typed "
        "error 'WHAT: why' (the file, layer and expert) and clears it; else nothing");

    m.def(
        "share_cache",
        [](const std::vector<py_model *> & models) {
            std::vector<llama_model *> ms;
            for (py_model * pm : models) {
                ms.push_back(pm->model());
            }
            if (!moetier_models_share_cache(ms.data(), (int32_t) ms.size())) {
                throw moetier_py_error{ moetier_last_error_kind(), moetier_last_error() };
            }
        },
        py::arg("models"),
        "fine-tuned variants of one MoE, each loaded with its store (prefetch=0, warm=0), served from one expert "
        "cache: the first model's, over its budget; before any decode; decode one at a time; free them together");

    py::class_<py_model>(m, "Model")
        .def(py::init([](const std::string & path, const py::object & params, const llama_context_params & cparams,
                         bool repack, int32_t n_gpu_layers, const std::string & rpc,
                         const std::vector<std::string> & overrides) {
                 return new py_model(path, moetier_py_params_of(params), cparams, repack, n_gpu_layers, rpc, overrides);
             }),
             py::arg("path"), py::arg("params"), py::arg("context"), py::arg("repack") = true,
             py::arg("n_gpu_layers") = 0, py::arg("rpc") = "", py::arg("overrides") = std::vector<std::string>{},
             "params: Params (cache_bytes 0 = stock llama.cpp); context: ContextParams; n_gpu_layers: as -ngl; "
             "rpc: RPC servers HOST:PORT,... as --rpc; overrides: PATTERN=BUFFER_TYPE each, as -ot")
        .def("tokenize", &tokenize, py::arg("text"), py::arg("add_special") = true)
        .def("detokenize", &detokenize, py::arg("tokens"))
        .def("chat_prompt", &chat_prompt, py::arg("messages"))
        .def(
            "set_expert_keys",
            [](py_model & pm, const std::vector<int32_t> & keys) {
                if (!moetier_model_set_expert_keys(pm.model(), keys.data(), (int64_t) keys.size())) {
                    throw moetier_py_error{ moetier_last_error_kind(), moetier_last_error() };
                }
            },
            py::arg("keys"),
            "consolidation, for a model sharing a cache: keys[layer * n_expert + e] = v * n_expert + e, the copy of "
            "variant v serves expert e")
        .def("logits", &logits, py::arg("tokens"))
        .def("generate", &generate, py::arg("prompt"), py::arg("max_tokens"), py::arg("temperature") = 0.0f,
             py::arg("seed") = 0, py::arg("on_first_token") = py::none())
        .def(
            "layer_stats", [](const py_model & pm) { return layer_stats(pm.model()); },
            "the counters of each served layer (empty without a cache)")
        .def(
            "stats_total", [](const py_model & pm) { return moetier_model_stats_total(pm.model()); },
            "the counters summed over layers (all zero without a cache)")
        .def("prefetch_stats", &prefetch_stats)
        .def("cache_info", [](const py_model & pm) { return cache_info(pm.model()); })
        .def("reset_stats", [](py_model & pm) { moetier_model_reset_stats(pm.model()); })
        .def("_abort_after", &py_model::abort_after, py::arg("n_nodes"),
             "fault injection for tests: the next graph computation stops after n_nodes more nodes")
        .def_property_readonly(
            "warnings",
            [](const py_model & pm) {
                std::vector<std::string> out;
                for (int32_t i = 0; const char * w = moetier_model_warning(pm.model(), i); ++i) {
                    out.push_back(w);
                }
                return out;
            },
            "parameters that could not take effect as given (also logged at WARN level)")
        .def_property_readonly(
            "budget_note", [](const py_model & pm) { return std::string(moetier_model_budget_note(pm.model())); },
            "how the cache's budget was chosen (for an automatic one: the limit and what was subtracted)")
        .def_property_readonly(
            "prefetch_source",
            [](const py_model & pm) { return std::string(moetier_model_prefetch_source(pm.model())); },
            "what predicts the prefetches: 'stacked routers', 'fitted predictor PATH (N of M maps)', or ''")
        .def_property_readonly(
            "state_path", [](const py_model & pm) { return std::string(moetier_model_state_path(pm.model())); },
            "the warm-start sidecar ('' if warm is off or there is no cache)")
        .def(
            "save_state",
            [](const py_model & pm) {
                const int32_t rc = moetier_model_save_state(pm.model());
                if (rc < 0) {
                    throw moetier_py_error{ moetier_last_error_kind(), moetier_last_error() };
                }
                return rc == 0;
            },
            "writes the warm-start sidecar now; False if warm is off")
        .def(
            "warm_progress",
            [](const py_model & pm) {
                int32_t       n_read = 0;
                const int32_t n      = moetier_model_warm_progress(pm.model(), &n_read);
                return py::make_tuple(n, n_read);
            },
            "(experts the warm start reads, of which read so far)")
        .def(
            "read_hist",
            [](const py_model & pm) -> py::object {
                moetier_read_hist h;
                if (moetier_model_read_hist(pm.model(), &h) != 0) {
                    return py::none();
                }
                py::dict d;
                d["le_us"]  = std::vector<uint64_t>(h.le_us, h.le_us + MOETIER_READ_HIST_BUCKETS);
                d["count"]  = std::vector<uint64_t>(h.count, h.count + MOETIER_READ_HIST_BUCKETS);
                d["n"]      = h.n;
                d["sum_us"] = h.sum_us;
                return d;
            },
            "latencies of expert reads: per bucket (le_us) a count; None without a cache")
        .def(
            "prometheus",
            [](const py_model & pm, const std::string & prefix) {
                std::string out(moetier_model_prometheus(pm.model(), prefix.c_str(), nullptr, 0) + 1, '\0');
                out.resize(moetier_model_prometheus(pm.model(), prefix.c_str(), out.data(), out.size()));
                return out;
            },
            py::arg("prefix") = "llamacpp:", "the cache's extra /metrics text (histogram, size, prefetch, warm start)")
        .def_property_readonly("n_vocab", [](const py_model & pm) { return llama_vocab_n_tokens(pm.vocab()); })
        // the context llama.cpp made, which may be larger than the one asked for (it pads n_ctx)
        .def_property_readonly("n_ctx", [](const py_model & pm) { return llama_n_ctx(pm.ctx()); })
        .def_property_readonly("has_cache", [](const py_model & pm) { return moetier_model_has_cache(pm.model()); });
}
