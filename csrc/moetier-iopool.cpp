#include "moetier-iopool.h"

#include "moetier-impl.h"

#include <algorithm>
#include <chrono>
#include <cstring>

moetier_io_pool::moetier_io_pool(int n_threads, size_t capacity, read_fn fn_) : fn(std::move(fn_)) {
    tasks.resize(capacity);
    landed_ = std::make_unique<std::atomic<uint8_t>[]>(capacity);
    free_ids.reserve(capacity);
    for (size_t i = capacity; i-- > 0;) {
        free_ids.push_back((int32_t) i);
    }
    for (int i = 0; i < n_threads; ++i) {
        threads.emplace_back([this, i] { worker(i); });
    }
}

moetier_io_pool::moetier_io_pool(std::unique_ptr<moetier_uring> ring_,
                                 int                            depth_prefetch,
                                 size_t                         capacity,
                                 prep_fn                        prep_,
                                 finish_fn                      finish_,
                                 int                            n_stage,
                                 size_t                         stage_bytes) :
    ring(std::move(ring_)),
    prep(std::move(prep_)),
    finish(std::move(finish_)),
    depth_pf(std::max(1, depth_prefetch)) {
    tasks.resize(capacity);
    landed_ = std::make_unique<std::atomic<uint8_t>[]>(capacity);
    reads.resize(capacity);
    is_urgent_.assign(capacity, 0);
    pending.assign(capacity, 0);
    part_bad.assign(capacity, 0);
    stage_of.assign(capacity, -1);
    stages.resize(std::max(0, n_stage));
    for (int32_t i = (int32_t) stages.size(); i-- > 0;) {
        stages[i].reserve(stage_bytes);
        free_stages.push_back(i);
    }
    free_ids.reserve(capacity);
    for (size_t i = capacity; i-- > 0;) {
        free_ids.push_back((int32_t) i);
    }
}

// a task's parts in the ring's user data: the task id and the part's index
static uint64_t moetier_io_user_data(int32_t id, unsigned part) {
    return (uint64_t) (uint32_t) id | ((uint64_t) part << 32);
}

void moetier_io_pool::end_flight(int32_t id) {
    --n_flight;
    n_flight_pf -= is_urgent_[id] ? 0 : 1;
}

void moetier_io_pool::end_task(int32_t id, bool ok, const std::string & err, bool in_flight) {
    tasks[id].state = ok ? MOETIER_IO_DONE : MOETIER_IO_FAILED;
    landed_[id].store(ok ? 1 : 0, std::memory_order_release);
    if (!ok && error_msg.empty()) {
        error_msg = err;
    }
    if (stage_of[id] >= 0) {
        free_stages.push_back(stage_of[id]);
        stage_of[id] = -1;
    }
    if (in_flight) {
        end_flight(id);
    }
}

