# Read-only file mappings that hold no file descriptor.
#
# Contract
#   FileMapping(fd, size)
#     pre:  fd is open for reading; size >= 0 bytes of it exist (the caller checked).
#     post: a MAP_SHARED, PROT_READ mapping of [0, size) exposed through the buffer protocol
#           (read-only, one-dimensional bytes). The descriptor may be closed right away: the
#           mapping keeps the file alive by itself, so thousands of mapped shards cost no
#           descriptors (Python's mmap.mmap dup()s the descriptor and holds it).
#   close() unmaps when no buffer export is alive (else BufferError); the mapping is
#   unmapped on deallocation otherwise. Every export keeps the object alive, so a NumPy
#   array over the mapping can never outlive it.

from cpython.buffer cimport PyBUF_WRITABLE, PyBuffer_FillInfo
from libc.errno cimport errno
from libc.stdint cimport int64_t, uint8_t

import os

from zerobatch.formats.errors import ConfigError, ReadError

__all__ = ["FileMapping"]

cdef extern from "<sys/mman.h>" nogil:
    void *mmap(void *addr, size_t length, int prot, int flags, int fd, long offset)
    int munmap(void *addr, size_t length)
    int madvise(void *addr, size_t length, int advice)
    void *MAP_FAILED
    int PROT_READ
    int MAP_SHARED
    int MADV_RANDOM
    int MADV_SEQUENTIAL
    int MADV_WILLNEED
    int MADV_NORMAL


cdef class FileMapping:
    """A read-only mapping of the first ``size`` bytes of an open file.

    Args:
        fd: a descriptor open for reading (it may be closed once this returns).
        size: bytes to map (0 gives an empty buffer).
        path: the file's name, for errors.

    Raises:
        ReadError: ``mmap`` failed (``errno`` kept).
    """

    def __cinit__(self, int fd, int64_t size, path=None):
        self.addr = NULL
        self.size = size
        self.exports = 0
        self.path = path
        if size < 0:
            raise ConfigError(f"size must be >= 0, got {size}", field="size")
        cdef void *p
        if size > 0:
            p = mmap(NULL, <size_t>size, PROT_READ, MAP_SHARED, fd, 0)
            if p == MAP_FAILED:
                err = errno
                raise ReadError(f"mmap failed: {os.strerror(err)}", errno=err, path=path, field="mmap")
            self.addr = <uint8_t *>p

    @property
    def address(self):
        """The mapping's address (0 when empty), for compiled kernels."""
        return <size_t>self.addr

    @property
    def closed(self):
        return self.addr == NULL and self.size > 0

    def advise(self, advice):
        """``madvise`` the whole mapping: ``"random"``, ``"sequential"``, ``"willneed"`` or
        ``"normal"`` (advisory; errors are ignored)."""
        codes = {"random": MADV_RANDOM, "sequential": MADV_SEQUENTIAL, "willneed": MADV_WILLNEED,
                 "normal": MADV_NORMAL}
        if advice not in codes:
            raise ConfigError(f"advice must be one of {sorted(codes)}, got {advice!r}", field="advice")
        if self.addr != NULL:
            madvise(self.addr, <size_t>self.size, codes[advice])

    def __getbuffer__(self, Py_buffer *view, int flags):
        if flags & PyBUF_WRITABLE:
            raise BufferError("a FileMapping is read-only")
        if self.addr == NULL and self.size > 0:
            raise BufferError("the mapping is closed")
        PyBuffer_FillInfo(view, self, <void *>self.addr if self.addr != NULL else <void *>b"",
                          self.size if self.addr != NULL else 0, 1, flags)
        self.exports += 1

    def __releasebuffer__(self, Py_buffer *view):
        self.exports -= 1

    def close(self):
        """Unmap now.

        Raises:
            BufferError: an array or memoryview over the mapping is still alive.
        """
        if self.exports:
            raise BufferError(f"{self.exports} views of the mapping are still alive")
        self._unmap()

    cdef void _unmap(self) noexcept:
        if self.addr != NULL:
            munmap(self.addr, <size_t>self.size)
            self.addr = NULL

    def __len__(self):
        return self.size if self.addr != NULL or self.size == 0 else 0

    def __dealloc__(self):
        self._unmap()
