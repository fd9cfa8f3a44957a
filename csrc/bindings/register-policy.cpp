// moetier._core: the cache's precision rule and eviction policies on their own, for unit tests and
// for tools that reason about them (the same C++ code the cache runs).

#include "bindings.h"
#include "moetier-precision.h"
#include "moetier-replay.h"
#include "policies/flashmoe.h"
#include "policies/policies.h"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <limits>
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
        std::string err;
        policy_ = moetier_policy_create(name, { w[0], w[1], w[2], w[3] }, {}, &err);
        if (!policy_) {
            throw std::invalid_argument(err);
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

    void on_hit(int32_t slot, int32_t layer, int32_t expert, bool high, int32_t rank, bool batch) {
        check(slot, layer, expert);
        policy_->on_hit(slot, { layer, expert }, high, use_ctx(rank, batch));
    }

    void on_load(int32_t slot, int32_t layer, int32_t expert, bool high, int32_t rank, bool batch) {
        check(slot, layer, expert);
        policy_->on_load(slot, { layer, expert }, high, use_ctx(rank, batch));
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
    moetier_policy_ctx use_ctx(int32_t rank, bool batch) const {
        moetier_policy_ctx c = ctx_;
        c.rank               = rank;
        c.batch              = batch;
        return c;
    }

    void check(int32_t slot, int32_t layer, int32_t expert) const {
        if (slot < 0 || slot >= n_slots_) {
            throw std::out_of_range("slot out of range");
        }
        if (layer < 0 || expert < 0) {
            throw std::out_of_range("layer and expert must not be negative");
        }
    }

    moetier_policy_ptr policy_;
    moetier_policy_ctx ctx_;
    int32_t            n_slots_ = 0;
};

using py_ids = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;

moetier_layer_stats run_replay(const py_ids &                      ids,
                               const py::object &                  weights,
                               int32_t                             n_expert,
                               uint64_t                            bytes_high,
                               uint64_t                            bytes_low,
                               int32_t                             n_slots_high,
                               int32_t                             n_slots_low,
                               const std::string &                 policy,
                               const std::vector<float> &          w,
                               float                               t1,
                               float                               t2,
                               const std::vector<int64_t> &        seq_starts,
                               std::vector<moetier_decision_row> * rows,
                               int32_t                             n_slots_vram = 0) {
    if (ids.ndim() != 3) {
        throw std::invalid_argument("replay: ids [n_tokens, n_layers, n_used]");
    }
    if (w.size() != 4) {
        throw std::invalid_argument("replay: weights of the policy: [w_lru, w_lfu, w_lhu, w_fld]");
    }
    py::array_t<float, py::array::c_style | py::array::forcecast> gw;
    if (!weights.is_none()) {
        gw = weights.cast<py::array_t<float, py::array::c_style | py::array::forcecast>>();
        if (gw.ndim() != 3 || gw.shape(0) != ids.shape(0) || gw.shape(1) != ids.shape(1) ||
            gw.shape(2) != ids.shape(2)) {
            throw std::invalid_argument("replay: gate weights must have the shape of ids");
        }
    }
    moetier_replay_params p;
    p.n_layers     = (int32_t) ids.shape(1);
    p.n_used       = (int32_t) ids.shape(2);
    p.n_expert     = n_expert;
    p.bytes_high   = bytes_high;
    p.bytes_low    = bytes_low;
    p.n_slots_high = n_slots_high;
    p.n_slots_low  = n_slots_low;
    p.n_slots_vram = n_slots_vram;
    p.policy       = policy;
    p.weights      = { w[0], w[1], w[2], w[3] };
    p.rule.t1      = t1;
    p.rule.t2      = t2;
    py::gil_scoped_release release;
    return moetier_replay(p, ids.data(), weights.is_none() ? nullptr : gw.data(), ids.shape(0), seq_starts, rows);
}

}  // namespace

