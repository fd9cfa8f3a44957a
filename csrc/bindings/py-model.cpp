#include "py-model.h"

#include "moetier.h"

#include <stdexcept>
#include <string>

namespace py = pybind11;

py_model::py_model(const std::string &          path,
                   const moetier_params &       params,
                   const llama_context_params & cparams,
                   bool                         repack,
                   int32_t                      n_gpu_layers) :
    path_(path),
    cparams_(cparams) {
    llama_model_params mp = llama_model_default_params();
    // repacked weights are anonymous copies: a memory cap cannot page them out like mmap'ed ones
    mp.use_extra_bufts    = repack;
    mp.n_gpu_layers       = n_gpu_layers;

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
