#pragma once

// Registration functions of the moetier._core module, one per concept (boost-histogram's shape), and
// what they share.

#include "moetier.h"

#include <pybind11/pybind11.h>

#include <string>

void register_errors(pybind11::module_ & m);
void register_log(pybind11::module_ & m);
void register_params(pybind11::module_ & m);
void register_model(pybind11::module_ & m);
void register_trace(pybind11::module_ & m);
void register_store(pybind11::module_ & m);
void register_ops(pybind11::module_ & m);
void register_policy(pybind11::module_ & m);

// the C struct behind a bound moetier._core.Params (register-params.cpp)
const moetier_params & moetier_py_params_of(const pybind11::object & params);

// the last ERROR line llama.cpp or moetier logged on any thread, for messages of failed loads
std::string moetier_py_last_logged_error();
void        moetier_py_clear_logged_error();

// An error of the C API on its way to Python: register_errors translates it into the exception
// class of its kind (moetier.ConfigError, StoreError or ModelError; IO and unknown kinds are
// ModelError).
struct moetier_py_error {
    moetier_error_kind kind;
    std::string        msg;
};
