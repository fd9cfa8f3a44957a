#pragma once

// The option table of moetier_params: one row per field (name, type, range, help). It drives the
// KEY=VALUE parser of --expert-opt, the checker, the help text of the patched tools and, through
// the bindings, the defaults and help of Python's CacheConfig. A new knob is one field in
// moetier_params, one line in moetier_default_params and one row here.

#include "moetier.h"

#include <string>

// the row named name, or nullptr
const moetier_param_info * moetier_param_find(const std::string & name);
