//! Opening a request's file: a buffered descriptor always, and an O_DIRECT one
//! when the request has a 4096-aligned middle and the file system accepts
//! O_DIRECT (tmpfs and some FUSE file systems refuse it with EINVAL at open;
//! then the whole request is buffered and the fallback is recorded).

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use crate::error::{AioError, Op};

/// The descriptors of one request. Both name the same open file, so one
/// `fdatasync` covers data written through either.
pub(crate) struct Files {
    pub buffered: OwnedFd,
    pub direct: Option<OwnedFd>,
    /// Why O_DIRECT was not used although the request had an aligned middle.
    pub direct_refused: Option<String>,
}

impl Files {
    pub fn buffered_fd(&self) -> RawFd {
        self.buffered.as_raw_fd()
    }

    pub fn direct_fd(&self) -> Option<RawFd> {
        self.direct.as_ref().map(AsRawFd::as_raw_fd)
    }
}

fn c_path(path: &Path) -> Result<CString, AioError> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| AioError::Io {
        op: Op::Read,
        path: path.to_path_buf(),
        offset: 0,
        call: "open",
        source: std::io::Error::new(std::io::ErrorKind::InvalidInput, "path contains a NUL byte"),
    })
}

fn open_raw(path: &CString, flags: libc::c_int) -> Result<OwnedFd, i32> {
    loop {
        // SAFETY: a valid C string; the returned descriptor is owned below.
        let fd = unsafe { libc::open(path.as_ptr(), flags | libc::O_CLOEXEC, 0o644) };
        if fd >= 0 {
            // SAFETY: fd was just opened and is not owned elsewhere.
            return Ok(unsafe { OwnedFd::from_raw_fd(fd) });
        }
        let errno = std::io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO);
        if errno != libc::EINTR {
            return Err(errno);
        }
    }
}

/// Opens `path` for `op` (writes create the file, never truncate: bytes
/// outside the written range stay as they were). `want_direct` asks for an
/// O_DIRECT descriptor too.
pub(crate) fn open(
    op: Op,
    path: &Path,
    offset: u64,
    len: usize,
    want_direct: bool,
) -> Result<Files, AioError> {
    let c = c_path(path)?;
    let base = match op {
        Op::Read => libc::O_RDONLY,
        Op::Write => libc::O_WRONLY | libc::O_CREAT,
    };
    let fail = |errno| AioError::from_errno(op, path.to_path_buf(), offset, len, "open", errno);
    let buffered = open_raw(&c, base).map_err(fail)?;
    let (direct, direct_refused) = if want_direct {
        match open_raw(&c, base | libc::O_DIRECT) {
            Ok(fd) => (Some(fd), None),
            // The file system does not do O_DIRECT (tmpfs, some FUSE): buffered IO instead.
            Err(libc::EINVAL) => (
                None,
                Some(format!(
                    "O_DIRECT refused (EINVAL) for `{}`; used buffered IO",
                    path.display()
                )),
            ),
            Err(errno) => return Err(fail(errno)),
        }
    } else {
        (None, None)
    };
    Ok(Files {
        buffered,
        direct,
        direct_refused,
    })
}

/// The file's size now, for short-read messages (0 if `fstat` fails).
pub(crate) fn size(fd: RawFd) -> u64 {
    // SAFETY: an all-zero stat is a valid value to be overwritten.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fd is open for the duration of the call; st is a valid out pointer.
    if unsafe { libc::fstat(fd, &mut st) } == 0 {
        st.st_size as u64
    } else {
        0
    }
}

/// Flushes data and the metadata needed to read it back (size, block map),
/// and the device's write cache, so a write is durable once this returns.
pub(crate) fn datasync(fd: RawFd, path: &Path, offset: u64, len: usize) -> Result<(), AioError> {
    loop {
        // SAFETY: fd is open for the duration of the call.
        if unsafe { libc::fdatasync(fd) } == 0 {
            return Ok(());
        }
        let errno = std::io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO);
        if errno != libc::EINTR {
            return Err(AioError::from_errno(
                Op::Write,
                PathBuf::from(path),
                offset,
                len,
                "fdatasync",
                errno,
            ));
        }
    }
}
