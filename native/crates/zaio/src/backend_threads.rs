//! Blocking `pread`/`pwrite`: the thread-pool backend's workers, and the path
//! every backend uses for bounce pieces and for finishing a partial IO.

use std::sync::Arc;

use crate::buffer::AlignedBuffer;
use crate::config::ALIGN;
use crate::error::{AioError, Op};
use crate::file;
use crate::request::{Mode, Piece, Request, WorkQueue};

/// Moves `len` bytes between `ptr` and the file at `off`, retrying partial
/// transfers and EINTR until done or a real error. O_DIRECT is used only when
/// `direct` and everything is aligned; a partial transfer that leaves the rest
/// unaligned finishes through the buffered descriptor.
fn full_io(
    req: &Request,
    direct: bool,
    mut off: u64,
    mut ptr: *mut u8,
    mut len: usize,
) -> Result<(), AioError> {
    while len > 0 {
        let aligned = off.is_multiple_of(ALIGN as u64)
            && (ptr as usize).is_multiple_of(ALIGN)
            && len.is_multiple_of(ALIGN);
        let fd = match req.files.direct_fd() {
            Some(fd) if direct && aligned => fd,
            _ => req.files.buffered_fd(),
        };
        // SAFETY: ptr..ptr+len lies in the caller's (or the bounce) buffer, alive for the call.
        let n = unsafe {
            match req.op {
                Op::Read => libc::pread(fd, ptr.cast(), len, off as libc::off_t),
                Op::Write => libc::pwrite(fd, ptr.cast(), len, off as libc::off_t),
            }
        };
        if n < 0 {
            let errno = std::io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::EIO);
            if errno == libc::EINTR {
                continue;
            }
            let call = if req.op == Op::Read {
                "pread"
            } else {
                "pwrite"
            };
            return Err(AioError::from_errno(
                req.op,
                req.path.clone(),
                off,
                len,
                call,
                errno,
            ));
        }
        if n == 0 {
            return Err(eof_or_stuck(req, off, len));
        }
        let n = n as usize;
        off += n as u64;
        // SAFETY: n <= len, so the pointer stays inside the buffer.
        ptr = unsafe { ptr.add(n) };
        len -= n;
    }
    Ok(())
}

/// A read that returns 0 hit end of file; a write that returns 0 made no progress.
pub(crate) fn eof_or_stuck(req: &Request, off: u64, len: usize) -> AioError {
    match req.op {
        Op::Read => AioError::ShortRead {
            path: req.path.clone(),
            offset: req.offset,
            len: req.len,
            eof_at: off,
            file_size: file::size(req.files.buffered_fd()),
        },
        Op::Write => AioError::Io {
            op: Op::Write,
            path: req.path.clone(),
            offset: off,
            call: "pwrite",
            source: std::io::Error::new(
                std::io::ErrorKind::WriteZero,
                format!("wrote 0 of {len} bytes"),
            ),
        },
    }
}

/// Runs bytes `[done, len)` of a piece with blocking calls.
pub(crate) fn run_blocking(
    p: &Piece,
    done: usize,
    bounce: &mut Option<AlignedBuffer>,
    block_size: usize,
) -> Result<(), AioError> {
    let req = &p.req;
    if p.mode != Mode::Bounce {
        // SAFETY: done <= len, inside the caller's buffer.
        let ptr = unsafe { p.ptr().add(done) };
        return full_io(
            req,
            p.mode == Mode::Direct,
            p.file_off + done as u64,
            ptr,
            p.len - done,
        );
    }
    // Misaligned caller buffer: O_DIRECT through an aligned buffer, then copy.
    if bounce.is_none() {
        *bounce = Some(
            AlignedBuffer::unlocked(block_size).ok_or_else(|| AioError::Io {
                op: req.op,
                path: req.path.clone(),
                offset: p.file_off,
                call: "alloc",
                source: std::io::Error::from_raw_os_error(libc::ENOMEM),
            })?,
        );
    }
    let Some(b) = bounce.as_mut() else {
        return Ok(());
    };
    let (n, user) = (p.len, p.ptr());
    match req.op {
        Op::Read => {
            full_io(req, true, p.file_off, b.as_mut_ptr(), n)?;
            // SAFETY: both ranges are n bytes (n <= block_size) and do not overlap.
            unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), user, n) };
        }
        Op::Write => {
            // SAFETY: as above.
            unsafe { std::ptr::copy_nonoverlapping(user, b.as_mut_ptr(), n) };
            full_io(req, true, p.file_off, b.as_mut_ptr(), n)?;
        }
    }
    Ok(())
}

/// One pool thread: a blocking IO per piece, until the queue closes.
pub(crate) fn worker(queue: Arc<WorkQueue>, block_size: usize) {
    let mut bounce = None;
    while let Some(p) = queue.pop() {
        let r = run_blocking(&p, 0, &mut bounce, block_size);
        p.req.finish_piece(r);
    }
}