void moetier_io_pool::pump() {
    round.clear();
    for (;;) {
        const bool pf = urgent.empty();
        if (pf && (queue.empty() || n_flight_pf >= depth_pf)) {
            break;
        }
        if (!stages.empty() && free_stages.empty()) {
            break;  // every staging buffer is being read into: the next completion frees one
        }
        std::deque<int32_t> & q  = pf ? queue : urgent;
        const int32_t         id = q.front();
        std::string           err;
        moetier_io_vec_read & rd = reads[id];
        rd                       = moetier_io_vec_read{};
        rd.stage                 = stages.empty() ? nullptr : (uint8_t *) stages[free_stages.back()].data.get();
        tasks[id].t_start_us     = moetier_time_us();
        if (!prep(tasks[id], rd, err) || rd.n_parts == 0 || rd.n_parts > MOETIER_IO_MAX_PARTS) {
            q.pop_front();
            tasks[id].state = MOETIER_IO_FAILED;
            if (error_msg.empty()) {
                error_msg = err.empty() ? "io_uring: a read of no parts" : err;
            }
            continue;
        }
        if (ring->free_entries() < rd.n_parts) {
            break;  // the ring is full: the next completion makes room
        }
        for (unsigned k = 0; k < rd.n_parts; ++k) {
            const moetier_io_part & part = rd.parts[k];
            ring->prep_readv(part.fd, part.iov, part.n_iov, part.offset, moetier_io_user_data(id, k));
        }
        q.pop_front();
        if (rd.stage != nullptr) {
            stage_of[id] = free_stages.back();
            free_stages.pop_back();
        }
        tasks[id].state = MOETIER_IO_RUNNING;
        is_urgent_[id]  = !pf;
        pending[id]     = (uint8_t) rd.n_parts;
        part_bad[id]    = 0;
        ++n_flight;
        n_flight_pf += pf;
        round.push_back(id);
    }
    if (!round.empty() && !ring->submit(false)) {
        // the reads the kernel did not take fail (the cache reads them again synchronously); a task
        // whose first parts it took fails when those end
        if (error_msg.empty()) {
            error_msg = ring->error();
        }
        for (unsigned n = ring->rollback(); n > 0 && !round.empty();) {
            const int32_t  id   = round.back();
            const unsigned drop = std::min<unsigned>(n, pending[id]);
            round.pop_back();
            n -= drop;
            pending[id] -= (uint8_t) drop;
            part_bad[id] = 1;
            if (pending[id] == 0) {
                end_task(id, false, ring->error());
            }
        }
    }
}

