// moetier_rpc_add_servers and moetier_buffer_type_by_name (moetier.h): the devices a model may be
// placed on, as the llama.cpp tools' --rpc and -ot set them up.

#include "ggml-backend.h"
#include "moetier-impl.h"
#include "moetier.h"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <mutex>
#include <set>
#include <string>

// whether a TCP connection to host:port opens within timeout_ms; why not in err. llama.cpp's RPC
// client aborts the process when a server cannot be reached, so moetier asks first
static bool moetier_tcp_reachable(const std::string & host,
                                  const std::string & port,
                                  int                 timeout_ms,
                                  std::string &       err) {
    addrinfo   hints{};
    addrinfo * res    = nullptr;
    hints.ai_family   = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    const int rc      = getaddrinfo(host.c_str(), port.c_str(), &hints, &res);
    if (rc != 0) {
        err = gai_strerror(rc);
        return false;
    }
    bool ok = false;
    err     = "no address";
    for (addrinfo * a = res; a != nullptr && !ok; a = a->ai_next) {
        const int fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) {
            err = strerror(errno);
            continue;
        }
        if (connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
            ok = true;
        } else if (errno == EINPROGRESS) {
            pollfd    p{ fd, POLLOUT, 0 };
            const int n = poll(&p, 1, timeout_ms);
            int       e = 0;
            socklen_t l = sizeof(e);
            if (n == 1 && getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &l) == 0 && e == 0) {
                ok = true;
            } else {
                err = n == 0 ? "timed out" : strerror(e ? e : errno);
            }
        } else {
            err = strerror(errno);
        }
        close(fd);
    }
    freeaddrinfo(res);
    return ok;
}

bool moetier_rpc_add_servers(const char * servers) {
    // one registry per process: an endpoint registered twice would be two devices on one server
    static std::mutex                 mu;
    static std::set<std::string>      added;
    const std::lock_guard<std::mutex> lock(mu);

    const std::string list = servers ? servers : "";
    ggml_backend_load_all();
    ggml_backend_reg_t rpc = ggml_backend_reg_by_name("RPC");
    if (rpc == nullptr) {
        moetier_set_last_error(MOETIER_ERROR_CONFIG, "rpc: this build has no RPC backend (GGML_RPC)");
        return false;
    }
    using add_server_t    = ggml_backend_reg_t (*)(const char * endpoint);
    const auto add_server = (add_server_t) ggml_backend_reg_get_proc_address(rpc, "ggml_backend_rpc_add_server");
    if (add_server == nullptr) {
        moetier_set_last_error(MOETIER_ERROR_CONFIG, "rpc: the RPC backend has no ggml_backend_rpc_add_server");
        return false;
    }
    size_t n = 0;
    for (size_t beg = 0; beg <= list.size();) {
        size_t end = list.find(',', beg);
        if (end == std::string::npos) {
            end = list.size();
        }
        const std::string endpoint = list.substr(beg, end - beg);
        beg                        = end + 1;
        const size_t colon         = endpoint.rfind(':');
        if (colon == std::string::npos || colon == 0 || colon + 1 == endpoint.size() ||
            endpoint.find_first_not_of("0123456789", colon + 1) != std::string::npos) {
            moetier_set_last_error(MOETIER_ERROR_CONFIG,
                                   format("rpc: '%s' is not HOST:PORT (e.g. 192.168.1.20:50052)", endpoint.c_str()));
            return false;
        }
        ++n;
        if (added.count(endpoint)) {
            continue;
        }
        std::string why;
        if (!moetier_tcp_reachable(endpoint.substr(0, colon), endpoint.substr(colon + 1), 5000, why)) {
            moetier_set_last_error(MOETIER_ERROR_CONFIG,
                                   format("rpc: cannot connect to %s (%s): is ggml-rpc-server running there?",
                                          endpoint.c_str(), why.c_str()));
            return false;
        }
        ggml_backend_reg_t reg = add_server(endpoint.c_str());
        if (reg == nullptr) {
            moetier_set_last_error(MOETIER_ERROR_CONFIG, format("rpc: cannot add the server %s", endpoint.c_str()));
            return false;
        }
        ggml_backend_register(reg);
        added.insert(endpoint);
    }
    if (n == 0) {
        moetier_set_last_error(MOETIER_ERROR_CONFIG, "rpc: no server given (HOST:PORT[,HOST:PORT...])");
        return false;
    }
    return true;
}

ggml_backend_buffer_type_t moetier_buffer_type_by_name(const char * name) {
    ggml_backend_load_all();
    std::string names;
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_buffer_type_t buft = ggml_backend_dev_buffer_type(ggml_backend_dev_get(i));
        if (buft == nullptr) {
            continue;
        }
        if (name != nullptr && std::string(ggml_backend_buft_name(buft)) == name) {
            return buft;
        }
        names += std::string(names.empty() ? "" : ", ") + ggml_backend_buft_name(buft);
    }
    moetier_set_last_error(MOETIER_ERROR_CONFIG, format("unknown buffer type '%s'; the devices here have: %s",
                                                        name ? name : "", names.c_str()));
    return nullptr;
}
