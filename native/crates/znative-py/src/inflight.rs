//! Memory that async IO is using, so nothing else touches it until the IO is waited on.
//!
//! An `AioHandle` request keeps its numpy array alive but holds no borrow of it: the
//! memory is reachable from Python through the array, other views of it, or the torch
//! tensor it came from. Every request registers its byte range here from submission
//! until it is waited on; kernels (`arrays::ro` / `arrays::rw`) and new requests check
//! the range they are about to use, and refuse with a `LayoutError` instead of racing
//! the IO worker. Reading memory that IO is also only reading (a write to a file) is
//! allowed; anything else that overlaps is not.

use std::sync::{Mutex, PoisonError};

struct Range {
    owner: usize,
    id: u64,
    start: usize,
    end: usize,
    /// The IO writes this memory (a read from a file); else it only reads it.
    io_writes: bool,
}

static INFLIGHT: Mutex<Vec<Range>> = Mutex::new(Vec::new());

fn ranges() -> std::sync::MutexGuard<'static, Vec<Range>> {
    INFLIGHT.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Request `id` of handle `owner` uses `len` bytes at `start` until it is released.
pub fn register(owner: usize, id: u64, start: usize, len: usize, io_writes: bool) {
    if len > 0 {
        ranges().push(Range {
            owner,
            id,
            start,
            end: start + len,
            io_writes,
        });
    }
}

/// The requests `ids` of handle `owner` were waited on.
pub fn release(owner: usize, ids: &[u64]) {
    ranges().retain(|r| r.owner != owner || !ids.contains(&r.id));
}

/// Every request of handle `owner` is over (the handle drained and is going).
pub fn release_all(owner: usize) {
    ranges().retain(|r| r.owner != owner);
}

/// Why `len` bytes at `start` cannot be used now (`writes`: the user writes them), if so.
pub fn conflict(start: usize, len: usize, writes: bool) -> Option<String> {
    if len == 0 {
        return None;
    }
    let end = start + len;
    let all = ranges();
    let r = all
        .iter()
        .find(|r| r.start < end && start < r.end && (writes || r.io_writes))?;
    let what = if r.io_writes {
        "a file read is still filling"
    } else {
        "a file write is still reading"
    };
    Some(format!(
        "async IO request {} ({what} this memory) has not been waited on; wait for it \
         (`AioRequest.wait()` / `AioHandle.wait()`) before using the buffer",
        r.id
    ))
}