void register_policy(py::module_ & m) {
    m.def(
        "precision_levels",
        [](const std::vector<float> & weights, float t1, float t2) {
            std::vector<moetier_need> needs(weights.size());
            moetier_precision_rule    rule;
            rule.t1 = t1;
            rule.t2 = t2;
            moetier_precision_needs(rule, weights.data(), (int32_t) weights.size(), needs.data());
            std::vector<int> levels(needs.size());
            for (size_t k = 0; k < needs.size(); ++k) {
                levels[k] = (int) needs[k] - MOETIER_NEED_SKIP;  // high 2, low 1, skip 0
            }
            return levels;
        },
        py::arg("weights"), py::arg("t1"), py::arg("t2"),
        "HOBBIT eq. 2 for one token's selected experts: 2 = high, 1 = low, 0 = skip");

    m.def(
        "precision_scores",
        [](py::array_t<float, py::array::c_style | py::array::forcecast> w) {
            if (w.ndim() != 2) {
                throw std::invalid_argument("precision_scores: weights [n_tokens, n_used]");
            }
            py::array_t<float> out({ w.shape(0), w.shape(1) });
            for (py::ssize_t t = 0; t < w.shape(0); ++t) {
                moetier_precision_scores(w.data(t, 0), (int32_t) w.shape(1), out.mutable_data(t, 0));
            }
            return out;
        },
        py::arg("weights"), "HOBBIT eq. 2 scores of each token's selected experts (0 for the top-1)");

    m.def(
        "policy_error",
        [](const std::string & name) -> py::object {
            std::string err;
            if (moetier_policy_create(name, moetier_policy_weights{}, {}, &err)) {
                return py::none();
            }
            return py::str(err);
        },
        py::arg("name"), "why a model cannot run policy name (None: it can), e.g. 'flashmoe:FILE' with a bad file");

    m.def(
        "offline_policy_names",
        []() {
            std::vector<std::string> out;
            for (const char * const * n = moetier_policy_offline_names(); *n; ++n) {
                out.push_back(*n);
            }
            return out;
        },
        "policies that look into the future (Belady): trace replay only");

    m.def(
        "replay",
        [](const py_ids & ids, py::object weights, int32_t n_expert, uint64_t bytes_high, uint64_t bytes_low,
           int32_t n_slots_high, int32_t n_slots_low, const std::string & policy, const std::vector<float> & w,
           float t1, float t2, const std::vector<int64_t> & seq_starts, int32_t n_slots_vram) {
            return run_replay(ids, weights, n_expert, bytes_high, bytes_low, n_slots_high, n_slots_low, policy, w, t1,
                              t2, seq_starts, nullptr, n_slots_vram);
        },
        py::arg("ids"), py::arg("weights"), py::arg("n_expert"), py::arg("bytes_high"), py::arg("bytes_low"),
        py::arg("n_slots_high"), py::arg("n_slots_low"), py::arg("policy"), py::arg("policy_weights"), py::arg("t1"),
        py::arg("t2"), py::arg("seq_starts") = std::vector<int64_t>{ 0 }, py::arg("n_slots_vram") = 0,
        "run a routing trace through the cache's bookkeeping (no reads): the counters it would produce; "
        "n_slots_vram: a VRAM tier over it (the n_vram_* counters)");

    m.def(
        "replay_decisions",
        [](const py_ids & ids, py::object weights, int32_t n_expert, uint64_t bytes_high, uint64_t bytes_low,
           int32_t n_slots_high, int32_t n_slots_low, const std::string & policy, const std::vector<float> & w,
           float t1, float t2, const std::vector<int64_t> & seq_starts) {
            std::vector<moetier_decision_row> rows;
            const moetier_layer_stats c = run_replay(ids, weights, n_expert, bytes_high, bytes_low, n_slots_high,
                                                     n_slots_low, policy, w, t1, t2, seq_starts, &rows);
            const py::ssize_t         n = (py::ssize_t) rows.size();
            py::array_t<int64_t>      decision(n);
            py::array_t<float>        x({ n, (py::ssize_t) MOETIER_FLASHMOE_N_IN });
            py::array_t<double>       next_use(n);
            py::array_t<bool>         chosen(n);
            for (py::ssize_t i = 0; i < n; ++i) {
                decision.mutable_at(i) = rows[i].decision;
                for (int32_t j = 0; j < MOETIER_FLASHMOE_N_IN; ++j) {
                    x.mutable_at(i, j) = rows[i].x[j];
                }
                next_use.mutable_at(i) = rows[i].next_use == UINT64_MAX ? std::numeric_limits<double>::infinity() :
                                                                          (double) rows[i].next_use;
                chosen.mutable_at(i)   = rows[i].chosen;
            }
            py::dict d;
            d["decision"] = decision;
            d["x"]        = x;
            d["next_use"] = next_use;
            d["chosen"]   = chosen;
            return py::make_tuple(c, d);
        },
        py::arg("ids"), py::arg("weights"), py::arg("n_expert"), py::arg("bytes_high"), py::arg("bytes_low"),
        py::arg("n_slots_high"), py::arg("n_slots_low"), py::arg("policy"), py::arg("policy_weights"), py::arg("t1"),
        py::arg("t2"), py::arg("seq_starts") = std::vector<int64_t>{ 0 },
        "replay, logging every eviction decision: per candidate slot, FlashMoE's inputs [1/recency, "
        "frequency/max, layer distance], the ticks to its expert's next use (inf: never) and whether the policy chose "
        "it; (counters, "
        "{decision, x, next_use, chosen})");

    py::class_<py_policy>(m, "Policy")
        .def(py::init<const std::string &, int32_t, const std::vector<float> &>(), py::arg("name"), py::arg("n_slots"),
             py::arg("weights") = std::vector<float>{ 0.25f, 0.25f, 0.25f, 0.25f })
        .def("set_clock", &py_policy::set_clock, py::arg("tick"), py::arg("seq_tick"), py::arg("pass_"),
             py::arg("steps"), py::arg("layer"), py::arg("n_layers"))
        .def("on_hit", &py_policy::on_hit, py::arg("slot"), py::arg("layer"), py::arg("expert"), py::arg("high"),
             py::arg("rank") = 0, py::arg("batch") = false,
             "expert used: rank by gate weight at the ubatch's last token (n_used: earlier tokens only, -1: no "
             "token, a prefetch); batch: a ubatch of several tokens")
        .def("on_load", &py_policy::on_load, py::arg("slot"), py::arg("layer"), py::arg("expert"), py::arg("high"),
             py::arg("rank") = 0, py::arg("batch") = false, "slot filled with the expert (rank, batch: as on_hit)")
        .def("victim", &py_policy::victim, py::arg("excluded"))
        .def("reset_sequence", &py_policy::reset_sequence)
        .def_property_readonly("across_layers", &py_policy::across_layers);
}
