#pragma once

// moetier._core.Model: a llama.cpp model + context, with or without the expert cache. Declared here
// for the bindings that work on a model (register-model.cpp, register-trace.cpp).

#include "bindings.h"
#include "llama.h"

#include <memory>
#include <string>
#include <vector>

struct py_model_deleter {
    void operator()(llama_model * m) const { llama_model_free(m); }
};

struct py_context_deleter {
    void operator()(llama_context * c) const { llama_free(c); }
};

using py_context_ptr = std::unique_ptr<llama_context, py_context_deleter>;

class py_model {
  public:
    // throws moetier_py_error (the kind the C API reports) naming path
    // n_gpu_layers: layers offloaded to a GPU or an RPC server, as -ngl; rpc: "HOST:PORT,..." as --rpc;
    // overrides: "PATTERN=BUFFER_TYPE" each, as -ot
    py_model(const std::string &              path,
             const moetier_params &           params,
             const llama_context_params &     cparams,
             bool                             repack,
             int32_t                          n_gpu_layers = 0,
             const std::string &              rpc          = "",
             const std::vector<std::string> & overrides    = {});

    // the context's abort callback points at this object
    py_model(const py_model &)             = delete;
    py_model & operator=(const py_model &) = delete;

    const std::string & path() const { return path_; }

    llama_model * model() const { return model_.get(); }

    llama_context * ctx() const { return ctx_.get(); }

    const llama_vocab * vocab() const { return vocab_; }

    // throws std::invalid_argument if t is not a token of the vocabulary
    void check_token(llama_token t) const;

    // a context of n_ctx tokens (one batch) like the model's own (threads, attention, KV types)
    // whose graph evaluation calls cb on every node
    py_context_ptr eval_context(uint32_t                         n_ctx,
                                uint32_t                         n_ubatch,
                                ggml_backend_sched_eval_callback cb,
                                void *                           ud) const;

    // the C API's expert read error as a Python error of its kind, with what (e.g. "decode failed")
    [[noreturn]] void throw_model_error(const std::string & what, int32_t rc) const;

    // fault injection for tests: the next graph computation stops after n more nodes, as a user's
    // abort callback (or llama-server cancelling a request) would stop it. -1: never
    void abort_after(int64_t n);

  private:
    std::string                                    path_;
    llama_context_params                           cparams_;
    std::unique_ptr<llama_model, py_model_deleter> model_;
    py_context_ptr                                 ctx_;
    const llama_vocab *                            vocab_ = nullptr;
    std::vector<std::string>                       override_patterns_;  // -ot patterns (the loader reads them)
    std::vector<llama_model_tensor_buft_override>  overrides_;          // ends with {nullptr, nullptr}
    std::vector<ggml_backend_dev_t>                devices_;            // the model's, ends with nullptr
    int64_t                                        abort_after_ = -1;

    // the context's abort callback: abort_after's countdown, then moetier's (a failed expert read)
    static bool abort_callback(void * self);
};
