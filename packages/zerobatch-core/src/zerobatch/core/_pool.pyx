# TaskPool: worker threads that run compiled tasks without the GIL, and Python callables.
#
# Contract
#   submit(task)  (GIL held by the caller)
#     pre:  task->fn and task->arg valid until wait(task) or cancel(task) returns; task not
#           already queued.
#     post: task queued (blocking, GIL released, while the ring is full), state QUEUED; the
#           threads are started if they are not running.
#   wait(task)    (GIL held by the caller)
#     post: returns once task has run (GIL released meanwhile): if no worker has started it,
#           the caller runs it itself; while a worker runs it, the caller sleeps. A waiter
#           never starts another task: tasks queued behind its own belong to later steps, and
#           running them here would make this step wait for work it does not need.
#           task->status holds the task's zb_status code (ZB_E_CANCELLED: dropped). Never
#           raises for a task's failure: the caller maps it.
#   cancel(task, block)  (GIL held by the caller)
#     post: a task no one has started is dropped (True, status ZB_E_CANCELLED); a running one
#           is waited for when `block` (False either way).
#   call(fn) -> Call: a Python callable queued as a task; Call.wait() returns its result (or
#     raises its exception) with the same caller-runs rule.
#   zb_parts_new(parts, job_size, &jobs) / zb_run_parts(pool, tasks, n)  (GIL held by the
#     caller): one batch split in parts: its tasks and jobs in one block; all but the last
#     part queued, the last run here, then the others waited for (see _pool.pxd).
#   Workers take tasks in submission order, skipping tasks a waiter already claimed; with
#   several workers tasks finish in any order.
#
# Threads are Python threads (so the interpreter knows them, and they show in tracebacks)
# that spend their whole life in TaskPool.work() with the GIL released, except while a Call's
# callable runs. stop() lets each worker finish the task in its hands and joins them; queued
# tasks stay queued (a waiter runs its own; start() resumes the rest). zerobatch.core.pool
# stops every pool before a fork and at exit; in the child the queued tasks stay queued (their
# memory was copied) and workers start with the next submit or wait. attach() / detach()
# count the passes using a pool, and the last one out stops its threads.

from cpython.mem cimport PyMem_Malloc
from cpython.ref cimport Py_DECREF, Py_INCREF
from libc.stdint cimport int64_t
from libc.stdlib cimport free, malloc

from zerobatch.core._status cimport ZB_E_CANCELLED, ZB_OK

cdef extern from *:
    """
    #if PY_VERSION_HEX >= 0x030D0000
    #define zb_is_finalizing() Py_IsFinalizing()
    #else
    #define zb_is_finalizing() _Py_IsFinalizing()
    #endif
    """
    # the interpreter is exiting (module globals may be gone: asked of the C API)
    int zb_is_finalizing()

import threading

from zerobatch.formats.errors import ConfigError, StateError

__all__ = ["Call", "TaskPool"]


# Calls cancelled without waiting while a worker ran them, whose owner may drop them at once:
# the pool's reference goes (in _call_body) before the worker writes the task's status and
# state, so these are kept here until that write is done (pruned as calls are made and
# cancelled), never freed under the worker.
cdef list _abandoned = []


cdef void _prune_abandoned():
    cdef Call c
    if _abandoned:
        _abandoned[:] = [c for c in _abandoned if c.task.state != ZB_TASK_DONE]


def abandoned_calls():
    """Calls cancelled without waiting that a worker has not finished yet (for tests)."""
    _prune_abandoned()
    return len(_abandoned)


cdef int _call_run(void *arg) noexcept nogil:
    _call_body(arg)
    return ZB_OK


cdef void _call_body(void *arg) noexcept with gil:
    cdef Call c = <Call>arg
    fn, c.fn = c.fn, None
    try:
        c.result = fn()
    except BaseException as exc:  # handed to the waiting thread
        c.error = exc
    Py_DECREF(c)          # the reference the pool held while the call was queued or running


