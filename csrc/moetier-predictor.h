#pragma once

// A fitted prefetch predictor (moetier fit-predictor): per served layer l and distance d, a linear map
// from l's gate input to layer l + d's router logits (W [n_embd, n_expert], bias [n_expert]), fitted
// by ridge regression on calibration text. The prefetcher runs it where HOBBIT's stacked gate runs
// the next layers' routers: the same matmul on the same graph node, another matrix. It lives next to
// the store (<store>/predictor.gguf) or the model (<model>.predictor.gguf), as a GGUF of arch
// "moetier-predictor" that names the model it was fitted on.

#include "ggml-cpp.h"
#include "ggml.h"
#include "gguf.h"

#include <cstdint>
#include <string>

// where the predictor of a model (and store, "" for none) lives
std::string moetier_predictor_path(const std::string & model_path, const std::string & store_dir);

// the model identity a predictor names (moetier_model_identity_compute as text)
std::string moetier_predictor_model_key(const std::string & model_path);

class moetier_predictor_file {
  public:
    // throws std::runtime_error naming path: unreadable, another arch, fitted on another model
    // (model_key), or shapes other than n_embd x n_expert
    moetier_predictor_file(const std::string & path, const std::string & model_key, int64_t n_embd, int64_t n_expert);

    // the map from layer il's gate input to layer il + d's logits, nullptr if the file has none
    const ggml_tensor * weight(int32_t il, int32_t d) const;

    // its bias [n_expert], nullptr if none
    const float * bias(int32_t il, int32_t d) const;

  private:
    gguf_context_ptr gguf;
    ggml_context_ptr ctx;  // the tensors, with their data
};
