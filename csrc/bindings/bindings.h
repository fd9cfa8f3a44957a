#pragma once

// Registration functions of the moetier._core module, one per concept.

#include <pybind11/pybind11.h>

void register_log(pybind11::module_ & m);
void register_model(pybind11::module_ & m);
void register_store(pybind11::module_ & m);
void register_ops(pybind11::module_ & m);
void register_policy(pybind11::module_ & m);

// the last ERROR line llama.cpp or moetier logged on any thread, for messages of failed loads
std::string moetier_py_last_logged_error();
void        moetier_py_clear_logged_error();
