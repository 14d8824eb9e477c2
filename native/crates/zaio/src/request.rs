//! A submitted request, the pieces it is split into, the queue workers pull
//! pieces from, and the table `wait` reads results from.
//!
//! A request over file range `[offset, offset + len)` is split as
//! ```text
//!   head: [offset, up to the next 4096 boundary)    buffered fd
//!   middle: whole 4096-byte units, in block_size    O_DIRECT fd (Direct, or Bounce
//!           pieces                                  when the buffer is misaligned)
//!   tail: the last len % 4096 bytes past the middle buffered fd
//! ```
//! Without an O_DIRECT fd every piece is buffered. The last piece to finish
//! runs `fdatasync` (writes) and posts the result.

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};

use crate::config::ALIGN;
use crate::error::{AioError, Op};
use crate::file::{self, Files};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A worker never panics while holding these locks; recover the data if one did.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// How a piece reaches the disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// O_DIRECT straight from/to the caller's buffer.
    Direct,
    /// Through the page cache (unaligned head/tail, or no O_DIRECT here).
    Buffered,
    /// O_DIRECT through the worker's aligned bounce buffer (misaligned caller buffer).
    Bounce,
}

pub(crate) struct Request {
    pub id: u64,
    pub op: Op,
    pub path: PathBuf,
    pub files: Files,
    /// The caller's buffer; it outlives the request (the submitter's contract).
    pub buf: usize,
    pub len: usize,
    pub offset: u64,
    pub remaining: AtomicUsize,
    pub error: Mutex<Option<AioError>>,
    pub done: Arc<Completions>,
}

impl Request {
    /// Records one finished piece; the last one completes the request.
    pub fn finish_piece(&self, result: Result<(), AioError>) {
        if let Err(e) = result {
            let mut slot = lock(&self.error);
            if slot.is_none() {
                *slot = Some(e);
            }
        }
        if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.complete();
        }
    }

    /// Posts the result (after `fdatasync` for a successful write).
    pub fn complete(&self) {
        let result = match lock(&self.error).take() {
            Some(e) => Err(e),
            None if self.op == Op::Write => {
                file::datasync(self.files.buffered_fd(), &self.path, self.offset, self.len)
                    .map(|()| self.len)
            }
            None => Ok(self.len),
        };
        self.done.post(self.id, result);
    }
}

/// One contiguous IO of a request: `len` bytes at file offset `file_off`,
/// buffer offset `buf_off`.
pub(crate) struct Piece {
    pub req: Arc<Request>,
    pub file_off: u64,
    pub buf_off: usize,
    pub len: usize,
    pub mode: Mode,
}

impl Piece {
    pub fn ptr(&self) -> *mut u8 {
        (self.req.buf + self.buf_off) as *mut u8
    }

    /// The descriptor this piece's mode uses.
    pub fn fd(&self) -> i32 {
        match (self.mode, self.req.files.direct_fd()) {
            (Mode::Direct | Mode::Bounce, Some(fd)) => fd,
            _ => self.req.files.buffered_fd(),
        }
    }
}

/// Whether `[offset, offset+len)` contains at least one aligned 4096-byte unit.
pub(crate) fn has_aligned_middle(offset: u64, len: usize) -> bool {
    let a = ALIGN as u64;
    let start = offset.next_multiple_of(a);
    let end = (offset + len as u64) / a * a;
    start < end
}

/// Splits a request into pieces (see the module docs) and arms its counter.
/// Returns an empty list for a zero-length request.
pub(crate) fn plan(req: &Arc<Request>, block_size: usize) -> Vec<Piece> {
    let a = ALIGN as u64;
    let (start, end) = (req.offset, req.offset + req.len as u64);
    let mut pieces = Vec::new();
    let mut push = |from: u64, to: u64, mode: Mode| {
        let mut at = from;
        while at < to {
            let n = (to - at).min(block_size as u64);
            pieces.push(Piece {
                req: Arc::clone(req),
                file_off: at,
                buf_off: (at - start) as usize,
                len: n as usize,
                mode,
            });
            at += n;
        }
    };
    if req.files.direct.is_some() && has_aligned_middle(start, req.len) {
        let (mid_start, mid_end) = (start.next_multiple_of(a), end / a * a);
        let aligned_buf = (req.buf + (mid_start - start) as usize).is_multiple_of(ALIGN);
        push(start, mid_start, Mode::Buffered);
        push(
            mid_start,
            mid_end,
            if aligned_buf {
                Mode::Direct
            } else {
                Mode::Bounce
            },
        );
        push(mid_end, end, Mode::Buffered);
    } else {
        push(start, end, Mode::Buffered);
    }
    req.remaining.store(pieces.len(), Ordering::Release);
    pieces
}

enum Slot {
    Pending,
    Done(Result<usize, AioError>),
}

/// Results by request id, posted by workers and taken by `wait`.
#[derive(Default)]
pub(crate) struct Completions {
    slots: Mutex<HashMap<u64, Slot>>,
    cv: Condvar,
}

impl Completions {
    pub fn register(&self, id: u64) {
        lock(&self.slots).insert(id, Slot::Pending);
    }

    pub fn post(&self, id: u64, result: Result<usize, AioError>) {
        lock(&self.slots).insert(id, Slot::Done(result));
        self.cv.notify_all();
    }

    /// Blocks until `id` is done and takes its result.
    pub fn wait(&self, id: u64) -> Result<usize, AioError> {
        let mut slots = lock(&self.slots);
        loop {
            match slots.get(&id) {
                None => return Err(AioError::UnknownRequest(id)),
                Some(Slot::Done(_)) => {
                    if let Some(Slot::Done(r)) = slots.remove(&id) {
                        return r;
                    }
                }
                Some(Slot::Pending) => {
                    slots = self.cv.wait(slots).unwrap_or_else(PoisonError::into_inner);
                }
            }
        }
    }

    /// Ids submitted and not yet waited on.
    pub fn ids(&self) -> Vec<u64> {
        let mut ids: Vec<u64> = lock(&self.slots).keys().copied().collect();
        ids.sort_unstable();
        ids
    }
}

/// The pieces waiting for a worker.
#[derive(Default)]
pub(crate) struct WorkQueue {
    state: Mutex<(VecDeque<Piece>, bool)>,
    cv: Condvar,
}

impl WorkQueue {
    pub fn push_all(&self, pieces: Vec<Piece>) {
        lock(&self.state).0.extend(pieces);
        self.cv.notify_all();
    }

    /// The next piece, blocking; `None` once closed and drained.
    pub fn pop(&self) -> Option<Piece> {
        let mut st = lock(&self.state);
        loop {
            if let Some(p) = st.0.pop_front() {
                return Some(p);
            }
            if st.1 {
                return None;
            }
            st = self.cv.wait(st).unwrap_or_else(PoisonError::into_inner);
        }
    }

    pub fn try_pop(&self) -> Option<Piece> {
        lock(&self.state).0.pop_front()
    }

    pub fn close(&self) {
        lock(&self.state).1 = true;
        self.cv.notify_all();
    }
}
