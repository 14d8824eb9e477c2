//! Page-aligned host buffers for O_DIRECT, locked in RAM when the
//! locked-memory limit allows it.

use std::alloc::{self, Layout};
use std::ptr::NonNull;

use crate::config::ALIGN;

/// A zero-filled, 4096-aligned allocation of `len` bytes (capacity rounded up
/// to a whole page). `mlock` is tried once; if it fails (RLIMIT_MEMLOCK,
/// typically 8 MiB for unprivileged users) the buffer stays unlocked and
/// [`AlignedBuffer::locked`] says so. Freed (and unlocked) on drop.
pub struct AlignedBuffer {
    ptr: NonNull<u8>,
    len: usize,
    layout: Layout,
    locked: bool,
}

// SAFETY: the buffer owns its memory exclusively; access goes through &/&mut.
unsafe impl Send for AlignedBuffer {}
// SAFETY: shared access only hands out `&[u8]`.
unsafe impl Sync for AlignedBuffer {}

impl AlignedBuffer {
    /// Allocates and tries to lock `len` bytes. Returns `None` only when the
    /// allocator is out of memory or `len` overflows.
    pub fn new(len: usize) -> Option<AlignedBuffer> {
        Self::with_lock(len, true)
    }

    /// Like [`AlignedBuffer::new`], without trying `mlock` (bounce buffers).
    pub fn unlocked(len: usize) -> Option<AlignedBuffer> {
        Self::with_lock(len, false)
    }

    fn with_lock(len: usize, lock: bool) -> Option<AlignedBuffer> {
        let cap = len.max(1).checked_next_multiple_of(ALIGN)?;
        let layout = Layout::from_size_align(cap, ALIGN).ok()?;
        // SAFETY: layout has non-zero size.
        let ptr = NonNull::new(unsafe { alloc::alloc_zeroed(layout) })?;
        // SAFETY: ptr..ptr+cap is our allocation.
        let locked = lock && unsafe { libc::mlock(ptr.as_ptr().cast(), cap) } == 0;
        Some(AlignedBuffer {
            ptr,
            len,
            layout,
            locked,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether `mlock` succeeded (pages pinned in RAM).
    pub fn locked(&self) -> bool {
        self.locked
    }

    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: len <= capacity, memory initialised (zeroed) and owned.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuffer {
    fn drop(&mut self) {
        // SAFETY: the same pointer and layout as allocated.
        unsafe {
            if self.locked {
                libc::munlock(self.ptr.as_ptr().cast(), self.layout.size());
            }
            alloc::dealloc(self.ptr.as_ptr(), self.layout);
        }
    }
}

impl std::fmt::Debug for AlignedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlignedBuffer")
            .field("len", &self.len)
            .field("locked", &self.locked)
            .finish()
    }
}
