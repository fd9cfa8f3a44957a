// llama.cpp and moetier share one log stream (llama_log_set). Messages at or above the chosen
// level go to stderr; the last ERROR line is kept so a failed load can say why (and is printed only
// at INFO or DEBUG level, since the exception already carries it).

#include "bindings.h"
#include "llama.h"

#include <atomic>
#include <cstdio>
#include <mutex>
#include <string>

namespace py = pybind11;

namespace {

struct log_state {
    std::atomic<int> min_level{ GGML_LOG_LEVEL_WARN };
    std::mutex       mutex;
    std::string      last_error;
    std::string      partial;  // an ERROR message may arrive in pieces (GGML_LOG_LEVEL_CONT)
    int              last_level = GGML_LOG_LEVEL_NONE;
};

// the one allowed global: the log callback's state, as g_logger_state in llama-impl.cpp
log_state g_log;

void log_callback(ggml_log_level level, const char * text, void * /*user_data*/) {
    int lvl = level;
    if (lvl == GGML_LOG_LEVEL_CONT) {
        lvl = g_log.last_level;
    }
    {
        std::lock_guard<std::mutex> lock(g_log.mutex);
        if (level != GGML_LOG_LEVEL_CONT) {
            g_log.last_level = level;
            if (level == GGML_LOG_LEVEL_ERROR) {
                g_log.partial.clear();
            }
        }
        if (lvl == GGML_LOG_LEVEL_ERROR) {
            g_log.partial += text;
            std::string msg = g_log.partial;
            while (!msg.empty() && (msg.back() == '\n' || msg.back() == ' ')) {
                msg.pop_back();
            }
            g_log.last_error = msg;
        }
    }
    // errors reach Python as exceptions carrying the message; print them only when debugging
    const int min_level = g_log.min_level.load();
    if (lvl == GGML_LOG_LEVEL_ERROR && min_level > GGML_LOG_LEVEL_INFO) {
        return;
    }
    if (lvl != GGML_LOG_LEVEL_NONE && lvl >= min_level) {
        fputs(text, stderr);
        fflush(stderr);
    }
}

}  // namespace

std::string moetier_py_last_logged_error() {
    std::lock_guard<std::mutex> lock(g_log.mutex);
    return g_log.last_error;
}

void moetier_py_clear_logged_error() {
    std::lock_guard<std::mutex> lock(g_log.mutex);
    g_log.last_error.clear();
}

void register_log(py::module_ & m) {
    llama_log_set(log_callback, nullptr);
    // importing llama_cpp installs its own callback for the whole process: setting a level takes the
    // stream back, so the CLI's level (and its one-line errors) hold whatever was imported before
    m.def(
        "set_log_level",
        [](int level) {
            g_log.min_level.store(level);
            llama_log_set(log_callback, nullptr);
        },
        py::arg("level"),
        "messages at or above level (1 debug, 2 info, 3 warn, 4 error, 6 none) go to stderr; takes the log "
        "stream back from a callback installed since (llama_cpp's)");
    m.attr("LOG_DEBUG") = (int) GGML_LOG_LEVEL_DEBUG;
    m.attr("LOG_INFO")  = (int) GGML_LOG_LEVEL_INFO;
    m.attr("LOG_WARN")  = (int) GGML_LOG_LEVEL_WARN;
    m.attr("LOG_ERROR") = (int) GGML_LOG_LEVEL_ERROR;
    m.attr("LOG_NONE")  = 6;
}
