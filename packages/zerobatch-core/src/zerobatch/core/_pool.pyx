# TaskPool: worker threads that run C tasks without the GIL.
#
# Contract
#   submit(task)  (GIL held by the caller)
#     pre:  task->fn and task->arg valid until wait(task) returns; task not already queued.
#     post: task queued (blocking, GIL released, while the ring is full), state QUEUED.
#   wait(task)    (GIL held by the caller)
#     post: returns once task has run (GIL released meanwhile): if no worker has started it
#           yet, the caller runs it itself; while a worker runs it, the caller runs other
#           queued tasks rather than sleep. task->status holds the task's zb_status code.
#           Never raises for a task's failure: the caller maps it.
#   cancel(task)  (GIL held by the caller)
#     post: a task no one has started is dropped (True); a running one is waited for (False).
#   Workers take tasks in submission order, skipping tasks a waiter already claimed; with
#   several workers tasks finish in any order.
#
# Threads are Python threads (so the interpreter knows them, and they show in tracebacks)
# that spend their whole life in TaskPool.work() with the GIL released. stop() wakes and
# joins them; the zerobatch.core.pool wrapper stops every pool before a fork and at exit.

from libc.stdint cimport int64_t
from libc.stdlib cimport free, malloc

import threading

from zerobatch.formats.errors import ConfigError

__all__ = ["TaskPool"]


cdef class TaskPool:
    """Worker threads running C tasks with the GIL released.

    Args:
        num_threads: worker threads, 1 to 256.
        capacity: tasks that can be queued at once.
    """

    def __cinit__(self, int num_threads=2, int capacity=256):
        if num_threads < 1 or num_threads > 256:
            raise ConfigError(f"num_threads must be between 1 and 256, got {num_threads}",
                              field="num_threads")
        if capacity < 1 or capacity > 1 << 20:
            raise ConfigError(f"capacity must be between 1 and 2**20, got {capacity}",
                              field="capacity")
        self._ring = <zb_task **>malloc(capacity * sizeof(zb_task *))
        if self._ring == NULL:
            raise MemoryError()
        self._capacity = capacity
        self._head = 0
        self._count = 0
        self._stop = 0
        self._running = 0
        pthread_mutex_init(&self._mutex, NULL)
        pthread_cond_init(&self._work_cond, NULL)
        pthread_cond_init(&self._done_cond, NULL)
        self._initialized = True
        self.threads = []
        self._num_threads = num_threads

    def start(self):
        """Start the worker threads (no-op if they run)."""
        if self.threads:
            return
        pthread_mutex_lock(&self._mutex)
        self._stop = 0
        pthread_mutex_unlock(&self._mutex)
        self.threads = [threading.Thread(target=self.work, name=f"zerobatch-pool-{i}", daemon=True)
                        for i in range(self._num_threads)]
        for t in self.threads:
            t.start()

    def work(self):
        """A worker's life: run tasks until stop(). Called on each worker thread."""
        cdef zb_task *task
        with nogil:
            pthread_mutex_lock(&self._mutex)
            self._running += 1
            while True:
                while self._count == 0 and not self._stop:
                    pthread_cond_wait(&self._work_cond, &self._mutex)
                if self._count == 0 and self._stop:
                    break
                task = self._ring[self._head]
                self._head = (self._head + 1) % self._capacity
                self._count -= 1
                pthread_cond_broadcast(&self._done_cond)  # a slot is free
                if task == NULL:
                    continue  # claimed and run by a waiter
                task.state = ZB_TASK_RUNNING
                pthread_mutex_unlock(&self._mutex)
                task.status = task.fn(task.arg)
                pthread_mutex_lock(&self._mutex)
                task.state = ZB_TASK_DONE
                pthread_cond_broadcast(&self._done_cond)
            self._running -= 1
            pthread_mutex_unlock(&self._mutex)

    cdef int submit(self, zb_task *task) except -1:
        if not self.threads:
            self.start()
        with nogil:
            pthread_mutex_lock(&self._mutex)
            while self._count == self._capacity:
                pthread_cond_wait(&self._done_cond, &self._mutex)
            task.state = ZB_TASK_QUEUED
            task.status = 0
            self._ring[(self._head + self._count) % self._capacity] = task
            self._count += 1
            pthread_cond_signal(&self._work_cond)
            pthread_mutex_unlock(&self._mutex)
        return 0

    cdef zb_task *_claim_locked(self, zb_task *want) noexcept nogil:
        """Take `want` (or, if NULL, the oldest queued task) out of the ring and mark it
        running; NULL when there is none. Called with the mutex held."""
        cdef int64_t i, slot
        cdef zb_task *t
        for i in range(self._count):
            slot = (self._head + i) % self._capacity
            t = self._ring[slot]
            if t != NULL and (want == NULL or t == want):
                self._ring[slot] = NULL
                t.state = ZB_TASK_RUNNING
                return t
        return NULL

    cdef int wait(self, zb_task *task) except -1:
        cdef zb_task *job
        with nogil:
            pthread_mutex_lock(&self._mutex)
            while task.state != ZB_TASK_DONE:
                if task.state == ZB_TASK_QUEUED:
                    job = self._claim_locked(task)
                else:
                    # Running on a worker: help with the next queued task rather than sleep.
                    job = self._claim_locked(NULL)
                    if job == NULL:
                        pthread_cond_wait(&self._done_cond, &self._mutex)
                        continue
                pthread_mutex_unlock(&self._mutex)
                job.status = job.fn(job.arg)
                pthread_mutex_lock(&self._mutex)
                job.state = ZB_TASK_DONE
                pthread_cond_broadcast(&self._done_cond)
            pthread_mutex_unlock(&self._mutex)
        return 0

    cdef bint cancel(self, zb_task *task) except -1:
        """Drop `task` if no one has started it (True); else wait for it (False)."""
        cdef bint dropped = False
        with nogil:
            pthread_mutex_lock(&self._mutex)
            if task.state == ZB_TASK_QUEUED and self._claim_locked(task) != NULL:
                task.state = ZB_TASK_DONE
                dropped = True
            while task.state != ZB_TASK_DONE:
                pthread_cond_wait(&self._done_cond, &self._mutex)
            pthread_mutex_unlock(&self._mutex)
        return dropped

    def stop(self):
        """Let the workers finish the queued tasks, then join them. Idempotent."""
        if not self.threads:
            return
        with nogil:
            pthread_mutex_lock(&self._mutex)
            self._stop = 1
            pthread_cond_broadcast(&self._work_cond)
            pthread_mutex_unlock(&self._mutex)
        for t in self.threads:
            t.join()
        self.threads = []

    def reinit_after_fork(self):
        """In a forked child: the parent's workers do not exist here; reset the
        synchronization objects (copied in an unknown state) and forget the threads."""
        pthread_mutex_init(&self._mutex, NULL)
        pthread_cond_init(&self._work_cond, NULL)
        pthread_cond_init(&self._done_cond, NULL)
        self._running = 0
        self._stop = 0
        self.threads = []

    @property
    def num_threads(self):
        """Worker threads this pool runs."""
        return self._num_threads

    @property
    def pending(self):
        """Tasks queued and not yet taken by a worker."""
        return self._count

    def __dealloc__(self):
        if self._initialized:
            pthread_cond_destroy(&self._work_cond)
            pthread_cond_destroy(&self._done_cond)
            pthread_mutex_destroy(&self._mutex)
        free(self._ring)
