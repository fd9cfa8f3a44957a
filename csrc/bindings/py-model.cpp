#include "py-model.h"

#include "moetier.h"

#include <stdexcept>
#include <string>

namespace py = pybind11;

// The devices a model may use, as llama.cpp chooses them by default (RPC servers first, then GPUs,
// then integrated GPUs if there is no GPU) but only the RPC servers named in rpc: the registry keeps
// every server registered in the process, and a load that touched one no longer running (llama.cpp
// asks each device's free memory) would abort the process.
static std::vector<ggml_backend_dev_t> py_model_devices(const std::string & rpc) {
    std::vector<ggml_backend_dev_t> remote, gpus, igpus;
    const std::string               list = "," + rpc + ",";
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t               dev = ggml_backend_dev_get(i);
        const enum ggml_backend_dev_type t   = ggml_backend_dev_type(dev);
        if (t == GGML_BACKEND_DEVICE_TYPE_GPU) {
            if (std::string(ggml_backend_reg_name(ggml_backend_dev_backend_reg(dev))) == "RPC") {
                // the description is the endpoint the device was added with
                if (list.find("," + std::string(ggml_backend_dev_description(dev)) + ",") != std::string::npos) {
                    remote.push_back(dev);
                }
            } else {
                gpus.push_back(dev);
            }
        } else if (t == GGML_BACKEND_DEVICE_TYPE_IGPU) {
            igpus.push_back(dev);
        }
    }
    std::vector<ggml_backend_dev_t> out = remote;
    out.insert(out.end(), gpus.begin(), gpus.end());
    if (gpus.empty()) {
        out.insert(out.end(), igpus.begin(), igpus.end());
    }
    out.push_back(nullptr);
    return out;
}

py_model::py_model(const std::string &              path,
                   const moetier_params &           params,
                   const llama_context_params &     cparams,
                   bool                             repack,
                   int32_t                          n_gpu_layers,
                   const std::string &              rpc,
                   const std::vector<std::string> & overrides) :
    path_(path),
    cparams_(cparams) {
    llama_model_params mp = llama_model_default_params();
    // repacked weights are anonymous copies: a memory cap cannot page them out like mmap'ed ones
    mp.use_extra_bufts    = repack;
    mp.n_gpu_layers       = n_gpu_layers;
    if (!rpc.empty() && !moetier_rpc_add_servers(rpc.c_str())) {
        throw moetier_py_error{ MOETIER_ERROR_CONFIG, moetier_last_error() };
    }
    for (const std::string & o : overrides) {
        const size_t eq = o.find('=');
        if (eq == std::string::npos || eq == 0) {
            throw moetier_py_error{ MOETIER_ERROR_CONFIG,
                                    "tensor override '" + o + "': expected PATTERN=BUFFER_TYPE (e.g. exps=CPU)" };
        }
        ggml_backend_buffer_type_t buft = moetier_buffer_type_by_name(o.substr(eq + 1).c_str());
        if (buft == nullptr) {
            throw moetier_py_error{ MOETIER_ERROR_CONFIG, "tensor override '" + o + "': " + moetier_last_error() };
        }
        override_patterns_.push_back(o.substr(0, eq));
        overrides_.push_back({ nullptr, buft });
    }
    devices_   = py_model_devices(rpc);
    mp.devices = devices_.data();
    if (!overrides_.empty()) {
        for (size_t i = 0; i < overrides_.size(); ++i) {
            overrides_[i].pattern = override_patterns_[i].c_str();  // the vector no longer grows
        }
        overrides_.push_back({ nullptr, nullptr });
        mp.tensor_buft_overrides = overrides_.data();
    }

    llama_model *      m    = nullptr;
    moetier_error_kind kind = MOETIER_ERROR_NONE;
    std::string        why;
    {
        py::gil_scoped_release release;
        moetier_py_clear_logged_error();
        m = moetier_model_load(path.c_str(), mp, &params);
        if (!m) {
            kind = moetier_last_error_kind();
            why  = moetier_last_error();
            if (why.empty()) {
                why = moetier_py_last_logged_error();
            }
        }
    }
    if (!m) {
        throw moetier_py_error{ kind == MOETIER_ERROR_NONE ? MOETIER_ERROR_MODEL : kind,
                                path +
                                    ": failed to load model: " + (why.empty() ? "unknown error (see the log)" : why) };
    }
    model_.reset(m);
    vocab_ = llama_model_get_vocab(m);

    llama_context_params cp = cparams_;
    ctx_.reset(llama_init_from_model(m, cp));
    if (!ctx_) {
        throw moetier_py_error{ MOETIER_ERROR_MODEL,
                                path + ": failed to create a context: " + moetier_py_last_logged_error() };
    }
    if (moetier_model_has_cache(m)) {
        llama_set_abort_callback(ctx_.get(), moetier_abort_callback, m);
    }
}

void py_model::abort_after(int64_t n) {
    abort_after_ = n;
    llama_set_abort_callback(ctx_.get(), abort_callback, this);
}

bool py_model::abort_callback(void * self) {
    py_model * pm = (py_model *) self;
    if (pm->abort_after_ >= 0 && pm->abort_after_-- == 0) {
        return true;
    }
    return moetier_abort_callback(pm->model_.get());
}

void py_model::check_token(llama_token t) const {
    if (t < 0 || t >= llama_vocab_n_tokens(vocab_)) {
        throw std::invalid_argument("token id " + std::to_string(t) + " is out of the vocabulary");
    }
}

py_context_ptr py_model::eval_context(uint32_t                         n_ctx,
                                      uint32_t                         n_ubatch,
                                      ggml_backend_sched_eval_callback cb,
                                      void *                           ud) const {
    llama_context_params cp = cparams_;
    cp.n_ctx                = n_ctx;
    cp.n_batch              = n_ctx;
    cp.n_ubatch             = n_ubatch;
    cp.cb_eval              = cb;
    cp.cb_eval_user_data    = ud;
    return py_context_ptr(llama_init_from_model(model_.get(), cp));
}

void py_model::throw_model_error(const std::string & what, int32_t rc) const {
    std::string        why  = moetier_model_error(model_.get());
    moetier_error_kind kind = moetier_model_error_kind(model_.get());
    moetier_model_clear_error(model_.get());
    if (why.empty()) {
        why  = "llama_decode returned " + std::to_string(rc);
        kind = MOETIER_ERROR_MODEL;
    }
    throw moetier_py_error{ kind, path_ + ": " + what + ": " + why };
}
