#pragma once

// Pending cache configurations: moetier_model_configure leaves one per model path and thread, the
// next load of that path on that thread takes it. llama_model_params stays stock llama.cpp's (its size and layout are part of
// the ABI that llama-cpp-python's ctypes bindings declare), so the configuration travels beside it.

#include "moetier.h"

#include <string>

// moetier_params with its own copies of the strings it points to
struct moetier_params_copy {
    moetier_params p = moetier_default_params();
    std::string    store_dir;
    std::string    policy;

    moetier_params_copy() = default;
    explicit moetier_params_copy(const moetier_params & from);
    moetier_params_copy(const moetier_params_copy & other);
    moetier_params_copy & operator=(const moetier_params_copy & other);

  private:
    void point();  // p's strings -> our copies
};

// params nullptr: removes the pending configuration of path
void moetier_pending_set(const std::string & path, const moetier_params * params);

// takes (removes) the pending configuration of path; false if there is none
bool moetier_pending_take(const std::string & path, moetier_params_copy & out);