void moetier_io_pool::reap(bool block) {
    if (block && n_flight > 0 && !ring->submit(true)) {
        // cannot wait in the kernel: the reads in flight still write into their slots, so keep
        // waiting for them, without spinning hot
        if (error_msg.empty()) {
            error_msg = ring->error();
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    uint64_t ud  = 0;
    int32_t  res = 0;
    while (ring->pop(ud, res)) {
        const int32_t               id   = (int32_t) (uint32_t) ud;
        const moetier_io_vec_read & rd   = reads[id];
        const moetier_io_part &     part = rd.parts[ud >> 32];
        std::string                 err;
        if (res >= 0 && moetier_fault(MOETIER_FAULT_EIO, part.offset)) {
            res = -EIO;
        } else if (res > (int32_t) MOETIER_ALIGN && moetier_fault(MOETIER_FAULT_SHORT, part.offset)) {
            res = (int32_t) MOETIER_ALIGN;
        }
        if (res < 0 || (size_t) res < part.need) {
            part_bad[id] = 1;
            if (error_msg.empty()) {
                error_msg = res < 0 ? format("read failed: %s", strerror(-res)) :
                                      format("short read: %d of %zu bytes", res, part.need);
            }
        }
        if (--pending[id] > 0) {
            continue;  // the task's other parts are still being read
        }
        // the read is over: its share of the disk goes to the next queued read before the finish
        // below (a copy out of a staging buffer) runs, so the disk does not idle meanwhile
        end_flight(id);
        checking.push_back(id);
    }
    if (checking.empty()) {
        return;
    }
    pump();
    for (const int32_t id : checking) {
        std::string err;
        const bool  ok = !part_bad[id] && finish(tasks[id], reads[id], err);
        end_task(id, ok, err, /*in_flight=*/false);
    }
    checking.clear();
    if (!stages.empty()) {
        pump();  // the staging buffers the finished reads of a GGUF held are free again
    }
}

moetier_io_pool::~moetier_io_pool() {
    if (ring) {
        // the kernel may still be writing into the slots: let every read end first
        std::lock_guard<std::mutex> lock(mu);
        queue.clear();
        urgent.clear();
        while (n_flight > 0) {
            reap(true);  // the kernel writes into the slots until its reads end
        }
        return;
    }
    {
        std::lock_guard<std::mutex> lock(mu);
        stop = true;
        queue.clear();
        urgent.clear();
    }
    cv_work.notify_all();
    for (auto & t : threads) {
        t.join();
    }
}

int32_t moetier_io_pool::submit(const moetier_io_task & task, bool is_urgent) {
    int32_t id;
    {
        std::lock_guard<std::mutex> lock(mu);
        if (free_ids.empty()) {
            return -1;
        }
        id = free_ids.back();
        free_ids.pop_back();
        tasks[id]       = task;
        tasks[id].state = MOETIER_IO_QUEUED;
        landed_[id].store(0, std::memory_order_relaxed);
        (is_urgent ? urgent : queue).push_back(id);
        if (ring) {
            // reads that ended since the last call still hold their prefetch lanes until reaped
            reap(false);
            pump();
            return id;
        }
    }
    cv_work.notify_one();
    return id;
}

int32_t moetier_io_pool::state(int32_t id) {
    std::lock_guard<std::mutex> lock(mu);
    if (ring) {
        reap(false);
    }
    return tasks[id].state;
}

int moetier_io_pool::queued_prefetches() {
    std::lock_guard<std::mutex> lock(mu);
    if (ring) {
        reap(false);  // reads that ended free their lanes for queued ones
    }
    return (int) queue.size();
}

bool moetier_io_pool::claim(int32_t id) {
    std::lock_guard<std::mutex> lock(mu);
    if (tasks[id].state != MOETIER_IO_QUEUED) {
        return false;
    }
    auto it = std::find(urgent.begin(), urgent.end(), id);
    if (it != urgent.end()) {
        urgent.erase(it);
    } else {
        queue.erase(std::find(queue.begin(), queue.end(), id));
    }
    tasks[id].state = MOETIER_IO_FREE;
    free_ids.push_back(id);
    cv_done.notify_all();  // a thread may be waiting for it
    return true;
}

int32_t moetier_io_pool::wait(int32_t id) {
    std::unique_lock<std::mutex> lock(mu);
    if (ring) {
        reap(false);
        while (tasks[id].state == MOETIER_IO_QUEUED || tasks[id].state == MOETIER_IO_RUNNING) {
            if (n_flight == 0) {
                pump();     // queued behind prefetches that have ended meanwhile
                if (n_flight == 0) {
                    break;  // cannot start (ring error): reported through error()
                }
            }
            reap(true);
        }
        return tasks[id].state;
    }
    cv_done.wait(lock, [&] { return tasks[id].state != MOETIER_IO_QUEUED && tasks[id].state != MOETIER_IO_RUNNING; });
    return tasks[id].state;
}

void moetier_io_pool::release(int32_t id) {
    std::lock_guard<std::mutex> lock(mu);
    if (tasks[id].state == MOETIER_IO_DONE || tasks[id].state == MOETIER_IO_FAILED) {
        tasks[id].state = MOETIER_IO_FREE;
        free_ids.push_back(id);
    }
}

std::string moetier_io_pool::error() {
    std::lock_guard<std::mutex> lock(mu);
    return error_msg;
}

void moetier_io_pool::worker(int thread_id) {
    std::string err;
    for (;;) {
        moetier_io_task task;
        int32_t         id;
        {
            std::unique_lock<std::mutex> lock(mu);
            cv_work.wait(lock, [&] { return stop || !queue.empty() || !urgent.empty(); });
            if (stop) {
                return;
            }
            std::deque<int32_t> & q = urgent.empty() ? queue : urgent;
            id                      = q.front();
            q.pop_front();
            tasks[id].state = MOETIER_IO_RUNNING;
            task            = tasks[id];
        }
        err.clear();
        moetier_fault_delay(moetier_fault(MOETIER_FAULT_SLOW, 0));  // tests: a device that is behind
        const bool ok = fn(task, thread_id, err);
        {
            std::lock_guard<std::mutex> lock(mu);
            tasks[id].state = ok ? MOETIER_IO_DONE : MOETIER_IO_FAILED;
            landed_[id].store(ok ? 1 : 0, std::memory_order_release);
            if (!ok && error_msg.empty()) {
                error_msg = err;
            }
        }
        cv_done.notify_all();
    }
}