cdef class TaskPool:
    """Worker threads running compiled tasks with the GIL released, and Python callables.

    Args:
        num_threads: worker threads, 1 to 256.
        capacity: tasks that can be queued at once.
        name: the threads are named ``{name}-0``, ``{name}-1``...
    """

    def __cinit__(self, int num_threads=2, int capacity=256, str name="zerobatch-pool"):
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
        self._users = 0
        pthread_mutex_init(&self._mutex, NULL)
        pthread_cond_init(&self._work_cond, NULL)
        pthread_cond_init(&self._done_cond, NULL)
        self._initialized = True
        self.threads = []
        self._num_threads = num_threads
        self.name = name

    def start(self):
        """Start the worker threads (no-op if they run)."""
        if self.threads:
            return
        pthread_mutex_lock(&self._mutex)
        self._stop = 0
        pthread_mutex_unlock(&self._mutex)
        self.threads = [threading.Thread(target=self.work, name=f"{self.name}-{i}", daemon=True)
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
                if self._stop:
                    break
                task = self._ring[self._head]
                self._head = (self._head + 1) % self._capacity
                self._count -= 1
                pthread_cond_broadcast(&self._done_cond)  # a slot is free
                if task == NULL:
                    continue  # claimed and run by a waiter, or dropped
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
            task.status = ZB_OK
            self._ring[(self._head + self._count) % self._capacity] = task
            self._count += 1
            pthread_cond_signal(&self._work_cond)
            pthread_mutex_unlock(&self._mutex)
        return 0

    cdef zb_task *_claim_locked(self, zb_task *want) noexcept nogil:
        """Take `want` out of the ring (its slot becomes NULL) and mark it running; NULL when
        it is not queued. Called with the mutex held."""
        cdef int64_t i, slot
        for i in range(self._count):
            slot = (self._head + i) % self._capacity
            if self._ring[slot] == want:
                self._ring[slot] = NULL
                want.state = ZB_TASK_RUNNING
                return want
        return NULL

    cdef int wait(self, zb_task *task, bint claim=True) except -1:
        cdef zb_task *job
        if not self.threads and self._count:
            self.start()          # queued tasks and no workers (after a fork, or a stop)
        with nogil:
            pthread_mutex_lock(&self._mutex)
            while task.state != ZB_TASK_DONE:
                if claim and task.state == ZB_TASK_QUEUED:
                    job = self._claim_locked(task)
                    if job != NULL:
                        pthread_mutex_unlock(&self._mutex)
                        job.status = job.fn(job.arg)
                        pthread_mutex_lock(&self._mutex)
                        job.state = ZB_TASK_DONE
                        pthread_cond_broadcast(&self._done_cond)
                        continue
                pthread_cond_wait(&self._done_cond, &self._mutex)
            pthread_mutex_unlock(&self._mutex)
        return 0

    cdef bint cancel(self, zb_task *task, bint block=True) except -1:
        cdef bint dropped = False
        with nogil:
            pthread_mutex_lock(&self._mutex)
            if task.state == ZB_TASK_QUEUED and self._claim_locked(task) != NULL:
                task.state = ZB_TASK_DONE
                task.status = ZB_E_CANCELLED
                dropped = True
            while block and task.state != ZB_TASK_DONE:
                pthread_cond_wait(&self._done_cond, &self._mutex)
            pthread_mutex_unlock(&self._mutex)
        return dropped

    def call(self, fn, *, bint caller_runs=True):
        """Queue the Python callable ``fn`` (no arguments); returns its :class:`Call`.

        With ``caller_runs=False`` the call only ever runs on a worker thread (a waiter
        sleeps until a worker has run it): for callables promised to run on the pool's
        threads, such as a loader's ``transform``.
        """
        if not callable(fn):
            raise ConfigError("call: fn must be callable", field="fn")
        _prune_abandoned()
        cdef Call c = Call.__new__(Call)
        c.fn = fn
        c.caller_runs = caller_runs
        c.pool = self
        c.task.fn = _call_run
        c.task.arg = <void *>c
        Py_INCREF(c)          # held by the pool until the call has run or is dropped
        try:
            self.submit(&c.task)
        except BaseException:
            Py_DECREF(c)
            raise
        return c

    def attach(self):
        """A pass starts using the threads (they start with its first task)."""
        self._users += 1

    def detach(self):
        """A pass is done; the last one out stops the threads when no task is queued (they
        start again with the next task)."""
        cdef int64_t i, live = 0
        if self._users > 0:
            self._users -= 1
        if self._users:
            return
        with nogil:
            pthread_mutex_lock(&self._mutex)
            for i in range(self._count):
                if self._ring[(self._head + i) % self._capacity] != NULL:
                    live += 1
            pthread_mutex_unlock(&self._mutex)
        if live == 0:
            self.stop()

    def stop(self):
        """Let each worker finish the task in its hands and join them; queued tasks stay
        queued (a waiter runs its own; :meth:`start` resumes the rest). Idempotent."""
        if not self.threads:
            return
        with nogil:
            pthread_mutex_lock(&self._mutex)
            self._stop = 1
            pthread_cond_broadcast(&self._work_cond)
            pthread_mutex_unlock(&self._mutex)
        for t in self.threads:
            if t is not threading.current_thread():
                t.join()
        self.threads = []

    def resume(self):
        """Start the threads again if tasks are queued or a pass still uses the pool (after a
        fork in the parent)."""
        if not self.threads and (self._count or self._users):
            self.start()

    def reinit_after_fork(self):
        """In a forked child: the parent's workers do not exist here. Fresh synchronization
        objects (copied in an unknown state) and no threads; the queued tasks stay queued
        (their memory was copied too, so a loader copied into the child goes on): workers
        start with the next submit or wait."""
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
        """Tasks queued and not yet taken by a worker (claimed slots included)."""
        return self._count

    @property
    def users(self):
        """Passes attached to the pool."""
        return self._users

    def __dealloc__(self):
        if self._initialized:
            pthread_cond_destroy(&self._work_cond)
            pthread_cond_destroy(&self._done_cond)
            pthread_mutex_destroy(&self._mutex)
        free(self._ring)


cdef zb_task *zb_parts_new(int64_t parts, size_t job_size, void **jobs) except NULL:
    cdef size_t head = (<size_t>parts * sizeof(zb_task) + 15) & ~(<size_t>15)
    cdef char *block = <char *>PyMem_Malloc(head + <size_t>parts * job_size)
    if block == NULL:
        raise MemoryError()
    jobs[0] = block + head
    return <zb_task *>block


cdef int zb_run_parts(TaskPool pool, zb_task *tasks, int64_t n) except -1:
    cdef int64_t k, submitted = 0
    try:
        for k in range(n - 1):
            pool.submit(&tasks[k])
            submitted += 1
        with nogil:
            tasks[n - 1].status = tasks[n - 1].fn(tasks[n - 1].arg)
    finally:
        for k in range(submitted):
            pool.wait(&tasks[k])
    return 0


cdef class Call:
    """A Python callable queued on a :class:`TaskPool` (made by :meth:`TaskPool.call`)."""

    def wait(self):
        """The callable's result, or its exception raised here; runs it on this thread if no
        worker has started it (unless made with ``caller_runs=False``), else sleeps until it
        is done (GIL released).

        Raises:
            StateError: the call was cancelled before it ran.
        """
        if not self.finished:
            self.pool.wait(&self.task, self.caller_runs)
            self.finished = True
        if self.task.status == ZB_E_CANCELLED:
            raise StateError("the call was cancelled before it ran", field="call")
        if self.error is not None:
            raise self.error
        return self.result

    def cancel(self, bint wait=True):
        """Drop the call if no thread has started it (returns True). Else, with ``wait``, wait
        for it to finish (so nothing it uses is released under it), without ``wait`` return
        at once and let it finish alone. The result is dropped either way; never raises."""
        cdef bint dropped = False
        if wait and zb_is_finalizing():
            wait = False    # at interpreter exit the workers may be gone: a started call may never finish
        if not self.finished:
            dropped = self.pool.cancel(&self.task, wait)
            if dropped:
                self.fn = None
                Py_DECREF(self)        # the pool's reference
            elif not wait:
                _prune_abandoned()
                _abandoned.append(self)  # alive until the worker is done with its task
            self.finished = dropped or wait
        self.result = self.error = None
        return dropped

    def done(self):
        """Whether the call has run (or was dropped)."""
        return self.task.state == ZB_TASK_DONE

    def __dealloc__(self):
        # Unreachable while queued or running: the pool holds a reference until the callable
        # returns, and its owner (or _abandoned, for a call cancelled without waiting) until
        # the worker has written the task's state.
        pass
