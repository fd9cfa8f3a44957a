#include "moetier-iopool.h"

#include <algorithm>

moetier_io_pool::moetier_io_pool(int n_threads, size_t capacity, read_fn fn_) : fn(std::move(fn_)) {
    tasks.resize(capacity);
    free_ids.reserve(capacity);
    for (size_t i = capacity; i-- > 0;) {
        free_ids.push_back((int32_t) i);
    }
    for (int i = 0; i < n_threads; ++i) {
        threads.emplace_back([this, i] { worker(i); });
    }
}

moetier_io_pool::~moetier_io_pool() {
    {
        std::lock_guard<std::mutex> lock(mu);
        stop = true;
        queue.clear();
    }
    cv_work.notify_all();
    for (auto & t : threads) {
        t.join();
    }
}

int32_t moetier_io_pool::submit(const moetier_io_task & task) {
    int32_t id;
    {
        std::lock_guard<std::mutex> lock(mu);
        if (free_ids.empty()) {
            return -1;
        }
        id = free_ids.back();
        free_ids.pop_back();
        tasks[id] = task;
        tasks[id].state = MOETIER_IO_QUEUED;
        queue.push_back(id);
    }
    cv_work.notify_one();
    return id;
}

int32_t moetier_io_pool::state(int32_t id) {
    std::lock_guard<std::mutex> lock(mu);
    return tasks[id].state;
}

bool moetier_io_pool::claim(int32_t id) {
    std::lock_guard<std::mutex> lock(mu);
    if (tasks[id].state != MOETIER_IO_QUEUED) {
        return false;
    }
    queue.erase(std::find(queue.begin(), queue.end(), id));
    tasks[id].state = MOETIER_IO_FREE;
    free_ids.push_back(id);
    return true;
}

int32_t moetier_io_pool::wait(int32_t id) {
    std::unique_lock<std::mutex> lock(mu);
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
        int32_t id;
        {
            std::unique_lock<std::mutex> lock(mu);
            cv_work.wait(lock, [&] { return stop || !queue.empty(); });
            if (stop) {
                return;
            }
            id = queue.front();
            queue.pop_front();
            tasks[id].state = MOETIER_IO_RUNNING;
            task = tasks[id];
        }
        err.clear();
        const bool ok = fn(task, thread_id, err);
        {
            std::lock_guard<std::mutex> lock(mu);
            tasks[id].state = ok ? MOETIER_IO_DONE : MOETIER_IO_FAILED;
            if (!ok && error_msg.empty()) {
                error_msg = err;
            }
        }
        cv_done.notify_all();
    }
}
