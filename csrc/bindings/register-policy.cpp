// moetier._core: the cache's precision rule and eviction policies on their own, for unit tests and
// for tools that reason about them (the same C++ code the cache runs).

#include "bindings.h"

#include "moetier-cache.h"
#include "policies/policies.h"

#include <pybind11/stl.h>

#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

// one policy over n_slots slots, driven by explicit clocks
class py_policy {
public:
    py_policy(const std::string & name, int32_t n_slots, const std::vector<float> & w) {
        if (w.size() != 4) {
            throw std::invalid_argument("weights: expected [w_lru, w_lfu, w_lhu, w_fld]");
        }
        policy_ = moetier_policy_create(name, { w[0], w[1], w[2], w[3] });
        if (!policy_) {
            throw std::invalid_argument("unknown policy '" + name + "'");
        }
        if (n_slots < 1) {
            throw std::invalid_argument("n_slots must be positive");
        }
        n_slots_ = n_slots;
        policy_->init(n_slots);
    }

    void set_clock(uint64_t tick, uint64_t seq_tick, uint64_t pass, uint64_t steps, int32_t layer, int32_t n_layers) {
        ctx_ = { tick, seq_tick, pass, steps, layer, n_layers };
    }

    void on_hit(int32_t slot, int32_t layer, int32_t expert, bool high) {
        check(slot);
        policy_->on_hit(slot, { layer, expert }, high, ctx_);
    }

    void on_load(int32_t slot, int32_t layer, int32_t expert, bool high) {
        check(slot);
        policy_->on_load(slot, { layer, expert }, high, ctx_);
    }

    int32_t victim(const std::vector<uint8_t> & excluded) {
        if ((int32_t) excluded.size() != n_slots_) {
            throw std::invalid_argument("excluded: one flag per slot");
        }
        return policy_->victim(excluded, ctx_);
    }

    void reset_sequence() { policy_->reset_sequence(ctx_); }
    bool across_layers() const { return policy_->across_layers(); }

private:
    void check(int32_t slot) const {
        if (slot < 0 || slot >= n_slots_) {
            throw std::out_of_range("slot out of range");
        }
    }

    moetier_policy_ptr policy_;
    moetier_policy_ctx ctx_;
    int32_t            n_slots_ = 0;
};

} // namespace

void register_policy(py::module_ & m) {
    m.def("precision_levels", [](const std::vector<float> & weights, float t1, float t2) {
        std::vector<uint8_t> levels(weights.size());
        moetier_precision_levels({ t1, t2 }, weights.data(), (int32_t) weights.size(), levels.data());
        return std::vector<int>(levels.begin(), levels.end());
    }, py::arg("weights"), py::arg("t1"), py::arg("t2"),
    "HOBBIT eq. 2 for one token's selected experts: 2 = high, 1 = low, 0 = skip");

    py::class_<py_policy>(m, "Policy")
        .def(py::init<const std::string &, int32_t, const std::vector<float> &>(), py::arg("name"), py::arg("n_slots"),
             py::arg("weights") = std::vector<float>{ 0.25f, 0.25f, 0.25f, 0.25f })
        .def("set_clock", &py_policy::set_clock, py::arg("tick"), py::arg("seq_tick"), py::arg("pass_"), py::arg("steps"),
             py::arg("layer"), py::arg("n_layers"))
        .def("on_hit", &py_policy::on_hit, py::arg("slot"), py::arg("layer"), py::arg("expert"), py::arg("high"))
        .def("on_load", &py_policy::on_load, py::arg("slot"), py::arg("layer"), py::arg("expert"), py::arg("high"))
        .def("victim", &py_policy::victim, py::arg("excluded"))
        .def("reset_sequence", &py_policy::reset_sequence)
        .def_property_readonly("across_layers", &py_policy::across_layers);
}
