//! zaio: async file IO for NVMe offload (ZeRO-Infinity), in the spirit of
//! DeepSpeed's `aio_handle`. No Python here; `znative-py` binds it.
//!
//! * Backends: io_uring (one ring of `queue_depth` entries per worker) or a
//!   pool of threads doing blocking `pread`/`pwrite`; `auto` takes io_uring
//!   when `io_uring_setup` works and records why it did not otherwise.
//! * O_DIRECT for the 4096-aligned middle of every request; the unaligned
//!   head and tail go through a buffered descriptor of the same file. A file
//!   system that refuses O_DIRECT at open (tmpfs) gets buffered IO, counted in
//!   [`Stats::direct_refused`].
//! * A caller buffer whose address is not 4096-aligned (relative to the file
//!   offset) is bounced through a per-worker aligned buffer of `block_size`
//!   bytes, one block at a time: correct, O_DIRECT, but slower — allocate
//!   with [`AlignedBuffer`] to avoid it. Counted in [`Stats::bounced`].
//! * Durability: a write's `wait` returns success only after every piece was
//!   written in full (partial writes are retried) and `fdatasync` on the file
//!   returned 0, which flushes data, the metadata needed to read it (size,
//!   allocation) and the device cache. The directory entry of a new file is
//!   not synced (callers that need the name durable fsync the directory).
//! * Writes create the file if needed and never truncate it.
//! * Reads past end of file are an [`AioError::ShortRead`], never zero-filled.

mod backend_threads;
mod backend_uring;
mod buffer;
mod config;
mod engine;
mod error;
mod file;
mod request;

pub use backend_uring::probe as probe_io_uring;
pub use buffer::AlignedBuffer;
pub use config::{AioConfig, BackendKind, ALIGN, MAX_POOL_THREADS};
pub use engine::{Engine, Stats};
pub use error::{AioError, Op};

/// What `auto` would pick here and why: (`"io_uring"` | `"threads"`, reason).
pub fn io_backend_probe() -> (&'static str, String) {
    match probe_io_uring() {
        Ok(()) => ("io_uring", "io_uring_setup succeeded".to_string()),
        Err((why, _)) => ("threads", why),
    }
}
